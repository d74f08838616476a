"""Elementwise math, comparisons, logical and bitwise ops, where, clamp, casts, pow.

Each op broadcasts its operands to PyTorch's result shape and computes in the op's compute
dtype (fp32 for fp16/bf16, as eager PyTorch does), then casts to the result dtype that
PyTorch's metadata reports. Comparisons are carried out in the promoted dtype of their
operands (a python scalar is rounded to it first, as eager does).
"""
from __future__ import annotations

import math

import torch

from ...errors import ProgramError
from ...ir import dtypes as dt
from ...ir.expr import Binary, Expr, Where, binary, cast, const, unary, where
from ..registry import Unsupported, lowering
from .common import (broadcast_load, check_scalar_fits, copy_of, elementwise, finfo, is_scalar_value, is_tensor,
                     out_shape, pointwise, promoted_dtype, py, scalar)

aten = torch.ops.aten
prims = torch.ops.prims


# ---------------------------------------------------------------- expression helpers


def bin_(op: str, a: Expr, b, dtype=None) -> Expr:
    """Binary op in the dtype of `a` (scalars become constants of that dtype)."""
    if not isinstance(b, Expr):
        b = scalar(b, a.dtype)
    return binary(op, a, b, dtype)


def lit(value, like: Expr) -> Expr:
    """A python number as a constant of `like`'s dtype."""
    return scalar(value, like.dtype)


def maximum(a: Expr, b) -> Expr:
    return bin_("maximum", a, b)


def minimum(a: Expr, b) -> Expr:
    return bin_("minimum", a, b)


# ---------------------------------------------------------------- unary math

_FLOAT_UNARY = {
    aten.exp: "exp", aten.exp2: "exp2", aten.expm1: "expm1", aten.log: "log", aten.log2: "log2",
    aten.log10: "log10", aten.log1p: "log1p", aten.sqrt: "sqrt", aten.rsqrt: "rsqrt", aten.sin: "sin",
    aten.cos: "cos", aten.tan: "tan", aten.asin: "asin", aten.acos: "acos", aten.atan: "atan",
    aten.sinh: "sinh", aten.cosh: "cosh", aten.tanh: "tanh", aten.asinh: "asinh", aten.acosh: "acosh",
    aten.atanh: "atanh", aten.sigmoid: "sigmoid", aten.erf: "erf", aten.erfc: "erfc",
    aten.reciprocal: "reciprocal", aten.lgamma: "lgamma",
}
_SAME_UNARY = {aten.neg: "neg", aten.abs: "abs", aten.sign: "sign"}
_ROUNDING = {aten.floor: "floor", aten.ceil: "ceil", aten.trunc: "trunc", aten.round: "round"}


def _unary_lowering(op: str):
    def lower(ctx, x):
        if not is_tensor(x):
            raise Unsupported("scalar operand")
        return elementwise(ctx, (x,), lambda v: unary(op, v))

    return lower


for _target, _op in {**_FLOAT_UNARY, **_SAME_UNARY}.items():
    lowering(_target.default)(_unary_lowering(_op))


def _rounding_lowering(op: str):
    def lower(ctx, x):
        if not ctx.out_dtype.is_float:
            return copy_of(ctx, x)  # rounding an integer is the identity
        return elementwise(ctx, (x,), lambda v: unary(op, v))

    return lower


for _target, _op in _ROUNDING.items():
    lowering(_target.default)(_rounding_lowering(_op))


@lowering(aten.round.decimals)
def round_decimals(ctx, x, decimals=0):
    decimals = py(decimals)
    if not ctx.out_dtype.is_float or decimals == 0:
        return _rounding_lowering("round")(ctx, x)
    ten = 10.0 ** abs(decimals)
    if decimals > 0:
        return elementwise(ctx, (x,), lambda v: unary("round", v * lit(ten, v)) / lit(ten, v))
    return elementwise(ctx, (x,), lambda v: unary("round", v / lit(ten, v)) * lit(ten, v))


@lowering(aten.bitwise_not.default)
def bitwise_not(ctx, x):
    out = ctx.out_dtype
    if out.is_bool:
        return elementwise(ctx, (x,), lambda v: unary("logical_not", v), compute=dt.bool_)
    return elementwise(ctx, (x,), lambda v: unary("bitwise_not", v))


@lowering(aten.logical_not.default)
def logical_not(ctx, x):
    return elementwise(ctx, (x,), lambda v: unary("logical_not", v), compute=dt.bool_)


def _predicate(op):
    def lower(ctx, x):
        if not x.dtype.is_float:
            return pointwise(ctx, out_shape(ctx), dt.bool_, lambda idx: const(False))
        return pointwise(ctx, out_shape(ctx), dt.bool_, lambda idx: unary(op, x.load(idx)))

    return lower


lowering(aten.isnan.default)(_predicate("isnan"))
lowering(aten.isinf.default)(_predicate("isinf"))


@lowering(aten.isfinite.default)
def isfinite(ctx, x):
    if not x.dtype.is_float:
        return pointwise(ctx, out_shape(ctx), dt.bool_, lambda idx: const(True))

    def body(idx):
        v = x.load(idx)
        return unary("logical_not", binary("logical_or", unary("isnan", v), unary("isinf", v)))

    return pointwise(ctx, out_shape(ctx), dt.bool_, body)


@lowering(aten.signbit.default)
def signbit(ctx, x):
    if not x.dtype.is_float:
        return elementwise(ctx, (x,), lambda v: binary("lt", v, lit(0, v)), compute=x.dtype, out_dtype=dt.bool_)
    cd = dt.compute_dtype(x.dtype)
    return elementwise(ctx, (x,), lambda v: binary("lt", binary("copysign", lit(1.0, v), v), lit(0.0, v)),
                       compute=cd, out_dtype=dt.bool_)


@lowering(aten.relu.default)
def relu(ctx, x):
    return elementwise(ctx, (x,), lambda v: maximum(v, 0))


# ---------------------------------------------------------------- arithmetic


def _add_sub(op):
    def lower(ctx, a, b, alpha=1):
        check_scalar_fits(alpha, ctx.out_dtype)
        if is_scalar_value(alpha, 1):
            return elementwise(ctx, (a, b), lambda x, y: binary(op, x, y))
        return elementwise(ctx, (a, b), lambda x, y: binary(op, x, binary("mul", y, lit(py(alpha), y))))

    return lower


for _ov in (aten.add.Tensor, aten.add.Scalar):
    lowering(_ov)(_add_sub("add"))
for _ov in (aten.sub.Tensor, aten.sub.Scalar):
    lowering(_ov)(_add_sub("sub"))


@lowering(aten.rsub.Tensor, aten.rsub.Scalar)
def rsub(ctx, a, b, alpha=1):
    return _add_sub("sub")(ctx, b, a, alpha)


@lowering(aten.mul.Tensor, aten.mul.Scalar)
def mul(ctx, a, b):
    return elementwise(ctx, (a, b), lambda x, y: binary("mul", x, y))


def trunc_div(x: Expr, y: Expr) -> Expr:
    """Quotient rounded toward zero (PyTorch's `div(rounding_mode='trunc')`)."""
    if x.dtype.is_float:
        return unary("trunc", binary("truediv", x, y))
    # exact for integers: x - fmod(x, y) is a multiple of y
    return binary("floordiv", binary("sub", x, binary("fmod", x, y)), y)


@lowering(aten.div.Tensor, aten.div.Scalar, aten.true_divide.Tensor, aten.true_divide.Scalar)
def div(ctx, a, b):
    return elementwise(ctx, (a, b), lambda x, y: binary("truediv", x, y))


@lowering(aten.div.Tensor_mode, aten.div.Scalar_mode)
def div_mode(ctx, a, b, rounding_mode=None):
    if rounding_mode is None:
        return div(ctx, a, b)
    if rounding_mode == "trunc":
        return elementwise(ctx, (a, b), trunc_div)
    if rounding_mode == "floor":
        return elementwise(ctx, (a, b), lambda x, y: binary("floordiv", x, y))
    raise Unsupported(f"rounding_mode={rounding_mode!r}")


@lowering(aten.floor_divide.default, aten.floor_divide.Scalar)
def floor_divide(ctx, a, b):
    return elementwise(ctx, (a, b), lambda x, y: binary("floordiv", x, y))


@lowering(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor)
def remainder(ctx, a, b):
    return elementwise(ctx, (a, b), lambda x, y: binary("mod", x, y))


@lowering(aten.fmod.Tensor, aten.fmod.Scalar)
def fmod(ctx, a, b):
    return elementwise(ctx, (a, b), lambda x, y: binary("fmod", x, y))


def pow_expr(x: Expr, e) -> Expr:
    """x ** e, with the exponents eager PyTorch special-cases computed the same way."""
    e = py(e)
    if isinstance(e, (int, float)) and not isinstance(e, bool) and x.dtype.is_float:
        if e == 1:
            return x
        if e == 2:
            return x * x
        if e == 3:
            return x * x * x
        if e == 0.5:
            return unary("sqrt", x)
        if e == -0.5:
            return unary("rsqrt", x)
        if e == -1:
            return unary("reciprocal", x)
        if e == -2:
            return unary("reciprocal", x * x)
    if isinstance(e, (int, float)) and not isinstance(e, bool) and e == 0:
        return lit(1, x)
    return binary("pow", x, e if isinstance(e, Expr) else scalar(e, x.dtype))


@lowering(aten.pow.Tensor_Scalar)
def pow_tensor_scalar(ctx, x, exponent):
    exponent = py(exponent)
    if ctx.out_dtype.is_int and isinstance(exponent, int) and not isinstance(exponent, bool):
        if exponent < 0:  # (eager's own refusal, for every integer type)
            raise ProgramError("Integers to negative integer powers are not allowed.")
        check_scalar_fits(exponent, ctx.out_dtype)  # (uint8 ** 300 is refused as well)
    if is_scalar_value(exponent, 1) and ctx.out_dtype == x.dtype:
        return copy_of(ctx, x)
    if isinstance(exponent, (int, float)):
        return elementwise(ctx, (x,), lambda v: pow_expr(v, exponent))
    return elementwise(ctx, (x, exponent), lambda v, e: binary("pow", v, e))


@lowering(aten.pow.Tensor_Tensor, aten.pow.Scalar)
def pow_(ctx, base, exponent):
    return elementwise(ctx, (base, exponent), lambda x, y: binary("pow", x, y))


def _binary_lowering(op):
    def lower(ctx, a, b):
        return elementwise(ctx, (a, b), lambda x, y: binary(op, x, y))

    return lower


for _op in ("maximum", "minimum", "atan2"):
    lowering(getattr(aten, _op).default)(_binary_lowering(_op))
lowering(aten.copysign.Tensor, aten.copysign.Scalar)(_binary_lowering("copysign"))


def _fmax_fmin(op):
    def lower(ctx, a, b):
        def body(x, y):
            m = binary(op, x, y)
            if not x.dtype.is_float:
                return m
            return where(unary("isnan", x), y, where(unary("isnan", y), x, m))

        return elementwise(ctx, (a, b), body)

    return lower


lowering(aten.fmax.default)(_fmax_fmin("maximum"))
lowering(aten.fmin.default)(_fmax_fmin("minimum"))


@lowering(aten.hypot.default)
def hypot(ctx, a, b):
    return elementwise(ctx, (a, b), lambda x, y: unary("sqrt", x * x + y * y))


@lowering(aten.addcmul.default)
def addcmul(ctx, x, t1, t2, value=1):
    return elementwise(ctx, (x, t1, t2), lambda a, b, d: a + lit(py(value), a) * b * d)


@lowering(aten.addcdiv.default)
def addcdiv(ctx, x, t1, t2, value=1):
    return elementwise(ctx, (x, t1, t2), lambda a, b, d: a + lit(py(value), a) * (b / d))


@lowering(aten.lerp.Scalar, aten.lerp.Tensor)
def lerp(ctx, start, end, weight):
    def body(s, e, w):
        diff = e - s
        return where(binary("lt", unary("abs", w), lit(0.5, w)), s + w * diff, e - diff * (lit(1.0, w) - w))

    return elementwise(ctx, (start, end, weight), body)


# ---------------------------------------------------------------- comparisons and logic


def _compare(op):
    def lower(ctx, a, b):
        p = promoted_dtype(a, b)
        return elementwise(ctx, (a, b), lambda x, y: Binary(op, x, y, dt.bool_),
                           compute=dt.compute_dtype(p), out_dtype=dt.bool_, round_to=p)

    return lower


for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    _pkt = getattr(aten, _name)
    lowering(_pkt.Tensor, _pkt.Scalar)(_compare(_name))


def _logical(op):
    def lower(ctx, a, b):
        return elementwise(ctx, (a, b), lambda x, y: Binary(op, x, y, dt.bool_), compute=dt.bool_)

    return lower


for _name in ("logical_and", "logical_or", "logical_xor"):
    lowering(getattr(aten, _name).default)(_logical(_name))


def _bitwise(op):
    def lower(ctx, a, b):
        out = ctx.out_dtype
        if out.is_float:
            raise Unsupported(f"{op} on {out}")
        if out.is_bool and op in ("bitwise_and", "bitwise_or", "bitwise_xor"):
            logical = {"bitwise_and": "logical_and", "bitwise_or": "logical_or", "bitwise_xor": "logical_xor"}[op]
            return elementwise(ctx, (a, b), lambda x, y: Binary(logical, x, y, dt.bool_), compute=dt.bool_)
        return elementwise(ctx, (a, b), lambda x, y: Binary(op, x, y, out), compute=out)

    return lower


for _name in ("bitwise_and", "bitwise_or", "bitwise_xor"):
    _pkt = getattr(aten, _name)
    lowering(_pkt.Tensor, _pkt.Scalar, _pkt.Scalar_Tensor)(_bitwise(_name))
lowering(aten.bitwise_left_shift.Tensor, aten.bitwise_left_shift.Tensor_Scalar,
         aten.bitwise_left_shift.Scalar_Tensor, aten.__lshift__.Scalar, aten.__lshift__.Tensor)(_bitwise("lshift"))
lowering(aten.bitwise_right_shift.Tensor, aten.bitwise_right_shift.Tensor_Scalar,
         aten.bitwise_right_shift.Scalar_Tensor, aten.__rshift__.Scalar, aten.__rshift__.Tensor)(_bitwise("rshift"))


# ---------------------------------------------------------------- selection


@lowering(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def where_(ctx, cond, a, b):
    out = ctx.out_dtype
    shape = out_shape(ctx)
    return pointwise(ctx, shape, out, lambda idx: Where(
        broadcast_load(cond, idx, shape, dt.bool_), broadcast_load(a, idx, shape, out),
        broadcast_load(b, idx, shape, out), out))


@lowering(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(ctx, x, mask, value):
    if not is_tensor(value):
        check_scalar_fits(value, ctx.out_dtype)
    return where_(ctx, mask, value, x)


def clamp_expr(v: Expr, lo, hi) -> Expr:
    """min(max(v, lo), hi) with NaN propagation (torch.clamp's semantics)."""
    if lo is not None:
        v = maximum(v, lo)
    if hi is not None:
        v = minimum(v, hi)
    return v


@lowering(aten.clamp.default, aten.clamp.Tensor)
def clamp(ctx, x, min=None, max=None):
    for bound in (min, max):
        if bound is not None and not is_tensor(bound):
            check_scalar_fits(bound, ctx.out_dtype)
    operands = [x] + [b for b in (min, max) if b is not None]

    def body(v, *bounds):
        bounds = list(bounds)
        lo = bounds.pop(0) if min is not None else None
        hi = bounds.pop(0) if max is not None else None
        return clamp_expr(v, lo, hi)

    return elementwise(ctx, operands, body)


@lowering(aten.clamp_min.default, aten.clamp_min.Tensor)
def clamp_min(ctx, x, min):
    return clamp(ctx, x, min=min)


@lowering(aten.clamp_max.default, aten.clamp_max.Tensor)
def clamp_max(ctx, x, max):
    return clamp(ctx, x, max=max)


@lowering(aten.nan_to_num.default)
def nan_to_num(ctx, x, nan=0.0, posinf=None, neginf=None):
    out = ctx.out_dtype
    if not out.is_float:
        return copy_of(ctx, x)
    info = finfo(out)
    nan = 0.0 if nan is None else py(nan)
    posinf = info.max if posinf is None else py(posinf)
    neginf = info.min if neginf is None else py(neginf)

    def body(v):
        r = where(binary("eq", v, lit(math.inf, v)), lit(posinf, v), v)
        r = where(binary("eq", v, lit(-math.inf, v)), lit(neginf, v), r)
        return where(unary("isnan", v), lit(nan, v), r)

    return elementwise(ctx, (x,), body)


# ---------------------------------------------------------------- casts and copies


@lowering(aten._to_copy.default)
def to_copy(ctx, x, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
            memory_format=None):
    if not is_tensor(x):
        raise Unsupported("scalar operand")
    out = ctx.out_dtype
    if out == x.dtype:
        return copy_of(ctx, x)
    return pointwise(ctx, x.shape, out, lambda idx: cast(x.load(idx), out))


@lowering(prims.convert_element_type.default)
def convert_element_type(ctx, x, dtype):
    return to_copy(ctx, x)


@lowering(aten.clone.default, aten.lift_fresh_copy.default)
def clone(ctx, x, memory_format=None):
    return copy_of(ctx, x)


@lowering(aten.alias.default, aten.detach.default)
def alias(ctx, x):
    return x


@lowering(aten.copy.default)
def copy(ctx, dst, src, non_blocking=False):
    out = dst.dtype
    shape = dst.shape
    return pointwise(ctx, shape, out, lambda idx: broadcast_load(src, idx, shape, out))
