"""Benchmark workloads: small programs written as plain PyTorch, the way users write them.

Each `Workload` (see `workload_base`) knows how to make fresh random inputs for a named size
("quick" for CPU and tests, "full" for a GPU), the function to run (not pre-fused: the
compilers under test have to find the fusion), and its work: `flops(inputs)` and
`bytes(inputs)`. This module holds the operator-level workloads and the registry; the LLM
workloads (attention, decode, KV cache, MoE, quantized GEMMs, Llama block) are in
`llm_workloads`; whole models (the `models` group) in `zoo`.

Byte counts are the compulsory traffic of an ideal implementation: every input read once
and every output written once (intermediates never touch memory). Throughput against it is
the "effective bandwidth" of a kernel. Flop counts of the normalisations are approximate
(a handful per element: rmsnorm 4, layernorm 8, softmax 5, gelu·x 20, rope 6 per rotated
element); for matrix products they are exactly 2·M·N·K per product (gemm, gelu_linear: one
product; mlp: two, 2·2·M·D·H).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .llm_workloads import LLM_WORKLOADS
from .workload_base import EPS, Inputs, Workload, rmsnorm, rope_tables, rotate
from .zoo import MODEL_WORKLOADS
from .workload_base import nbytes as _nbytes
from .workload_base import randn as _randn

__all__ = ["EPS", "Inputs", "Workload", "WORKLOADS", "get_workloads"]


# ----------------------------------------------------------------------------- rmsnorm

def _rows_inputs(size, device, dtype):
    m, n = size
    return _randn((m, n), device, dtype), _randn((n,), device, dtype, 0.1, 1.0)


# ----------------------------------------------------------------------------- layernorm

def layernorm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), w, b, eps=EPS)


def _layernorm_inputs(size, device, dtype):
    m, n = size
    return (_randn((m, n), device, dtype), _randn((n,), device, dtype, 0.1, 1.0),
            _randn((n,), device, dtype, 0.1))


# ----------------------------------------------------------------------------- softmax

def softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, -1)


def _softmax_inputs(size, device, dtype):
    m, n = size
    return (_randn((m, n), device, dtype, 2.0),)


# ----------------------------------------------------------------------------- gelu_linear

def gelu_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.gelu(x @ w + b)


def _gelu_linear_inputs(size, device, dtype):
    m, k, n = size
    return (_randn((m, k), device, dtype), _randn((k, n), device, dtype, 1 / math.sqrt(k)),
            _randn((n,), device, dtype, 0.1))


def _gelu_linear_flops(inputs):
    x, w = inputs[0], inputs[1]
    return 2.0 * x.shape[0] * x.shape[1] * w.shape[1]


def _gelu_linear_bytes(inputs):
    x, w, b = inputs
    return _nbytes(x, w, b) + x.shape[0] * w.shape[1] * x.element_size()


# ----------------------------------------------------------------------------- gemm

def gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


def _gemm_inputs(size, device, dtype):
    m, k, n = size
    return _randn((m, k), device, dtype), _randn((k, n), device, dtype, 1 / math.sqrt(k))


def _gemm_bytes(inputs):
    x, w = inputs[0], inputs[1]
    return float(_nbytes(*inputs) + x.shape[0] * w.shape[1] * x.element_size())


# ----------------------------------------------------------------------------- linear_silu_res

def linear_silu_residual(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                         r: torch.Tensor) -> torch.Tensor:
    """nn.Linear (out, in) weights, SiLU, residual add: a GEMM with a three-op epilogue."""
    return F.silu(F.linear(x, w, b)) + r


def _linear_res_inputs(size, device, dtype):
    m, k, n = size
    return (_randn((m, k), device, dtype), _randn((n, k), device, dtype, 1 / math.sqrt(k)),
            _randn((n,), device, dtype, 0.1), _randn((m, n), device, dtype))


def _linear_res_flops(inputs):
    x, w = inputs[0], inputs[1]
    return 2.0 * x.shape[0] * x.shape[1] * w.shape[0]


def _linear_res_bytes(inputs):
    return float(_nbytes(*inputs) + _nbytes(inputs[3]))


# ----------------------------------------------------------------------------- mlp

def mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor,
        w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """Linear(d, h) -> GELU -> Linear(h, d), weights in nn.Linear's (out, in) layout."""
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def _mlp_inputs(size, device, dtype):
    m, d, h = size
    return (_randn((m, d), device, dtype), _randn((h, d), device, dtype, 1 / math.sqrt(d)),
            _randn((h,), device, dtype, 0.1), _randn((d, h), device, dtype, 1 / math.sqrt(h)),
            _randn((d,), device, dtype, 0.1))


def _mlp_flops(inputs):
    x, w1 = inputs[0], inputs[1]
    m, d, h = x.shape[0], x.shape[1], w1.shape[0]
    return 2.0 * 2.0 * m * d * h


def _mlp_bytes(inputs):
    x = inputs[0]
    return _nbytes(*inputs) + x.numel() * x.element_size()


# ----------------------------------------------------------------------------- gelu_mul

def gelu_mul(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x) * x


def _gelu_mul_inputs(size, device, dtype):
    m, n = size
    return (_randn((m, n), device, dtype, 2.0),)


# ----------------------------------------------------------------------------- rope

def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotary embeddings as Llama writes them: rotate_half by slicing and cat."""
    return rotate(q, cos, sin), rotate(k, cos, sin)


def _rope_inputs(size, device, dtype):
    b, h, s, d = size
    cos, sin = rope_tables(s, d, device, dtype)
    return _randn((b, h, s, d), device, dtype), _randn((b, h, s, d), device, dtype), cos, sin


def _rope_bytes(inputs):
    q, k, cos, sin = inputs
    return float(2 * _nbytes(q, k) + _nbytes(cos, sin))


# ----------------------------------------------------------------------------- registry

def _elementwise(flops_per_element: int):
    return lambda inputs: float(flops_per_element * inputs[0].numel())


def _in_out_bytes(inputs):
    """All inputs read once, one output the shape of the first input written once."""
    return float(_nbytes(*inputs) + _nbytes(inputs[0]))


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("rmsnorm", _rows_inputs, rmsnorm, _elementwise(4), _in_out_bytes,
             {"quick": (256, 512), "full": (16384, 8192)}, "memory",
             "x * rsqrt(mean(x^2) + eps) * w over the last axis", size_names="M,N"),
    Workload("layernorm", _layernorm_inputs, layernorm, _elementwise(8), _in_out_bytes,
             {"quick": (256, 512), "full": (16384, 8192)}, "memory",
             "F.layer_norm with weight and bias over the last axis", size_names="M,N"),
    Workload("softmax", _softmax_inputs, softmax, _elementwise(5), _in_out_bytes,
             {"quick": (256, 512), "full": (16384, 8192)}, "memory",
             "torch.softmax(x, -1)", size_names="M,N"),
    Workload("gelu_mul", _gelu_mul_inputs, gelu_mul, _elementwise(20), _in_out_bytes,
             {"quick": (256, 512), "full": (16384, 8192)}, "memory", "F.gelu(x) * x",
             size_names="M,N"),
    Workload("rope", _rope_inputs, rope, lambda inputs: 6.0 * 2 * inputs[0].numel(), _rope_bytes,
             {"quick": (1, 4, 64, 32), "full": (8, 32, 4096, 128)}, "memory",
             "rotary embeddings of q and k (rotate_half by cat)", dynamic_axis=2,
             size_names="B,H,S,D"),
    Workload("gemm", _gemm_inputs, gemm, _gelu_linear_flops, _gemm_bytes,
             {"quick": (128, 256, 256), "full": (8192, 8192, 8192)}, "compute", "x @ w",
             size_names="M,K,N"),
    Workload("gelu_linear", _gelu_linear_inputs, gelu_linear, _gelu_linear_flops,
             _gelu_linear_bytes, {"quick": (128, 256, 256), "full": (8192, 4096, 4096)},
             "compute", "F.gelu(x @ w + b)", size_names="M,K,N"),
    Workload("linear_silu_res", _linear_res_inputs, linear_silu_residual, _linear_res_flops,
             _linear_res_bytes, {"quick": (128, 256, 256), "full": (8192, 4096, 4096)},
             "compute", "F.silu(F.linear(x, w, b)) + r", size_names="M,K,N"),
    Workload("mlp", _mlp_inputs, mlp, _mlp_flops, _mlp_bytes,
             {"quick": (64, 128, 256), "full": (4096, 4096, 16384)}, "compute",
             "Linear -> GELU -> Linear", size_names="M,D,H"),
    *LLM_WORKLOADS,
    *MODEL_WORKLOADS,
)}


def get_workloads(names: list[str] | None = None) -> list[Workload]:
    """The named workloads in the order given (all of them for None); KeyError if unknown."""
    if not names:
        return list(WORKLOADS.values())
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise KeyError(f"unknown workload(s) {', '.join(unknown)}; "
                       f"choose from {', '.join(WORKLOADS)}")
    return [WORKLOADS[n] for n in names]
