"""Max pooling as a window unrolled into masked loads: `max_pool2d_with_indices` and
`max_pool3d_with_indices` (and `max_pool2d`, where a graph keeps it).

Each output element reads its window's positions in ATen's order (the first spatial dim
outermost), a position outside the input (padding, a ceil-mode window past the end) masked
off. The value and the index follow ATen's CPU and CUDA kernels exactly: a position is taken
when its value is greater than the running maximum or is NaN (so the last NaN of a window
wins, and of equal maxima the first); the running maximum starts at -inf and the index at the
window's start stepped into the input by the dilation, which is what a window of -inf values
(or one wholly outside the input) returns: so the index is the first position holding the
maximum, or the last NaN. The index is the flat position within the input's spatial plane, as
ATen's is (its backward, `max_pool2d_with_indices_backward`, stays ATen's op and reads these
indices).

Both results are pointwise values of the output's shape: the index is computed only where
something reads it (inference graphs drop it), and the two fuse with what produces the input
(a ReLU, a batch norm) and what reads the output.
"""
from __future__ import annotations

import math

import sympy
import torch

from ...ir import dtypes as dt
from ...ir.expr import Binary, Expr, Index, Where, cast, const, unary
from ..registry import Unsupported, lowering
from ..values import ix
from .common import as_int, meta_dtype, meta_shape, pointwise

aten = torch.ops.aten

#: windows of more positions stay ATen's op (each position is a load of the unrolled body)
MAX_WINDOW = 64


def _per_dim(value, n: int, what: str, default=None) -> list:
    value = list(value) if isinstance(value, (list, tuple)) else [value]
    if not value and default is not None:
        return list(default)
    if len(value) == 1:
        value = value * n
    if len(value) != n:
        raise Unsupported(f"max pool: {what} of {len(value)} values for {n} spatial dims")
    return [as_int(v, f"max pool {what}") for v in value]


def _lower(n: int, with_indices: bool):
    def lower(ctx, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
        kernel = _per_dim(kernel_size, n, "kernel size")
        stride = _per_dim(stride, n, "stride", default=kernel)
        padding = _per_dim(padding, n, "padding")
        dilation = _per_dim(dilation, n, "dilation")
        if math.prod(kernel) > MAX_WINDOW:
            raise Unsupported(f"max pool window of {math.prod(kernel)} positions (more than {MAX_WINDOW})")
        if x.rank not in (n + 1, n + 2):
            raise Unsupported(f"max pool over {n} dims of a rank-{x.rank} input")
        shape = meta_shape(ctx, 0)
        out_dtype = meta_dtype(ctx, 0)
        sizes = [sympy.sympify(d) for d in x.shape[-n:]]
        lead = x.rank - n
        compute = dt.compute_dtype(x.dtype) if x.dtype.is_float else x.dtype
        lowest = const(float("-inf") if x.dtype.is_float else _int_min(x.dtype), compute)

        def coordinates(idx) -> list:
            """Per spatial dim, the window's input coordinates in order."""
            out_pos = [idx[lead + d].expr if isinstance(idx[lead + d], Index) else None for d in range(n)]
            if any(p is None for p in out_pos):
                raise Unsupported("max pool over a computed output index")
            return [[out_pos[d] * stride[d] - padding[d] + k * dilation[d] for k in range(kernel[d])]
                    for d in range(n)]

        def start_index(idx) -> Expr:
            """ATen's index before any position is taken: per dim, the window's first coordinate
            that is not negative (its start stepped by the dilation), flattened."""
            flat = None
            for d, coords in enumerate(coordinates(idx)):
                first = Index(coords[-1])
                for c in reversed(coords[:-1]):
                    first = Where(Binary("ge", Index(c), const(0), dt.bool_), Index(c), first, dt.int64)
                flat = first if flat is None else Binary("add", Binary("mul", flat, ix(sizes[d]), dt.int64),
                                                          first, dt.int64)
            return flat

        def window(idx):
            """Per position in ATen's order: (inside the input, flat index in the plane, value)."""
            positions = [[]]
            for coords_d in coordinates(idx):
                positions = [p + [c] for p in positions for c in coords_d]
            for coords in positions:
                inside = None
                for d, c in enumerate(coords):
                    for cond in (Binary("ge", Index(c), const(0), dt.bool_),
                                 Binary("lt", Index(c), ix(sizes[d]), dt.bool_)):
                        inside = cond if inside is None else Binary("logical_and", inside, cond, dt.bool_)
                flat = sympy.Integer(0)
                for d, c in enumerate(coords):
                    flat = flat * sizes[d] + c
                load = cast(x.load(tuple(idx[:lead]) + tuple(Index(c) for c in coords)), compute)
                yield inside, Index(flat), Where(inside, load, lowest, compute)

        def maximum(positions) -> Expr:
            m = positions[0][2]
            for _, _, v in positions[1:]:
                m = Binary("maximum", m, v, compute)
            return m

        def argmax(positions, m: Expr, start: Expr) -> Expr:
            """The flat index of `m` in the window, as ATen's kernels take it (a position
            replaces the running one when greater or NaN): the first position holding the
            maximum, or the last NaN where the maximum is NaN, or `start` where no position
            is taken. A window's flat indices grow in ATen's order, so the first is the least
            flat index of the positions holding `m` and the last NaN the greatest of those
            holding NaN: a minimum (maximum) over the positions, each a selection between
            indices. (A chain of selections, each step choosing between a position and the
            rest of the chain, was guarded step by step and re-read the window at each step:
            1512 loads for a 3-D window of 27.)"""
            past = ix(sympy.Mul(*sizes))  # (no flat index of the plane reaches it)
            first = None
            for inside, flat, v in positions:
                hit = Binary("logical_and", inside, Binary("eq", v, m, dt.bool_), dt.bool_)
                taken = Where(hit, flat, past, dt.int64)
                first = taken if first is None else Binary("minimum", first, taken, dt.int64)
            first = _chosen(Binary("ge", first, past, dt.bool_), start, first)
            if not compute.is_float:
                return first
            last_nan = None
            for inside, flat, v in positions:
                hit = Binary("logical_and", inside, unary("isnan", v), dt.bool_)
                taken = Where(hit, flat, const(-1, dt.int64), dt.int64)
                last_nan = taken if last_nan is None else Binary("maximum", last_nan, taken, dt.int64)
            return _chosen(unary("isnan", m), last_nan, first)

        values = pointwise(ctx, shape, out_dtype, lambda idx: cast(maximum(list(window(idx))), out_dtype))
        if not with_indices:
            return values

        def index(idx):
            positions = list(window(idx))
            return argmax(positions, maximum(positions), start_index(idx))

        indices = pointwise(ctx, meta_shape(ctx, 1), meta_dtype(ctx, 1), index)
        return values, indices

    return lower


def _chosen(cond: Expr, a: Expr, b: Expr) -> Expr:
    """`a` where `cond`, else `b`, for int64 values that both read the window: written as
    `b + (a - b)·cond` rather than a selection, whose branches' loads the kernel builder would
    guard by the condition (a selection on positions), reading the window once more per
    selection."""
    return Binary("add", b, Binary("mul", Binary("sub", a, b, dt.int64), cast(cond, dt.int64), dt.int64), dt.int64)


def _int_min(dtype) -> int:
    return int(torch.iinfo(getattr(torch, dtype.name)).min)


lowering(aten.max_pool2d_with_indices.default)(_lower(2, True))
lowering(aten.max_pool3d_with_indices.default)(_lower(3, True))
lowering(aten.max_pool2d.default)(_lower(2, False))
