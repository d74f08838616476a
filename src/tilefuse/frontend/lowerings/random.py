"""Random ops as counter-based random numbers (`ir.philox`): dropout, rand, randn, bernoulli.

Each random op of a graph gets its own seed, and its element at linear index n is a pure
function of (seed, n): `rand(seed, n)` in the IR. A random tensor is then an ordinary
pointwise body — it fuses into its readers (dropout into the residual add it feeds), any tiling
computes the same values, and a recomputation gives the same numbers.

The seeds come from one extern call per graph, `draw_seeds(count, device)`, which draws them
from PyTorch's generator on the graph's device when the graph runs (`torch.manual_seed` makes
runs repeatable; CUDA graphs replay it with fresh numbers, as eager's ops would draw). The
values differ from eager's — PyTorch's own generator streams are not reproduced, as Inductor
does not reproduce them either — but the distribution, the scaling and the dtype are eager's.
"""
from __future__ import annotations

import math

import sympy
import torch

from ...ir import dtypes as dt
from ...ir import philox
from ...ir.expr import Binary, Index, binary, cast, const, unary
from ...ir.graph import Extern, ExternResult
from ...ir.symbolic import contiguous_strides
from .. import random_ops  # noqa: F401 - defines torch.ops.tilefuse.seed and .philox_uniform
from ..registry import Unsupported, lowering
from ..values import BufferValue, TensorValue
from .common import broadcast_load, out_shape, pointwise, py

aten = torch.ops.aten


def draw_seeds(count: int, device) -> tuple:
    """`count` seeds for a graph's random ops, as 0-dim int64 tensors on `device`."""
    seeds = torch.randint(0, philox.SEED_BOUND, (count,), dtype=torch.int64, device=device)
    return tuple(seeds.unbind())


# a stored graph may name it (`runtime.artifact.artifact_function`'s mark, set here without
# importing the runtime layer)
draw_seeds.__tilefuse_artifact__ = True


def fresh_seed(ctx, device) -> BufferValue:
    """A seed no other random op of this graph reads: one more result of the graph's
    `draw_seeds` call (made by the first random op; `hoist_seeds` moves it to the front once
    the graph is lowered). The call names the device's type only: seeds are drawn on the
    current device of that type when the graph runs, as its kernels are launched there (a
    graph cached for "cuda" runs on every GPU)."""
    graph = ctx.graph
    name = getattr(ctx, "seed_extern", None)
    node = graph.nodes.get(name) if name else None
    if node is None:
        name = graph.fresh_name("seeds")
        node = graph.add(Extern(name, dt.int64, (), target=draw_seeds, target_name="tilefuse.draw_seeds",
                                args=(0, torch.device(torch.device(device).type)),
                                reason="draws the random ops' seeds", multi_output=True))
        ctx.seed_extern = name
    k = node.args[0]
    node.args = (k + 1, node.args[1])
    result = graph.add(ExternResult(f"{name}_{k}", dt.int64, (), extern=name, item=k, strides=()))
    return BufferValue(result.name, dt.int64, ())


def hoist_seeds(ctx) -> None:
    """Put the seeds' call and its results first in the lowered graph: they read nothing, and
    a kernel the planner forms around ops lowered before them (a flash kernel around a dropout
    on its weights) may then read a seed."""
    name = getattr(ctx, "seed_extern", None)
    graph = ctx.graph
    if name not in graph.nodes:
        return
    first = [name] + [n for n, node in graph.nodes.items() if isinstance(node, ExternResult) and node.extern == name]
    rest = [(n, node) for n, node in graph.nodes.items() if n not in first]
    moved = [(n, graph.nodes[n]) for n in first]
    graph.nodes.clear()
    graph.nodes.update(moved)
    graph.nodes.update(rest)


def _device(ctx):
    meta = ctx.current_meta
    meta = meta[0] if isinstance(meta, (tuple, list)) else meta
    return meta.device


def uniform(seed: TensorValue, idx: tuple, shape: tuple):
    """rand(seed, linear index of idx in a contiguous tensor of `shape`): float32 in [0, 1)."""
    linear = sum((i.expr * st for i, st in zip(idx, contiguous_strides(shape))), sympy.Integer(0))
    return Binary("rand", seed.load(()), Index(linear), dt.float32)


#: significand bits of the dtypes a uniform is drawn in (float32's 24 are the draw's own)
_SIGNIFICAND = {dt.float32: 24, dt.float64: 24, dt.bfloat16: 8, dt.float16: 11}


def _below_one(u, dtype: dt.DType):
    """A float32 uniform on [0, 1) as `dtype` without rounding up to 1: truncated to the dtype's
    significand (24 bits of float32 are already exact in float32 and float64)."""
    bits = _SIGNIFICAND[dtype]
    if bits == 24:
        return cast(u, dtype)
    scale = float(2 ** bits)
    return cast(unary("floor", u * const(scale, dt.float32)) * const(1.0 / scale, dt.float32), dtype)


def _no_generator(kwargs, args=()):
    if kwargs.get("generator") is not None or any(isinstance(a, torch.Generator) for a in args):
        raise Unsupported("an explicit torch.Generator (its stream is not reproduced)")


@lowering(aten.rand_like.default, aten.rand.default, aten.rand.generator)
def rand(ctx, *args, **kwargs):
    _no_generator(kwargs, args)
    shape, out = out_shape(ctx), ctx.out_dtype
    if out not in _SIGNIFICAND:
        raise Unsupported(f"random values of dtype {out}")
    seed = fresh_seed(ctx, _device(ctx))  # (after every refusal: a refused op draws no seed)
    return pointwise(ctx, shape, out, lambda idx: _below_one(uniform(seed, idx, shape), out))


@lowering(aten.randn_like.default, aten.randn.default, aten.randn.generator)
def randn(ctx, *args, **kwargs):
    """Box–Muller over two uniforms per element (the element's index under two seeds):
    sqrt(−2 log(1 − u₁)) · cos(2π u₂), in float32."""
    _no_generator(kwargs, args)
    shape, out = out_shape(ctx), ctx.out_dtype
    if not out.is_float:
        raise Unsupported(f"randn of dtype {out}")
    seeds = fresh_seed(ctx, _device(ctx)), fresh_seed(ctx, _device(ctx))

    def body(idx):
        u1, u2 = (uniform(seed, idx, shape) for seed in seeds)
        radius = unary("sqrt", const(-2.0, dt.float32) * unary("log", const(1.0, dt.float32) - u1))
        return radius * unary("cos", u2 * const(2 * math.pi, dt.float32))

    return pointwise(ctx, shape, out, body)


@lowering(aten.bernoulli.p, aten.bernoulli.default)
def bernoulli(ctx, x, p=None, generator=None, **kwargs):
    """1 where a uniform falls below p (a number, or `x` itself for `bernoulli(x)`), else 0."""
    _no_generator({"generator": generator})
    shape, out = out_shape(ctx), ctx.out_dtype
    if p is not None and not isinstance(py(p), (int, float)):
        raise Unsupported("bernoulli with a symbolic probability")
    seed = fresh_seed(ctx, _device(ctx))

    def body(idx):
        prob = const(float(py(p)), dt.float32) if p is not None else cast(broadcast_load(x, idx, shape), dt.float32)
        return cast(binary("lt", uniform(seed, idx, shape), prob), out)

    return pointwise(ctx, shape, out, body)


@lowering(aten.native_dropout.default)
def native_dropout(ctx, x, p, train=None):
    """(x · keep / (1 − p), keep) with keep = (u ≥ p): each element kept with probability
    1 − p, as eager's Bernoulli mask; computed in float32 for low-precision x, as eager's CUDA
    kernel does. Outside training (or with p = 0) the input and a mask of ones."""
    p = py(p)
    if not isinstance(p, (int, float)):
        raise Unsupported("dropout with a symbolic probability")
    if not 0 <= p <= 1:
        raise Unsupported(f"dropout probability {p} outside [0, 1]")
    shape = out_shape(ctx)
    out = ctx.out_dtype
    mask_dtype = dt.bool_
    if train is False or p == 0:
        same = pointwise(ctx, shape, out, lambda idx: broadcast_load(x, idx, shape))
        ones = pointwise(ctx, shape, mask_dtype, lambda idx: const(True, dt.bool_))
        return same, ones
    seed = fresh_seed(ctx, _device(ctx))
    compute = dt.float64 if out == dt.float64 else dt.float32
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)

    def keep(idx):
        return binary("ge", uniform(seed, idx, shape), const(float(p), dt.float32))

    mask = pointwise(ctx, shape, mask_dtype, keep)

    def dropped(idx):
        kept = cast(mask.load(idx), compute)
        return cast(broadcast_load(x, idx, shape, compute) * kept * const(scale, compute), out)

    return pointwise(ctx, shape, out, dropped), mask


@lowering(torch.ops.tilefuse.seed.default)
def seed(ctx, like, tag):
    return fresh_seed(ctx, _device(ctx))


@lowering(torch.ops.tilefuse.philox_uniform.default)
def philox_uniform(ctx, seed_value, size):
    shape = out_shape(ctx)
    return pointwise(ctx, shape, dt.float32, lambda idx: uniform(seed_value, idx, shape))
