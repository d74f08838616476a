"""Tensor creation: full / zeros / ones / empty (and their _like / new_ forms), scalar_tensor,
arange and iota. Each is a Pointwise node whose body is a constant or an index formula.

`empty` has no defined contents; it is filled with zeros so results are deterministic.
"""
from __future__ import annotations

import sympy
import torch

from ...ir import dtypes as dt
from ...ir.expr import Index, binary, cast
from ..registry import lowering
from .common import check_scalar_fits, out_shape, overloads, pointwise, py, scalar, sym

aten = torch.ops.aten
prims = torch.ops.prims


def fill(ctx, value):
    """A tensor of `value`, refused where eager refuses the value for the type
    (`torch.full((2,), 300, dtype=torch.uint8)`)."""
    out = ctx.out_dtype
    check_scalar_fits(value, out)
    return pointwise(ctx, out_shape(ctx), out, lambda idx: scalar(value, out))


@lowering(*overloads("full.default", "full_like.default"))
def full(ctx, size_or_like, fill_value, **kwargs):
    return fill(ctx, fill_value)


@lowering(*overloads("new_full.default"))
def new_full(ctx, x, size, fill_value, **kwargs):
    return fill(ctx, fill_value)


@lowering(*overloads("zeros.default", "zeros_like.default", "new_zeros.default", "empty.memory_format",
                "empty_like.default", "new_empty.default", "empty_strided.default", "new_empty_strided.default",
                "empty_permuted.default"))
def zeros(ctx, *args, **kwargs):
    return fill(ctx, 0)


@lowering(*overloads("ones.default", "ones_like.default", "new_ones.default"))
def ones(ctx, *args, **kwargs):
    return fill(ctx, 1)


@lowering(aten.scalar_tensor.default)
def scalar_tensor(ctx, value, **kwargs):
    return fill(ctx, value)


def _range(ctx, start, step):
    """out[i] = start + i*step, computed exactly for integers and in fp64 for floats (as
    eager's arange accumulates in double), then cast."""
    out = ctx.out_dtype
    start, step = py(start), py(step)
    exact = all(isinstance(v, int) or (isinstance(v, sympy.Basic) and v.is_integer) for v in (start, step))

    def body(idx):
        i = idx[0]
        if exact:
            return Index(sym(start) + sym(step) * i.expr)
        return binary("add", scalar(start, dt.float64), binary("mul", cast(i, dt.float64), scalar(step, dt.float64)))

    return pointwise(ctx, out_shape(ctx), out, body)


@lowering(aten.arange.start_step)
def arange_start_step(ctx, start, end=None, step=1, **kwargs):
    return _range(ctx, start, step)


@lowering(aten.arange.start)
def arange_start(ctx, start, end, **kwargs):
    return _range(ctx, start, 1)


@lowering(aten.arange.default)
def arange(ctx, end, **kwargs):
    return _range(ctx, 0, 1)


@lowering(*overloads("iota.default", ns=prims))
def iota(ctx, length, *, start, step, **kwargs):
    return _range(ctx, start, step)


# ---------------------------------------------------------------- runtime assertions


@lowering(*overloads("_assert_async.msg", "_assert_async.default", "_assert_scalar.default",
                "sym_constrain_range_for_size.default", "sym_constrain_range.default"))
def runtime_assert(ctx, *args, **kwargs):
    """Data-dependent checks (e.g. one_hot's index bound) produce no value; tilefuse does
    not generate device-side asserts, so they are dropped."""
    return None
