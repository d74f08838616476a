"""A Llama-style transformer as gpt-fast writes it: a fused `wqkv` projection, RoPE applied
to (real, imaginary) pairs in float32, grouped-query attention by `repeat_interleave`, a
static KV cache written with index assignment at `input_pos`, the causal mask sliced from a
buffer by `input_pos`, SDPA, RMSNorm computed in float32, and a SwiGLU MLP. The same module
serves prefill (`input_pos = arange(S)`) and one-token decode (`input_pos = [p]`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    block_size: int = 2048
    vocab_size: int = 32000
    n_layer: int = 22
    n_head: int = 32
    n_local_heads: int = 4
    dim: int = 2048
    intermediate_size: int = 5632
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head


class KVCache(nn.Module):
    def __init__(self, batch: int, max_seq: int, heads: int, head_dim: int, dtype):
        super().__init__()
        shape = (batch, heads, max_seq, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype))

    def update(self, input_pos, k_val, v_val):
        k_out, v_out = self.k_cache, self.v_cache
        k_out[:, :, input_pos] = k_val
        v_out[:, :, input_pos] = v_val
        return k_out, v_out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


def precompute_freqs_cis(seq_len: int, n_elem: int, base: float, dtype) -> torch.Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: n_elem // 2].float() / n_elem))
    t = torch.arange(seq_len, device=freqs.device)
    freqs = torch.outer(t, freqs)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    return torch.stack([freqs_cis.real, freqs_cis.imag], dim=-1).to(dtype)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out = torch.stack([
        xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
        xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
    ], -1)
    return x_out.flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        total_head_dim = (a.n_head + 2 * a.n_local_heads) * a.head_dim
        self.wqkv = nn.Linear(a.dim, total_head_dim, bias=False)
        self.wo = nn.Linear(a.dim, a.dim, bias=False)
        self.kv_cache: KVCache | None = None
        self.n_head, self.n_local_heads = a.n_head, a.n_local_heads
        self.head_dim, self.dim = a.head_dim, a.dim

    def forward(self, x, freqs_cis, mask, input_pos):
        bsz, seqlen, _ = x.shape
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)
        k = k.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        y = y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim)
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.intermediate_size, bias=False)
        self.w3 = nn.Linear(a.dim, a.intermediate_size, bias=False)
        self.w2 = nn.Linear(a.intermediate_size, a.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attention = Attention(a)
        self.feed_forward = FeedForward(a)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)

    def forward(self, x, input_pos, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.config = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(TransformerBlock(a) for _ in range(a.n_layer))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        self.freqs_cis: torch.Tensor | None = None
        self.causal_mask: torch.Tensor | None = None
        for p in self.parameters():  # small random weights (std 0.02), as a trained model has
            nn.init.normal_(p, std=0.02) if p.dim() > 1 else nn.init.normal_(p, 1.0, 0.1)

    def setup_caches(self, max_batch_size: int, max_seq_length: int) -> None:
        a, dtype = self.config, self.output.weight.dtype
        device = self.output.weight.device
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(max_batch_size, max_seq_length, a.n_local_heads,
                                               a.head_dim, dtype).to(device)
        self.freqs_cis = precompute_freqs_cis(a.block_size, a.head_dim, a.rope_base,
                                              dtype).to(device)
        self.causal_mask = torch.tril(torch.ones(max_seq_length, max_seq_length,
                                                 dtype=torch.bool, device=device))

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        assert self.freqs_cis is not None, "call setup_caches first"
        mask = self.causal_mask[None, None, input_pos]
        freqs_cis = self.freqs_cis[input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, input_pos, freqs_cis, mask)
        return self.output(self.norm(x))
