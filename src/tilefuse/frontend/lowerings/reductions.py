"""Reductions: sum, mean, prod, amax/amin, argmax/argmin, max/min (with indices), any/all,
var/std (and their _mean variants), vector norms.

A Reduce node's shape is the output shape (size-1 dims kept for keepdim), its ranges the
reduced extents in dim order; the body loads the input with i-symbols for kept dims and
r-symbols for reduced dims. The body computes in the accumulation dtype (fp32 for fp16/bf16,
int64 for integer sums); the node's dtype is the output dtype. mean and var add Pointwise
nodes after their sums.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import sympy
import torch

from ...ir import dtypes as dt
from ...ir.dtypes import DType
from ...ir.expr import Index, binary, cast, const, unary
from ...ir.monoid import ALL, ANY, ARGMAX, ARGMIN, MAX, MIN, PROD, SUM, Monoid
from ..registry import Unsupported, lowering
from ..values import TensorValue, ix
from .common import acc_dtype, canonical_dims, meta_dtype, out_shape, pointwise, py, reduce, scalar, sym

aten = torch.ops.aten


@dataclass
class Plan:
    """How a reduction over `dims` of a tensor of `in_shape` indexes its input."""

    in_shape: tuple
    dims: list
    keepdim: bool

    @property
    def out_shape(self) -> tuple:
        if self.keepdim:
            return tuple(sympy.Integer(1) if d in self.dims else sym(n) for d, n in enumerate(self.in_shape))
        return tuple(sym(n) for d, n in enumerate(self.in_shape) if d not in self.dims)

    @property
    def ranges(self) -> tuple:
        return tuple(sym(self.in_shape[d]) for d in self.dims)

    @property
    def numel(self) -> sympy.Expr:
        return sympy.Mul(*self.ranges) if self.ranges else sympy.Integer(1)

    def input_index(self, idx, ridx) -> tuple:
        """Input index for output index `idx` and reduction index `ridx`."""
        out, j, k = [], 0, 0
        for d in range(len(self.in_shape)):
            if d in self.dims:
                out.append(ridx[k])
                k += 1
                if self.keepdim:
                    j += 1
            else:
                out.append(idx[j])
                j += 1
        return tuple(out)

    def output_index(self, in_idx) -> tuple:
        """Index of the (reduced) output that input element `in_idx` belongs to."""
        if self.keepdim:
            return tuple(ix(0) if d in self.dims else i for d, i in enumerate(in_idx))
        return tuple(i for d, i in enumerate(in_idx) if d not in self.dims)


def plan(x: TensorValue, dims, keepdim=False) -> Plan:
    return Plan(tuple(x.shape), canonical_dims(py(dims), x.rank), bool(keepdim))


def reduce_value(ctx, x: TensorValue, p: Plan, combiner: Monoid, body_dtype: DType, out_dtype: DType,
                 transform=None, first: DType | None = None):
    """Reduce `x` over the plan: each element is cast to `first` (a dtype argument), then to
    `body_dtype`, then optionally transformed by `transform(value, out_index)`."""

    def element(idx, ridx):
        v = x.load(p.input_index(idx, ridx))
        if first is not None:
            v = cast(v, first)
        v = cast(v, body_dtype)
        return transform(v, idx) if transform is not None else v

    if not p.dims:  # reducing a 0-d tensor: a pointwise copy
        def pbody(idx):
            if combiner.arg:
                return const(0)
            v = element(idx, ())
            return cast(v, dt.bool_) if combiner.logical else v

        return pointwise(ctx, p.out_shape, out_dtype, pbody)
    return reduce(ctx, p.out_shape, p.ranges, combiner, element, out_dtype)


def _first(x: TensorValue, out: DType, dtype_arg):
    """With a dtype argument, eager casts the input to it before reducing."""
    return out if dtype_arg is not None and out != x.dtype else None


# ---------------------------------------------------------------- sum / prod / mean


@lowering(aten.sum.dim_IntList, aten.sum.default)
def sum_(ctx, x, dim=None, keepdim=False, *, dtype=None):
    if ctx.current_target == aten.sum.default:
        dim, keepdim = None, False
    out = ctx.out_dtype
    return reduce_value(ctx, x, plan(x, dim, keepdim), SUM, acc_dtype(out), out, first=_first(x, out, dtype))


@lowering(aten.prod.default, aten.prod.dim_int)
def prod(ctx, x, dim=None, keepdim=False, *, dtype=None):
    if ctx.current_target == aten.prod.default:
        dim, keepdim = None, False
    out = ctx.out_dtype
    p = plan(x, None if dim is None else [dim], keepdim)
    return reduce_value(ctx, x, p, PROD, acc_dtype(out), out, first=_first(x, out, dtype))


def mean_value(ctx, x, p: Plan, acc: DType, out: DType | None = None, first: DType | None = None) -> TensorValue:
    """Mean over the plan in `acc` (a Reduce(sum) and a Pointwise divide), cast to `out`."""
    s = reduce_value(ctx, x, p, SUM, acc, acc, first=first)
    n = p.numel
    return pointwise(ctx, p.out_shape, out or acc, lambda idx: binary("truediv", s.load(idx), scalar(n, acc)))


@lowering(aten.mean.dim, aten.mean.default)
def mean(ctx, x, dim=None, keepdim=False, *, dtype=None):
    if ctx.current_target == aten.mean.default:
        dim, keepdim = None, False
    out = ctx.out_dtype
    if not out.is_float:
        raise Unsupported(f"mean of {out}")
    return mean_value(ctx, x, plan(x, dim, keepdim), dt.compute_dtype(out), out, first=_first(x, out, dtype))


# ---------------------------------------------------------------- max / min / arg


def _minmax_body_dtype(x):
    return dt.compute_dtype(x.dtype)


def _extremum(combiner):
    def lower(ctx, x, dim=(), keepdim=False):
        p = plan(x, dim, keepdim)
        return reduce_value(ctx, x, p, combiner, _minmax_body_dtype(x), ctx.out_dtype)

    return lower


lowering(aten.amax.default)(_extremum(MAX))
lowering(aten.amin.default)(_extremum(MIN))


@lowering(aten.max.default)
def max_all(ctx, x):
    return reduce_value(ctx, x, plan(x, None), MAX, _minmax_body_dtype(x), ctx.out_dtype)


@lowering(aten.min.default)
def min_all(ctx, x):
    return reduce_value(ctx, x, plan(x, None), MIN, _minmax_body_dtype(x), ctx.out_dtype)


def _arg(combiner):
    def lower(ctx, x, dim=None, keepdim=False):
        if dim is None:
            dims = None
            p = Plan(tuple(x.shape), list(range(x.rank)), False)
            r = reduce_value(ctx, x, p, combiner, _minmax_body_dtype(x), dt.int64)
            if keepdim and x.rank:
                from .views import reshape
                return reshape(r, out_shape(ctx))
            return r
        dims = [dim]
        return reduce_value(ctx, x, plan(x, dims, keepdim), combiner, _minmax_body_dtype(x), dt.int64)

    return lower


lowering(aten.argmax.default)(_arg(ARGMAX))
lowering(aten.argmin.default)(_arg(ARGMIN))


def _with_indices(value_combiner, index_combiner):
    def lower(ctx, x, dim, keepdim=False):
        p = plan(x, [dim], keepdim)
        values = reduce_value(ctx, x, p, value_combiner, _minmax_body_dtype(x), meta_dtype(ctx, 0))
        indices = reduce_value(ctx, x, p, index_combiner, _minmax_body_dtype(x), meta_dtype(ctx, 1))
        return values, indices

    return lower


lowering(aten.max.dim)(_with_indices(MAX, ARGMAX))
lowering(aten.min.dim)(_with_indices(MIN, ARGMIN))


# ---------------------------------------------------------------- any / all


def _logical(combiner):
    def lower(ctx, x, dim=None, keepdim=False):
        if ctx.current_target in (aten.any.default, aten.all.default):
            dim = None
        elif dim is not None and not isinstance(dim, (list, tuple)):
            dim = [dim]
        if dim is not None and len(dim) == 0:  # unlike sum, any/all over dims=[] reduce nothing
            p = Plan(tuple(x.shape), [], bool(keepdim))
        else:
            p = plan(x, dim, keepdim)
        return reduce_value(ctx, x, p, combiner, dt.bool_, ctx.out_dtype)

    return lower


lowering(aten.any.default, aten.any.dim, aten.any.dims)(_logical(ANY))
lowering(aten.all.default, aten.all.dim, aten.all.dims)(_logical(ALL))


# ---------------------------------------------------------------- variance


def var_value(ctx, x, p: Plan, correction, acc: DType):
    """(variance, mean) in `acc` by the corrected two-pass algorithm: the mean `m` (sum / N),
    then in one more pass the deviations' sum `e = sum(x - m)` and squares `q = sum((x - m)^2)`;
    the mean is `m + e / N` and the variance `(q - e^2 / N) / max(N - correction, 0)`. The
    correction repairs the rounding of `m`: a constant extent's deviations are then exactly 0,
    as with eager's Welford in fp32, where `m` alone is an ulp off (which layer_norm's
    rsqrt(eps) scaled to 1e-4), and a mean stays accurate when one value dwarfs the others."""
    m = mean_value(ctx, x, p, acc)

    def deviation(v, idx):
        return binary("sub", v, m.load(idx))

    def squared(v, idx):
        d = deviation(v, idx)
        return binary("mul", d, d)

    e = reduce_value(ctx, x, p, SUM, acc, acc, transform=deviation)
    sq = reduce_value(ctx, x, p, SUM, acc, acc, transform=squared)
    n = scalar(p.numel, acc)
    correction = py(correction)
    denom = sympy.Max(p.numel - sym(correction), 0)
    denom_e = cast(Index(denom, dt.int64 if denom.is_integer else dt.float64), acc)
    if denom.is_number:
        denom_e = const(float(denom), acc)
    mean = pointwise(ctx, p.out_shape, acc,
                     lambda idx: binary("add", m.load(idx), binary("truediv", e.load(idx), n)))
    var = pointwise(ctx, p.out_shape, acc, lambda idx: binary("truediv", binary(
        "sub", sq.load(idx), binary("truediv", binary("mul", e.load(idx), e.load(idx)), n)), denom_e))
    return var, mean


def _correction(target, args, kwargs):
    """(dims, correction, keepdim) of the var/std overloads."""
    if target.overloadpacket in (aten.var, aten.std, aten.var_mean, aten.std_mean):
        name = target._overloadname
        if name == "correction":
            dim = args[0] if args else kwargs.get("dim")
            correction = kwargs.get("correction")
            keepdim = kwargs.get("keepdim", False)
            return dim, 1 if correction is None else correction, keepdim
        if name == "dim":
            dim = args[0] if args else kwargs.get("dim")
            unbiased = args[1] if len(args) > 1 else kwargs.get("unbiased", True)
            keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
            return dim, 1 if unbiased else 0, keepdim
        if name == "default":
            unbiased = args[0] if args else kwargs.get("unbiased", True)
            return None, 1 if unbiased else 0, False
    raise Unsupported(f"unknown variance overload {target}")


def _variance(with_mean: bool, sqrt: bool):
    def lower(ctx, x, *args, **kwargs):
        dim, correction, keepdim = _correction(ctx.current_target, args, kwargs)
        out = meta_dtype(ctx, 0)
        if not out.is_float or not x.dtype.is_float:
            raise Unsupported(f"variance of {x.dtype}")
        if isinstance(py(correction), sympy.Basic):
            raise Unsupported("symbolic correction")
        p = plan(x, dim, keepdim)
        if not p.dims:
            raise Unsupported("variance of a 0-d tensor")
        acc = dt.compute_dtype(out)
        var, m = var_value(ctx, x, p, correction, acc)
        if sqrt:
            res = pointwise(ctx, p.out_shape, out, lambda idx: unary("sqrt", var.load(idx)))
        else:
            res = var if out == acc else pointwise(ctx, p.out_shape, out, lambda idx: cast(var.load(idx), out))
        if not with_mean:
            return res
        mo = meta_dtype(ctx, 1)
        mean_out = m if mo == acc else pointwise(ctx, p.out_shape, mo, lambda idx: cast(m.load(idx), mo))
        return res, mean_out

    return lower


lowering(aten.var.correction, aten.var.dim, aten.var.default)(_variance(False, False))
lowering(aten.std.correction, aten.std.dim, aten.std.default)(_variance(False, True))
lowering(aten.var_mean.correction, aten.var_mean.dim, aten.var_mean.default)(_variance(True, False))
lowering(aten.std_mean.correction, aten.std_mean.dim, aten.std_mean.default)(_variance(True, True))


# ---------------------------------------------------------------- norms


@lowering(aten.linalg_vector_norm.default)
def linalg_vector_norm(ctx, x, ord=2, dim=None, keepdim=False, *, dtype=None):
    out = ctx.out_dtype
    acc = dt.compute_dtype(out)
    ord = py(ord)
    if isinstance(ord, sympy.Basic) or not out.is_float:
        raise Unsupported("norm order / dtype")
    p = plan(x, dim, keepdim)
    first = _first(x, out, dtype)
    if not p.dims:
        raise Unsupported("norm of a 0-d tensor")
    if ord == math.inf or ord == -math.inf:
        return reduce_value(ctx, x, p, MAX if ord > 0 else MIN, acc, out, first=first,
                            transform=lambda v, idx: unary("abs", v))
    if ord == 0:
        return reduce_value(ctx, x, p, SUM, acc, out, first=first,
                            transform=lambda v, idx: cast(binary("ne", v, const(0.0, acc)), acc))
    if ord == 1:
        return reduce_value(ctx, x, p, SUM, acc, out, first=first, transform=lambda v, idx: unary("abs", v))
    if ord == 2:
        s = reduce_value(ctx, x, p, SUM, acc, acc, first=first, transform=lambda v, idx: binary("mul", v, v))
        return pointwise(ctx, p.out_shape, out, lambda idx: unary("sqrt", s.load(idx)))
    s = reduce_value(ctx, x, p, SUM, acc, acc, first=first,
                     transform=lambda v, idx: binary("pow", unary("abs", v), const(float(ord), acc)))
    return pointwise(ctx, p.out_shape, out,
                     lambda idx: binary("pow", s.load(idx), const(1.0 / float(ord), acc)))
