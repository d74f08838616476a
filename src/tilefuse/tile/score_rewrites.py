"""Algebraic rewrites of an attention kernel's loop body, applied while it is lowered.

Each keeps the value (or, for bf16/fp16 inputs, stays far below the inputs' own resolution)
and removes work per score: a positive scale pulled out of masking selections and out of the
running max, `exp(x·c − m)` as `exp2` (one multiply-add where no score can overflow),
divisions by constants as multiplications, and the hardware `tanh`.
"""
from __future__ import annotations

from ..ir import dtypes as dt
from ..ir.expr import Binary, Cast, Const, Index, Load, Unary, Where, binary, transform, unary, walk

LOG2E = 1.4426950408889634


def relax_for_low_precision(body):
    """Inside an attention kernel whose operands are bf16/fp16 the scores feed `exp` and a
    low-precision `dot`: a division by a constant becomes a multiplication by its reciprocal
    (≤ 1 ulp apart) and `tanh` (soft-capping) the hardware approximation, both far below the
    inputs' own resolution — as FlashAttention kernels compute them."""
    def fn(n):
        if isinstance(n, Unary) and n.op == "tanh" and n.dtype == dt.float32:
            return unary("tanh_approx", n.x)
        if isinstance(n, Binary) and n.op == "truediv" and n.dtype == dt.float32 and isinstance(n.b, Const) \
                and n.b.value != "nan" and float(n.b.value) not in (0.0, float("inf"), float("-inf")):
            return fn(binary("mul", n.a, Const(1.0 / float(n.b.value), dt.float32))) or \
                binary("mul", n.a, Const(1.0 / float(n.b.value), dt.float32))
        if isinstance(n, Binary) and n.op == "mul" and isinstance(n.b, Const) and isinstance(n.a, Binary) \
                and n.a.op == "mul" and isinstance(n.a.b, Const) and n.dtype == dt.float32 and n.a.dtype == dt.float32:
            return binary("mul", n.a.a, Const(float(n.a.b.value) * float(n.b.value), dt.float32))  # (x·c)·d
        return None

    return transform(body, fn)


def positive_scale(e) -> bool:
    return (isinstance(e, Binary) and e.op in ("mul", "truediv") and isinstance(e.b, Const) and e.b.dtype.is_float
            and e.b.value != "nan" and 0 < float(e.b.value) < float("inf"))


def pull_scales(body):
    """`where(c, ±inf or 0, x·k)` → `where(c, ±inf or 0, x)·k` for a positive constant k (the
    masked branch is unchanged by the scale): the scale then folds into `exp2`'s constant and
    comes out of a running max."""
    def special(e) -> bool:
        return isinstance(e, Const) and e.dtype.is_float and e.value != "nan" and float(e.value) in (
            0.0, float("inf"), float("-inf"))

    def fn(n):
        if isinstance(n, Where) and n.dtype.is_float:
            if special(n.a) and positive_scale(n.b):
                return binary(n.b.op, Where(n.cond, n.a, n.b.a, n.dtype), n.b.b)
            if special(n.b) and positive_scale(n.a):
                return binary(n.a.op, Where(n.cond, n.a.a, n.b, n.dtype), n.a.b)
        return None

    return transform(body, fn)


def exp_as_exp2(body, row_buffers: set):
    """`exp(x·c − r)` with `r` a per-row value (a running max) as `exp2`.

    When the scale folds into a constant `k = c·log2 e` with |k| ≤ 1, as the FlashAttention
    form `exp2(x·k − r·log2 e)`: one fused multiply-add and one `ex2` per score, `r·log2 e`
    once per row. Neither product can overflow then (|x·k| ≤ |x|, and a running max of `x·c`
    times log2 e is at most |x·k|), so no finite score turns into `-inf − -inf`.

    Otherwise — no constant scale, as when the mask is added after scaling, or a large one —
    as `exp2((x·c − r)·log2 e)`, the difference first (Triton's own `exp` multiplies by log2 e
    before its `ex2` anyway): scores near the fp32 limit (Hugging Face's additive masks are
    `finfo.min`) would overflow to -inf when multiplied by log2 e first, and a row masked that
    way throughout (a left-padded query row) would give `-inf − -inf = NaN` where eager's
    `exp(0) = 1` gives uniform weights."""
    def row_only(e) -> bool:
        loads = [n for n in walk(e) if isinstance(n, Load)]
        return bool(loads) and all(n.buffer in row_buffers for n in loads) and not any(
            isinstance(n, Index) and any(str(x).startswith("r") for x in n.expr.free_symbols)
            for n in walk(e) if not isinstance(n, Load) and n not in [i for ld in loads for i in ld.index])

    def folded(x):
        """(x', k) with x = x'·c and k = c·log2 e, |k| ≤ 1; None if there is no such scale."""
        while isinstance(x, Cast) and x.dtype == dt.float32 and x.x.dtype == dt.float32:
            x = x.x
        if isinstance(x, Binary) and x.op in ("mul", "truediv") and isinstance(x.b, Const) and x.b.dtype.is_float:
            c = float(x.b.value)
            if c != 0 and c == c and abs(c) != float("inf"):
                k = LOG2E * c if x.op == "mul" else LOG2E / c
                if abs(k) <= 1.0:
                    return x.a, k
        return None

    def fn(n):
        if not (isinstance(n, Unary) and n.op == "exp" and n.dtype == dt.float32 and isinstance(n.x, Binary)
                and n.x.op == "sub" and row_only(n.x.b)):
            return None
        fold = folded(n.x.a)
        if fold is None:
            return unary("exp2", binary("mul", n.x, Const(LOG2E, dt.float32)))
        x, k = fold
        return unary("exp2", binary("sub", binary("mul", x, Const(k, dt.float32)),
                                    binary("mul", n.x.b, Const(LOG2E, dt.float32))))

    return transform(body, fn)


__all__ = ["relax_for_low_precision", "pull_scales", "exp_as_exp2", "positive_scale", "LOG2E"]
