"""LLM workloads: attention (prefill plain, causal, soft-capped; decode), RoPE with the
KV-cache update, MoE, int8 weight-only and fp8 GEMMs, and a Llama-style block — each written
the way users write it in PyTorch, not pre-fused.

Work counts (es = element size of the benchmark dtype; B batch, H heads, S query length,
L key length, D head dimension; matrix products count 2 flops per multiply-add, pointwise
math, softmax and normalisations are not counted in flops):

- attention prefill, plain and soft-capped: flops 4·B·H·S·L·D (Q·Kᵀ and P·V); causal: 4·B·H·D
  times the number of unmasked (query, key) pairs, S·(S+1)/2 for S = L. Bytes: q, k, v read
  once, o written once: es·B·H·(2·S·D + 2·L·D).
- decode (S = 1 against an L-token cache): flops 4·B·H·L·D; bytes es·B·H·(2·L·D + 2·D).
- RoPE + KV-cache update (S new tokens): bytes es·(6·B·H·S·D + 2·S·D) + 8·S — q, k, v read,
  the two cos/sin rows per token read, q written and the new k, v rows written into the cache
  (the rest of the cache is not touched), int64 positions read; flops 6 per rotated element
  (2·B·H·S·D elements).
- MoE (T tokens, E experts, top-k = 2, SwiGLU experts D→F→D): flops 2·T·D·E (router) +
  3·2·T·k·D·F (the three expert products over the k routed copies of every token); bytes:
  x, router weights and the weights of every expert some token is routed to, read once,
  the output written once (decode-sized T: memory-bound).
- int8 weight-only GEMM (M, K, N): flops 2·M·N·K; bytes es·M·K + N·K (int8) + es·N (scales)
  + es·M·N.
- fp8 GEMM (M, K, N): flops 2·M·N·K; bytes M·K + N·K (fp8) + 2·M·N (bf16 out) + 8 (scales).
- Llama block (B, S, model dim Dm, H heads of Dh = Dm/H, MLP hidden F): flops
  2·B·S·Dm·(4·Dm + 3·F) (q, k, v, o and the three MLP projections) + 2·B·H·S·(S+1)·Dh
  (causal attention, as above); bytes: x, the nine weight tensors and the cos/sin rows read
  once, the output written once.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .workload_base import Workload, nbytes, randn, rmsnorm, rope_tables, rotate

TOP_K = 2
SOFTCAP = 50.0


# ----------------------------------------------------------------------------- attention

def attention(q, k, v):
    """softmax(q·kᵀ/√d)·v, the textbook way (also decode: q has one position)."""
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    return torch.softmax(s, dim=-1) @ v


def causal_attention(q, k, v):
    n_q, n_k = q.shape[-2], k.shape[-2]
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    keep = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(diagonal=n_k - n_q)
    s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def softcap_attention(q, k, v):
    """Gemma-2 style logit soft-capping: cap · tanh(s / cap) before the softmax."""
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    s = SOFTCAP * torch.tanh(s / SOFTCAP)
    return torch.softmax(s, dim=-1) @ v


def _qkv_inputs(size, device, dtype):
    b, h, s, d = size
    return tuple(randn((b, h, s, d), device, dtype) for _ in range(3))


def _decode_inputs(size, device, dtype):
    b, h, n, d = size
    return (randn((b, h, 1, d), device, dtype), randn((b, h, n, d), device, dtype),
            randn((b, h, n, d), device, dtype))


def _attn_pairs(q, k, causal: bool) -> float:
    n_q, n_k = q.shape[-2], k.shape[-2]
    if not causal:
        return float(n_q * n_k)
    # query i (0-based) sees keys 0 .. i + n_k - n_q
    return float(sum(min(n_k, max(0, i + n_k - n_q + 1)) for i in range(n_q)))


def _attn_flops(causal: bool):
    def flops(inputs):
        q, k, _ = inputs
        b, h, _, d = q.shape
        return 4.0 * b * h * d * _attn_pairs(q, k, causal)
    return flops


def _attn_bytes(inputs):
    q, k, v = inputs
    return float(2 * nbytes(q) + nbytes(k, v))


# ----------------------------------------------------------------------------- RoPE + KV cache

def rope_kv_update(q, k, v, cos_table, sin_table, pos, k_cache, v_cache):
    """Rotate the new q, k at their positions and write k, v into the preallocated cache in
    place; returns q and the updated caches (as an inference loop hands them on)."""
    cos, sin = cos_table[pos], sin_table[pos]
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    k_cache.index_copy_(2, pos, k)
    v_cache.index_copy_(2, pos, v)
    return q, k_cache, v_cache


def _rope_kv_inputs(size, device, dtype):
    b, h, s, d, cache_len = size
    cos, sin = rope_tables(cache_len, d, device, dtype)
    start = cache_len // 2
    pos = torch.arange(start, start + s, device=device)
    return (randn((b, h, s, d), device, dtype), randn((b, h, s, d), device, dtype),
            randn((b, h, s, d), device, dtype), cos, sin, pos,
            torch.zeros((b, h, cache_len, d), device=device, dtype=dtype),
            torch.zeros((b, h, cache_len, d), device=device, dtype=dtype))


def _rope_kv_bytes(inputs):
    q, _, _, cos, _, pos = inputs[:6]
    b, h, s, d = q.shape
    return float(q.element_size() * (6 * b * h * s * d + 2 * s * d) + nbytes(pos))


# ----------------------------------------------------------------------------- MoE

def _moe(x, gate_w, w1, w3, w2, gate_dtype):
    scores = torch.softmax(F.linear(x, gate_w), dim=-1, dtype=gate_dtype)
    weights, experts = torch.topk(scores, TOP_K, dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
    w1e, w3e, w2e = w1[experts], w3[experts], w2[experts]  # (T, k, F, D), (T, k, D, F)
    h = F.silu(torch.einsum("td,tkfd->tkf", x, w1e)) * torch.einsum("td,tkfd->tkf", x, w3e)
    y = torch.einsum("tkf,tkdf->tkd", h, w2e)
    return torch.einsum("tkd,tk->td", y, weights)


def moe(x, gate_w, w1, w3, w2):
    """Mixtral MoE as gpt-fast writes it for torch.compile: softmax router in float32, top-2,
    renormalised; each token's experts gathered (w[experts]) and applied by einsum — static
    shapes, so the whole layer is one graph (the Hugging Face loop over experts with
    torch.where graph-breaks inside the loop, and Dynamo then runs the whole frame eagerly)."""
    return _moe(x, gate_w, w1, w3, w2, torch.float32)


def _moe_ref(x, gate_w, w1, w3, w2):
    return _moe(x, gate_w, w1, w3, w2, torch.float64)


def _moe_inputs(size, device, dtype):
    t, d, f, e = size
    # router weights scaled so that top-k choices are rarely near-ties
    return (randn((t, d), device, dtype), randn((e, d), device, dtype, 1.0),
            randn((e, f, d), device, dtype, 1 / math.sqrt(d)),
            randn((e, f, d), device, dtype, 1 / math.sqrt(d)),
            randn((e, d, f), device, dtype, 1 / math.sqrt(f)))


def _moe_flops(inputs):
    x, gate_w, w1 = inputs[:3]
    t, d = x.shape
    return 2.0 * t * d * gate_w.shape[0] + 3 * 2.0 * t * TOP_K * d * w1.shape[1]


def _moe_bytes(inputs):
    """x, router weights and the weights of the experts the tokens are routed to (each read
    once), the output written once."""
    x, gate_w, w1, w3, w2 = inputs
    used = torch.topk(F.linear(x.float(), gate_w.float()), TOP_K, dim=-1).indices.unique()
    per_expert = nbytes(w1[0], w3[0], w2[0])
    return float(nbytes(x, gate_w) + used.numel() * per_expert + nbytes(x))


# ----------------------------------------------------------------------------- quantized GEMMs

def int8_linear(x, w_int8, scales):
    """Weight-only int8 (gpt-fast style): dequantise by casting, per-output-channel scales."""
    return F.linear(x, w_int8.to(x.dtype)) * scales


def _int8_inputs(size, device, dtype):
    m, k, n = size
    w = torch.randint(-127, 128, (n, k), device=device, dtype=torch.int8)
    scales = (torch.rand(n, device=device) * 0.02 + 0.01) / math.sqrt(k)
    return randn((m, k), device, dtype), w, scales.to(dtype)


def _gemm_flops(inputs):
    x, w = inputs[0], inputs[1]
    return 2.0 * x.shape[0] * x.shape[1] * w.shape[0]


def _int8_bytes(inputs):
    x, w, scales = inputs
    return float(nbytes(x, w, scales) + x.shape[0] * w.shape[0] * x.element_size())


def fp8_linear(x_fp8, w_fp8, scale_x, scale_w):
    """Per-tensor-scaled fp8 GEMM through torch._scaled_mm, bf16 output."""
    return torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=scale_x, scale_b=scale_w,
                            out_dtype=torch.bfloat16)


def _fp8_ref(x, w, scale_x, scale_w):
    return (x.double() * scale_x.double()) @ (w.double() * scale_w.double()).t()


def _fp8_inputs(size, device, dtype):
    m, k, n = size
    x = randn((m, k), device, torch.float32).to(torch.float8_e4m3fn)
    w = randn((n, k), device, torch.float32).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device, dtype=torch.float32)
    return x, w, one, one / math.sqrt(k)


def _fp8_bytes(inputs):
    x, w = inputs[0], inputs[1]
    return float(nbytes(x, w) + 2 * x.shape[0] * w.shape[0] + 8)


def _fp8_requires(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "fp8 GEMM needs a CUDA GPU (torch._scaled_mm); this run is on the CPU"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"fp8 GEMM needs compute capability 8.9 or newer; this GPU is sm_{major}{minor}"
    return None


# ----------------------------------------------------------------------------- Llama block

def llama_block(x, attn_norm, wq, wk, wv, wo, ffn_norm, w1, w3, w2, cos, sin):
    """One Llama decoder layer (prefill): RMSNorm, q/k/v projections, RoPE, causal SDPA,
    output projection and residual, RMSNorm, SwiGLU MLP and residual."""
    b, s, dm = x.shape
    dh = cos.shape[-1]
    nh = dm // dh
    h = rmsnorm(x, attn_norm)
    q = F.linear(h, wq).view(b, s, nh, dh).transpose(1, 2)
    k = F.linear(h, wk).view(b, s, nh, dh).transpose(1, 2)
    v = F.linear(h, wv).view(b, s, nh, dh).transpose(1, 2)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + F.linear(a.transpose(1, 2).reshape(b, s, dm), wo)
    h = rmsnorm(x, ffn_norm)
    return x + F.linear(F.silu(F.linear(h, w1)) * F.linear(h, w3), w2)


def _llama_inputs(size, device, dtype):
    b, s, dm, nh, f = size
    dh = dm // nh
    cos, sin = rope_tables(s, dh, device, dtype)

    def w(o, i):
        return randn((o, i), device, dtype, 1 / math.sqrt(i))

    return (randn((b, s, dm), device, dtype), randn((dm,), device, dtype, 0.1, 1.0),
            w(dm, dm), w(dm, dm), w(dm, dm), w(dm, dm), randn((dm,), device, dtype, 0.1, 1.0),
            w(f, dm), w(f, dm), w(dm, f), cos, sin)


def _llama_flops(inputs):
    x, w1, cos = inputs[0], inputs[7], inputs[10]
    b, s, dm = x.shape
    dh = cos.shape[-1]
    nh = dm // dh
    return 2.0 * b * s * dm * (4 * dm + 3 * w1.shape[0]) + 2.0 * b * nh * s * (s + 1) * dh


def _llama_bytes(inputs):
    return float(nbytes(*inputs) + nbytes(inputs[0]))


LLM_WORKLOADS = (
    Workload("attention", _qkv_inputs, attention, _attn_flops(False), _attn_bytes,
             {"quick": (1, 4, 128, 32), "full": (4, 32, 4096, 128)}, "compute",
             "prefill: softmax(q·kᵀ/√d)·v", dynamic_axis=2, size_names="B,H,S,D"),
    Workload("attention_causal", _qkv_inputs, causal_attention, _attn_flops(True), _attn_bytes,
             {"quick": (1, 4, 128, 32), "full": (4, 32, 4096, 128)}, "compute",
             "prefill, causal mask by masked_fill(-inf)", dynamic_axis=2, size_names="B,H,S,D"),
    Workload("attention_softcap", _qkv_inputs, softcap_attention, _attn_flops(False),
             _attn_bytes, {"quick": (1, 4, 128, 32), "full": (4, 32, 4096, 128)}, "compute",
             f"prefill, logits soft-capped: {SOFTCAP:g}·tanh(s/{SOFTCAP:g})", dynamic_axis=2,
             size_names="B,H,S,D"),
    Workload("decode", _decode_inputs, attention, _attn_flops(False), _attn_bytes,
             {"quick": (2, 4, 1024, 32), "full": (32, 32, 8192, 128)}, "memory",
             "one query token against an L-token KV cache", dynamic_axis=2,
             size_names="B,H,L,D"),
    Workload("rope_kv_cache", _rope_kv_inputs, rope_kv_update,
             lambda inputs: 6.0 * 2 * inputs[0].numel(), _rope_kv_bytes,
             {"quick": (1, 4, 32, 32, 256), "full": (8, 32, 512, 128, 8192)}, "memory",
             "RoPE on q, k at positions; index_copy_ of k, v into the cache", dynamic_axis=2,
             size_names="B,H,S,D,cache"),
    Workload("moe", _moe_inputs, moe, _moe_flops, _moe_bytes,
             {"quick": (16, 128, 256, 8), "full": (8, 4096, 14336, 8)}, "memory",
             f"softmax router, top-{TOP_K}, renormalise; gathered SwiGLU experts (einsum)",
             dynamic_axis=0, ref_fn=_moe_ref, size_names="T,D,F,E"),
    Workload("int8_gemm", _int8_inputs, int8_linear, _gemm_flops, _int8_bytes,
             {"quick": (16, 512, 512), "full": (16, 8192, 8192)}, "memory",
             "F.linear(x, w_int8.to(x.dtype)) * scales", dynamic_axis=0, size_names="M,K,N"),
    Workload("fp8_gemm", _fp8_inputs, fp8_linear, _gemm_flops, _fp8_bytes,
             {"quick": (256, 512, 512), "full": (8192, 8192, 8192)}, "compute",
             "torch._scaled_mm, e4m3 inputs, per-tensor scales, bf16 out", dynamic_axis=0,
             ref_fn=_fp8_ref, requires=_fp8_requires, size_names="M,K,N"),
    Workload("llama_block", _llama_inputs, llama_block, _llama_flops, _llama_bytes,
             {"quick": (1, 64, 128, 4, 256), "full": (1, 4096, 4096, 32, 14336)}, "compute",
             "RMSNorm, QKV, RoPE, causal SDPA, out-proj + residual, RMSNorm, SwiGLU + residual",
             dynamic_axis=1, size_names="B,S,Dm,H,F"),
)
