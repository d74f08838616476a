"""Neural-network ops: activations, softmax / log_softmax, layer / group / batch norm, and
the backward ops of these (core ATen decomposes most backward ops; their lowerings serve
graphs traced without those decompositions).

Softmax is written as PyTorch computes it — a max reduction, a sum reduction whose body
reads the max (the dependent-reduction pattern the fusion planner repairs), and a pointwise
normalisation. Layer norm is mean, variance (two-pass) and a pointwise normalisation.
"""
from __future__ import annotations

import math

import sympy
import torch

from ...ir import dtypes as dt
from ...ir.dtypes import DType
from ...ir.expr import Expr, binary, cast, unary, where
from ...ir.monoid import MAX, SUM
from ..registry import Unsupported, lowering
from ..values import TensorValue, ViewValue
from .common import (broadcast_load, canonical_dim, check_scalar_fits, elementwise, meta_dtype, meta_shape,
                     pointwise, py, scalar)
from .pointwise import clamp_expr, lit
from .reductions import Plan, reduce_value, var_value

aten = torch.ops.aten

_SQRT1_2 = math.sqrt(0.5)
_SQRT_2_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


# ---------------------------------------------------------------- activations


def gelu_expr(x: Expr, approximate: str = "none") -> Expr:
    if approximate == "tanh":
        inner = lit(_SQRT_2_PI, x) * (x + lit(0.044715, x) * x * x * x)
        return lit(0.5, x) * x * (lit(1.0, x) + unary("tanh", inner))
    return x * lit(0.5, x) * (lit(1.0, x) + unary("erf", x * lit(_SQRT1_2, x)))


@lowering(aten.gelu.default)
def gelu(ctx, x, *, approximate="none"):
    if approximate not in ("none", "tanh"):
        raise Unsupported(f"gelu approximate={approximate!r}")
    return elementwise(ctx, (x,), lambda v: gelu_expr(v, approximate))


@lowering(aten.silu.default)
def silu(ctx, x):
    return elementwise(ctx, (x,), lambda v: v * unary("sigmoid", v))


@lowering(aten.mish.default)
def mish(ctx, x):
    return elementwise(ctx, (x,), lambda v: v * unary("tanh", _softplus_expr(v, 1.0, 20.0)))


@lowering(aten.hardtanh.default)
def hardtanh(ctx, x, min_val=-1.0, max_val=1.0):
    for bound in (min_val, max_val):
        check_scalar_fits(bound, ctx.out_dtype)  # (as clamp's bounds)
    return elementwise(ctx, (x,), lambda v: clamp_expr(v, py(min_val), py(max_val)))


@lowering(aten.hardsigmoid.default)
def hardsigmoid(ctx, x):
    return elementwise(ctx, (x,), lambda v: clamp_expr(v + lit(3.0, v), 0.0, 6.0) / lit(6.0, v))


@lowering(aten.hardswish.default)
def hardswish(ctx, x):
    return elementwise(ctx, (x,), lambda v: v * clamp_expr(v + lit(3.0, v), 0.0, 6.0) / lit(6.0, v))


@lowering(aten.leaky_relu.default)
def leaky_relu(ctx, x, negative_slope=0.01):
    slope = py(negative_slope)
    return elementwise(ctx, (x,), lambda v: where(binary("gt", v, lit(0, v)), v, v * lit(slope, v)))


@lowering(aten.elu.default)
def elu(ctx, x, alpha=1, scale=1, input_scale=1):
    alpha, scale, input_scale = py(alpha), py(scale), py(input_scale)

    def body(v):
        neg = unary("expm1", v * lit(input_scale, v)) * lit(alpha * scale, v)
        return where(binary("gt", v, lit(0, v)), v * lit(scale, v), neg)

    return elementwise(ctx, (x,), body)


def _softplus_expr(v: Expr, beta, threshold) -> Expr:
    bx = v * lit(beta, v)
    return where(binary("gt", bx, lit(threshold, v)), v, unary("log1p", unary("exp", bx)) / lit(beta, v))


@lowering(aten.softplus.default)
def softplus(ctx, x, beta=1, threshold=20):
    return elementwise(ctx, (x,), lambda v: _softplus_expr(v, py(beta), py(threshold)))


@lowering(aten.threshold.default)
def threshold(ctx, x, threshold, value):
    return elementwise(ctx, (x,), lambda v: where(binary("le", v, lit(py(threshold), v)), lit(py(value), v), v))


# ---------------------------------------------------------------- activation backward ops


@lowering(aten.threshold_backward.default)
def threshold_backward(ctx, grad, x, threshold):
    return elementwise(ctx, (grad, x), lambda g, v: where(binary("le", v, lit(py(threshold), v)), lit(0, g), g))


@lowering(aten.sigmoid_backward.default)
def sigmoid_backward(ctx, grad, y):
    return elementwise(ctx, (grad, y), lambda g, s: g * (lit(1.0, s) - s) * s)


@lowering(aten.tanh_backward.default)
def tanh_backward(ctx, grad, y):
    return elementwise(ctx, (grad, y), lambda g, t: g * (lit(1.0, t) - t * t))


@lowering(aten.silu_backward.default)
def silu_backward(ctx, grad, x):
    def body(g, v):
        s = unary("sigmoid", v)
        return g * s * (lit(1.0, v) + v * (lit(1.0, v) - s))

    return elementwise(ctx, (grad, x), body)


@lowering(aten.gelu_backward.default)
def gelu_backward(ctx, grad, x, *, approximate="none"):
    if approximate == "tanh":
        beta = math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5
        kappa = 0.044715

        def body(g, v):
            inner = lit(beta, v) * (v + lit(kappa, v) * v * v * v)
            t = unary("tanh", inner)
            left = lit(0.5, v) * v
            right = lit(1.0, v) + t
            dleft = lit(0.5, v) * right
            dright = left * (lit(1.0, v) - t * t) * lit(beta, v) * (lit(1.0, v) + lit(3.0 * kappa, v) * v * v)
            return g * (dleft + dright)
    elif approximate == "none":
        def body(g, v):
            cdf = lit(0.5, v) * (lit(1.0, v) + unary("erf", v * lit(_SQRT1_2, v)))
            pdf = unary("exp", lit(-0.5, v) * v * v) * lit(_INV_SQRT_2PI, v)
            return g * (cdf + v * pdf)
    else:
        raise Unsupported(f"gelu approximate={approximate!r}")
    return elementwise(ctx, (grad, x), body)


@lowering(aten.hardtanh_backward.default)
def hardtanh_backward(ctx, grad, x, min_val, max_val):
    lo, hi = py(min_val), py(max_val)
    return elementwise(ctx, (grad, x), lambda g, v: where(
        binary("logical_or", binary("le", v, lit(lo, v)), binary("ge", v, lit(hi, v))), lit(0, g), g))


@lowering(aten.leaky_relu_backward.default)
def leaky_relu_backward(ctx, grad, x, negative_slope, self_is_result):
    slope = py(negative_slope)
    return elementwise(ctx, (grad, x), lambda g, v: where(binary("gt", v, lit(0, v)), g, g * lit(slope, g)))


@lowering(aten.elu_backward.default)
def elu_backward(ctx, grad, alpha, scale, input_scale, is_result, self_or_result):
    alpha, scale, input_scale = py(alpha), py(scale), py(input_scale)
    if is_result:
        def body(g, y):
            neg = g * lit(input_scale, g) * (y + lit(alpha * scale, y))
            return where(binary("le", y, lit(0, y)), neg, g * lit(scale, g))
    else:
        def body(g, v):
            neg = g * lit(input_scale * alpha * scale, g) * unary("exp", v * lit(input_scale, v))
            return where(binary("le", v, lit(0, v)), neg, g * lit(scale, g))
    return elementwise(ctx, (grad, self_or_result), body)


@lowering(aten.softplus_backward.default)
def softplus_backward(ctx, grad, x, beta, threshold):
    beta, threshold = py(beta), py(threshold)

    def body(g, v):
        z = unary("exp", v * lit(beta, v))
        return where(binary("gt", v * lit(beta, v), lit(threshold, v)), g, g * z / (z + lit(1.0, z)))

    return elementwise(ctx, (grad, x), body)


# ---------------------------------------------------------------- softmax


def _as_rank1(x: TensorValue) -> TensorValue:
    return ViewValue(x, (sympy.Integer(1),), lambda idx: (), "unsqueeze")


def _as_rank0(x: TensorValue) -> TensorValue:
    return ViewValue(x, (), lambda idx: (scalar(0),), "squeeze")


def softmax_parts(ctx, x: TensorValue, dim, acc: DType):
    """(plan, row max, sum of exp(x - max)) over `dim`, kept dims for broadcasting back."""
    d = canonical_dim(dim, x.rank)
    p = Plan(tuple(x.shape), [d], True)
    m = reduce_value(ctx, x, p, MAX, acc, acc)
    s = reduce_value(ctx, x, p, SUM, acc, acc,
                     transform=lambda v, idx: unary("exp", binary("sub", v, m.load(idx))))
    return p, m, s


def _softmax_like(log: bool):
    def lower(ctx, x, dim, half_to_float=False):
        out = ctx.out_dtype
        rank0 = x.rank == 0
        src = _as_rank1(x) if rank0 else x
        acc = dt.compute_dtype(out) if out.is_float else dt.float32
        p, m, s = softmax_parts(ctx, src, 0 if rank0 else dim, acc)

        def body(idx):
            v = cast(src.load(idx), acc)
            j = p.output_index(idx)
            shifted = binary("sub", v, m.load(j))
            if log:
                return binary("sub", shifted, unary("log", s.load(j)))
            return binary("truediv", unary("exp", shifted), s.load(j))

        res = pointwise(ctx, src.shape, out, body)
        return _as_rank0(res) if rank0 else res

    return lower


lowering(aten._softmax.default)(_softmax_like(False))
lowering(aten._log_softmax.default)(_softmax_like(True))


def _softmax_backward(log: bool):
    def lower(ctx, grad, y, dim, input_dtype):
        out = ctx.out_dtype
        acc = dt.compute_dtype(out)
        if grad.rank == 0:
            raise Unsupported("0-d softmax backward")
        d = canonical_dim(dim, grad.rank)
        p = Plan(tuple(grad.shape), [d], True)
        if log:  # grad - exp(y) * sum(grad)
            s = reduce_value(ctx, grad, p, SUM, acc, acc)

            def body(idx):
                g, v = cast(grad.load(idx), acc), cast(y.load(idx), acc)
                return binary("sub", g, binary("mul", unary("exp", v), s.load(p.output_index(idx))))
        else:  # y * (grad - sum(grad * y))
            s = reduce_value(ctx, _Lazy(grad.shape, acc, lambda idx: binary(
                "mul", cast(grad.load(idx), acc), cast(y.load(idx), acc))), p, SUM, acc, acc)

            def body(idx):
                g, v = cast(grad.load(idx), acc), cast(y.load(idx), acc)
                return binary("mul", v, binary("sub", g, s.load(p.output_index(idx))))
        return pointwise(ctx, grad.shape, out, body)

    return lower


class _Lazy(TensorValue):
    """A value defined by a function of its index, read only inside reduction bodies here
    (never returned from a lowering)."""

    def __init__(self, shape, dtype, fn):
        self.shape, self.dtype, self.fn = tuple(shape), dtype, fn

    def load(self, index):
        return self.fn(tuple(index))


lowering(aten._softmax_backward_data.default)(_softmax_backward(False))
lowering(aten._log_softmax_backward_data.default)(_softmax_backward(True))


# ---------------------------------------------------------------- normalisation


def _norm_plan(x: TensorValue, normalized_shape) -> Plan:
    k = len(normalized_shape)
    if k == 0 or k > x.rank:
        raise Unsupported("layer norm over no dims")
    return Plan(tuple(x.shape), list(range(x.rank - k, x.rank)), True)


def _maybe_cast(ctx, value: TensorValue, dtype: DType) -> TensorValue:
    if value.dtype == dtype:
        return value
    return pointwise(ctx, value.shape, dtype, lambda idx: cast(value.load(idx), dtype))


@lowering(aten.native_layer_norm.default)
def native_layer_norm(ctx, x, normalized_shape, weight, bias, eps):
    out = meta_dtype(ctx, 0)
    acc = dt.compute_dtype(out)
    p = _norm_plan(x, normalized_shape)
    var, mean = var_value(ctx, x, p, 0, acc)
    eps = py(eps)
    rstd = pointwise(ctx, p.out_shape, acc,
                     lambda idx: unary("rsqrt", binary("add", var.load(idx), scalar(eps, acc))))
    shape = tuple(x.shape)

    def body(idx):
        j = p.output_index(idx)
        v = binary("mul", binary("sub", cast(x.load(idx), acc), mean.load(j)), rstd.load(j))
        if weight is not None:
            v = binary("mul", v, broadcast_load(weight, idx, shape, acc))
        if bias is not None:
            v = binary("add", v, broadcast_load(bias, idx, shape, acc))
        return v

    y = pointwise(ctx, shape, out, body)
    return y, _maybe_cast(ctx, mean, meta_dtype(ctx, 1)), _maybe_cast(ctx, rstd, meta_dtype(ctx, 2))


@lowering(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(ctx, grad, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    """d_input = rstd/N * (N*gw - sum(gw) - xhat*sum(gw*xhat)), gw = grad*weight, xhat =
    (x - mean)*rstd; d_weight = sum over the outer dims of grad*xhat; d_bias = sum of grad."""
    out = meta_dtype(ctx, 0) if ctx.current_meta[0] is not None else x.dtype
    acc = dt.compute_dtype(x.dtype)
    p = _norm_plan(x, normalized_shape)
    shape = tuple(x.shape)
    n = p.numel
    outer = Plan(shape, list(range(0, x.rank - len(normalized_shape))), False)

    def xhat(idx):
        j = p.output_index(idx)
        return binary("mul", binary("sub", cast(x.load(idx), acc), cast(mean.load(j), acc)), cast(rstd.load(j), acc))

    def gw(idx):
        g = cast(grad.load(idx), acc)
        return binary("mul", g, broadcast_load(weight, idx, shape, acc)) if weight is not None else g

    results = []
    if output_mask[0]:
        s1 = reduce_value(ctx, _Lazy(shape, acc, gw), p, SUM, acc, acc)
        s2 = reduce_value(ctx, _Lazy(shape, acc, lambda idx: binary("mul", gw(idx), xhat(idx))), p, SUM, acc, acc)

        def dx(idx):
            j = p.output_index(idx)
            inner = binary("sub", binary("sub", binary("mul", gw(idx), cast(scalar(n), acc)), s1.load(j)),
                           binary("mul", xhat(idx), s2.load(j)))
            return binary("mul", binary("truediv", cast(rstd.load(j), acc), cast(scalar(n), acc)), inner)

        results.append(pointwise(ctx, shape, out, dx))
    else:
        results.append(None)
    if output_mask[1] and weight is not None:
        wd = meta_dtype(ctx, 1)
        g_xhat = _Lazy(shape, acc, lambda idx: binary("mul", cast(grad.load(idx), acc), xhat(idx)))
        results.append(reduce_value(ctx, g_xhat, outer, SUM, acc, wd))
    else:
        results.append(None)
    if output_mask[2] and bias is not None:
        bd = meta_dtype(ctx, 2)
        results.append(reduce_value(ctx, grad, outer, SUM, acc, bd))
    else:
        results.append(None)
    return tuple(results)


def _batch_norm_apply(ctx, x, weight, bias, mean_at, rstd_at, out, acc):
    """y[n, c, ...] = (x - mean[c]) * rstd[c] * weight[c] + bias[c]."""

    def body(idx):
        c = idx[1]
        y = binary("mul", binary("sub", cast(x.load(idx), acc), mean_at(c)), rstd_at(c))
        if weight is not None:
            y = binary("mul", y, cast(weight.load((c,)), acc))
        if bias is not None:
            y = binary("add", y, cast(bias.load((c,)), acc))
        return y

    return pointwise(ctx, x.shape, out, body)


def _empty_outputs(ctx, ks):
    return tuple(pointwise(ctx, meta_shape(ctx, k), meta_dtype(ctx, k), lambda idx: scalar(0, dt.float32))
                 for k in ks)


@lowering(aten._native_batch_norm_legit_no_training.default)
def batch_norm_inference(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
    if x.rank < 2:
        raise Unsupported("batch norm input must have a channel dim")
    out = meta_dtype(ctx, 0)
    acc = dt.compute_dtype(out)
    eps = py(eps)
    y = _batch_norm_apply(
        ctx, x, weight, bias, lambda c: cast(running_mean.load((c,)), acc),
        lambda c: unary("rsqrt", binary("add", cast(running_var.load((c,)), acc), scalar(eps, acc))), out, acc)
    return (y,) + _empty_outputs(ctx, (1, 2))


def _batch_stats(ctx, x, eps, acc):
    """Per-channel (mean, biased variance, rstd) over every dim but 1, each of shape (C,)."""
    p = Plan(tuple(x.shape), [d for d in range(x.rank) if d != 1], False)
    var, mean = var_value(ctx, x, p, 0, acc)
    rstd = pointwise(ctx, p.out_shape, acc,
                     lambda idx: unary("rsqrt", binary("add", var.load(idx), scalar(eps, acc))))
    return p, mean, var, rstd


@lowering(aten._native_batch_norm_legit.no_stats)
def batch_norm_no_stats(ctx, x, weight, bias, training, momentum, eps):
    """Batch statistics (instance norm and batch norm without running stats)."""
    if x.rank < 2:
        raise Unsupported("batch norm input must have a channel dim")
    out = meta_dtype(ctx, 0)
    acc = dt.compute_dtype(out)
    _, mean, _, rstd = _batch_stats(ctx, x, py(eps), acc)
    y = _batch_norm_apply(ctx, x, weight, bias, lambda c: mean.load((c,)), lambda c: rstd.load((c,)), out, acc)
    return y, _maybe_cast(ctx, mean, meta_dtype(ctx, 1)), _maybe_cast(ctx, rstd, meta_dtype(ctx, 2))


@lowering(aten._native_batch_norm_legit_functional.default)
def batch_norm_functional(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps):
    """Training-mode batch norm as AOTAutograd's functionalised graphs call it: returns the
    output, the saved mean / rstd and the updated running statistics."""
    if not training:
        y = batch_norm_inference(ctx, x, weight, bias, running_mean, running_var, momentum, eps)[0]
        return (y,) + _empty_outputs(ctx, (1, 2)) + (running_mean, running_var)
    if x.rank < 2:
        raise Unsupported("batch norm input must have a channel dim")
    out = meta_dtype(ctx, 0)
    acc = dt.compute_dtype(out)
    momentum = py(momentum)
    p, mean, var, rstd = _batch_stats(ctx, x, py(eps), acc)
    y = _batch_norm_apply(ctx, x, weight, bias, lambda c: mean.load((c,)), lambda c: rstd.load((c,)), out, acc)
    n = p.numel
    unbias = cast(binary("truediv", cast(scalar(n), dt.float64), cast(scalar(sympy.Max(n - 1, 1)), dt.float64)), acc)

    def update(running, stat, scale=None):
        rd = running.dtype

        def body(idx):
            new = cast(stat.load(idx), acc)
            if scale is not None:
                new = binary("mul", new, scale)
            return binary("add", binary("mul", cast(running.load(idx), acc), scalar(1.0 - momentum, acc)),
                          binary("mul", new, scalar(momentum, acc)))

        return pointwise(ctx, running.shape, rd, body)

    return (y, _maybe_cast(ctx, mean, meta_dtype(ctx, 1)), _maybe_cast(ctx, rstd, meta_dtype(ctx, 2)),
            update(running_mean, mean), update(running_var, var, unbias))


@lowering(aten.native_group_norm.default)
def native_group_norm(ctx, x, weight, bias, N, C, HxW, group, eps):
    """Statistics over (C/G, *spatial) per (n, g); mean and rstd have shape (N, G)."""
    group = int(py(group))
    if x.rank < 2 or not isinstance(py(C), int):
        raise Unsupported("group norm needs a concrete channel count")
    C = int(py(C))
    cg = C // group
    out = meta_dtype(ctx, 0)
    acc = dt.compute_dtype(out)
    spatial = tuple(x.shape[2:])
    from .views import reshape

    grouped = reshape(x, (x.shape[0], group, cg) + spatial)
    p = Plan(tuple(grouped.shape), list(range(2, grouped.rank)), False)
    var, mean = var_value(ctx, grouped, p, 0, acc)
    eps = py(eps)
    rstd = pointwise(ctx, p.out_shape, acc,
                     lambda idx: unary("rsqrt", binary("add", var.load(idx), scalar(eps, acc))))

    def body(idx):
        ch = idx[1]
        g = (idx[0], scalar(0) if group == 1 else _div(ch, cg))
        y = binary("mul", binary("sub", cast(x.load(idx), acc), mean.load(g)), rstd.load(g))
        if weight is not None:
            y = binary("mul", y, cast(weight.load((ch,)), acc))
        if bias is not None:
            y = binary("add", y, cast(bias.load((ch,)), acc))
        return y

    y = pointwise(ctx, x.shape, out, body)
    return y, _maybe_cast(ctx, mean, meta_dtype(ctx, 1)), _maybe_cast(ctx, rstd, meta_dtype(ctx, 2))


def _div(i, n):
    from ..values import ix_floordiv

    return ix_floordiv(i, n)
