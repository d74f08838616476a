"""PyTorch's inference fast paths for transformer layers, spelt out as the layers' own ops.

In eval mode, without gradients, `nn.TransformerEncoderLayer` calls
`aten._transformer_encoder_layer_fwd`, also under Dynamo: one ATen kernel, which a graph would
run as an opaque extern call, nothing fused into or around it. A self-attention
`nn.MultiheadAttention` calls `aten._native_multi_head_attention` in eager mode; Dynamo takes
its slow path (scaled-dot-product attention, already fused), so that op reaches a graph only
where a program calls it itself. These
decompositions give AOTAutograd the computation those kernels perform, in the ops the
layers' slow path is made of (linear layers, `layer_norm`, softmax attention, gelu or relu),
so the products take their epilogues, the norms fuse with the residual adds, and the
attention becomes the derived flash kernel.

The native kernels' semantics are kept: q is scaled by 1/√d before its product with kᵀ, gelu
is the exact one (the fast path takes it for `nn.GELU` of either approximation), `need_weights`
returns the probabilities averaged over heads (or per head), and a mask masks where it is
non-zero: the native kernels read a float mask as a boolean one (`-inf` and `0.5` alike mask),
by its `mask_type` an (L, L) attention mask (0), a (B, L) key-padding mask (1) or a merged
(B, H, L, L) one (2). A query row whose keys are all masked gives 0, as PyTorch's CUDA kernel
and scaled-dot-product attention give (the CPU kernel gives NaN). A nested tensor, an
unbatched input, a cross-attention (query, key and value not one tensor) or a mask of another
shape keeps the ATen kernel (the decomposition returns `NotImplemented`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def _fits(x: torch.Tensor, embed_dim: int, num_heads: int) -> bool:
    return not x.is_nested and x.dim() == 3 and isinstance(embed_dim, int) and isinstance(num_heads, int) \
        and num_heads > 0 and embed_dim % num_heads == 0


def _masked(mask, mask_type, x):
    """The mask as booleans broadcasting against the (B, H, L, L) scores (True: masked), or
    None where its shape is not one `mask_type` names."""
    batch, length = x.shape[0], x.shape[1]
    masked = mask if mask.dtype == torch.bool else mask != 0
    if masked.dim() == 0 or masked.shape[-1] != length:
        return None
    if mask_type == 1 and masked.dim() == 2:
        return masked.view(batch, 1, 1, length)
    if mask_type == 0 and masked.dim() == 2 or mask_type in (2, None) and masked.dim() == 4:
        return masked
    return None


def _self_attention(x, embed_dim: int, num_heads: int, qkv_weight, qkv_bias, proj_weight, proj_bias, masked=None):
    """(attention output (B, L, E), probabilities (B, H, L, L)) of a packed-projection
    self-attention, as the native kernel computes them."""
    batch, length = x.shape[0], x.shape[1]
    head_dim = embed_dim // num_heads
    qkv = F.linear(x, qkv_weight, qkv_bias).view(batch, length, 3, num_heads, head_dim)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    scores = (q * (1.0 / math.sqrt(head_dim))) @ k.transpose(-2, -1)
    if masked is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        probs = aten._safe_softmax(scores.masked_fill(masked, float("-inf")), -1)
    heads = (probs @ v).transpose(1, 2).reshape(batch, length, embed_dim)
    return F.linear(heads, proj_weight, proj_bias), probs


def native_multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight,
                                proj_bias, mask=None, need_weights=True, average_attn_weights=True,
                                mask_type=None):
    if not (query is key and key is value) or not _fits(query, embed_dim, num_head):
        return NotImplemented
    masked = None if mask is None else _masked(mask, mask_type, query)
    if mask is not None and masked is None:
        return NotImplemented
    out, probs = _self_attention(query, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias, masked)
    if not need_weights:
        return out, None
    return out, (probs.mean(dim=1) if average_attn_weights else probs)


def transformer_encoder_layer(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu,
                              norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2,
                              ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2, mask=None, mask_type=None):
    if not _fits(src, embed_dim, num_heads):
        return NotImplemented
    masked = None if mask is None else _masked(mask, mask_type, src)
    if mask is not None and masked is None:
        return NotImplemented

    def norm(t, weight, bias):
        return F.layer_norm(t, (embed_dim,), weight, bias, eps)

    x = norm(src, norm_weight_1, norm_bias_1) if norm_first else src
    x = _self_attention(x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, masked)[0] + src
    if not norm_first:
        x = norm(x, norm_weight_1, norm_bias_1)
    residual = x
    if norm_first:
        x = norm(x, norm_weight_2, norm_bias_2)
    hidden = F.linear(x, ffn_weight_1, ffn_bias_1)
    hidden = F.gelu(hidden) if use_gelu else F.relu(hidden)
    x = F.linear(hidden, ffn_weight_2, ffn_bias_2) + residual
    return norm(x, norm_weight_2, norm_bias_2) if not norm_first else x


def decompositions() -> dict:
    """The table entries, for the ops this PyTorch has."""
    table = {}
    for name, fn in (("_transformer_encoder_layer_fwd", transformer_encoder_layer),
                     ("_native_multi_head_attention", native_multi_head_attention)):
        packet = getattr(aten, name, None)
        if packet is not None and hasattr(packet, "default"):
            table[packet.default] = fn
    return table


__all__ = ["decompositions", "native_multi_head_attention", "transformer_encoder_layer"]
