"""The workloads again in jax.numpy, for the `jax` backend (jax.jit, XLA).

Each function takes the same inputs as its PyTorch twin (converted once to jax arrays) and
computes the same thing the way a JAX user writes it. `JAX_NA` names the workloads with no
faithful jit-able twin, and why. Imported only when the jax backend runs.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave the GPU's memory to the other backends

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from .llm_workloads import SOFTCAP, TOP_K
from .workload_base import EPS


def _rmsnorm(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def _layernorm(x, w, b):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + EPS) * w + b


def _gelu(x):
    return jax.nn.gelu(x, approximate=False)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + jnp.concatenate((-x[..., half:], x[..., :half]), axis=-1) * sin


def _linear(x, w, b=None):  # nn.Linear layout: w is (out, in)
    y = x @ w.T
    return y if b is None else y + b


def _attention(q, k, v, causal=False, softcap=None):
    s = (q @ jnp.swapaxes(k, -1, -2)) * q.shape[-1] ** -0.5
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    if causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        keep = jnp.tril(jnp.ones((n_q, n_k), dtype=bool), k=n_k - n_q)
        s = jnp.where(keep, s, -jnp.inf)
    return jax.nn.softmax(s, axis=-1) @ v


def _rope_kv(q, k, v, cos_table, sin_table, pos, k_cache, v_cache):
    cos, sin = cos_table[pos], sin_table[pos]
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    return q, k_cache.at[:, :, pos].set(k), v_cache.at[:, :, pos].set(v)


def _int8_linear(x, w, scales):
    return (x @ w.astype(x.dtype).T) * scales


def _moe(x, gate_w, w1, w3, w2):
    scores = jax.nn.softmax((x @ gate_w.T).astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(scores, TOP_K)
    weights = (weights / weights.sum(-1, keepdims=True)).astype(x.dtype)
    w1e, w3e, w2e = w1[experts], w3[experts], w2[experts]
    h = jax.nn.silu(jnp.einsum("td,tkfd->tkf", x, w1e)) * jnp.einsum("td,tkfd->tkf", x, w3e)
    return jnp.einsum("tkd,tk->td", jnp.einsum("tkf,tkdf->tkd", h, w2e), weights)


def _llama_block(x, attn_norm, wq, wk, wv, wo, ffn_norm, w1, w3, w2, cos, sin):
    b, s, dm = x.shape
    dh = cos.shape[-1]
    nh = dm // dh

    def heads(t):
        return jnp.swapaxes(t.reshape(b, s, nh, dh), 1, 2)

    h = _rmsnorm(x, attn_norm)
    q, k, v = heads(_linear(h, wq)), heads(_linear(h, wk)), heads(_linear(h, wv))
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    a = _attention(q, k, v, causal=True)
    x = x + _linear(jnp.swapaxes(a, 1, 2).reshape(b, s, dm), wo)
    h = _rmsnorm(x, ffn_norm)
    return x + _linear(jax.nn.silu(_linear(h, w1)) * _linear(h, w3), w2)


JAX_FNS = {
    "rmsnorm": _rmsnorm,
    "layernorm": _layernorm,
    "softmax": lambda x: jax.nn.softmax(x, axis=-1),
    "gelu_mul": lambda x: _gelu(x) * x,
    "rope": lambda q, k, cos, sin: (_rotate(q, cos, sin), _rotate(k, cos, sin)),
    "gemm": lambda x, w: x @ w,
    "gelu_linear": lambda x, w, b: _gelu(x @ w + b),
    "linear_silu_res": lambda x, w, b, r: jax.nn.silu(_linear(x, w, b)) + r,
    "mlp": lambda x, w1, b1, w2, b2: _linear(_gelu(_linear(x, w1, b1)), w2, b2),
    "attention": _attention,
    "attention_causal": lambda q, k, v: _attention(q, k, v, causal=True),
    "attention_softcap": lambda q, k, v: _attention(q, k, v, softcap=SOFTCAP),
    "decode": _attention,
    "rope_kv_cache": _rope_kv,
    "int8_gemm": _int8_linear,
    "moe": _moe,
    "llama_block": _llama_block,
}

JAX_NA = {
    "fp8_gemm": "no JAX twin of torch._scaled_mm is written",
}
