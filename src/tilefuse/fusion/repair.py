"""Semantic repair of dependent reductions: derive the rolling update.

A reduction `t = Σ_j g(r, c_j)` whose body reads `r`, itself a reduction over the same axis,
normally needs `r` finished before `t` can start (two passes over the axis). If there is an
`h` with

    h(g(r, c), r, r') = g(r', c)                        (re-basing a term on a new r)
    h(a + b, r, r') = h(a, r, r') + h(b, r, r')         (h distributes over the sum)

then one pass suffices: the loop carries `t ← h(t, r_old, r_new) + Σ_tile g(r_new, c)`.
For softmax's normaliser `g = exp(c − r)` this gives `h = t·exp(r − r')` — the online-softmax
(FlashAttention) update — but nothing here knows about softmax: `h` is derived by sympy for
whatever body the program has (soft-capping, ALiBi biases, temperature, log-sum-exp, cross-
entropy ...), and both conditions are checked symbolically before it is used (Neptune, PLDI
2026, §4.1). Bodies for which no such `h` exists (`Σ (c − r)²`) are refused, with the reason.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from ..ir import dtypes as dt
from ..ir.expr import Binary, Cast, Const, Expr, Index, Load, Unary, binary, cast, const, transform, unary, walk

T, R_OLD, R_NEW = sympy.symbols("t r_old r_new", real=True)
_R = sympy.Symbol("r", real=True)

_SYMPY_UNARY = {"exp": sympy.exp, "log": sympy.log, "neg": lambda x: -x, "tanh": sympy.tanh,
                "sigmoid": lambda x: 1 / (1 + sympy.exp(-x)), "sqrt": sympy.sqrt,
                "rsqrt": lambda x: 1 / sympy.sqrt(x), "reciprocal": lambda x: 1 / x, "abs": sympy.Abs,
                "exp2": lambda x: 2 ** x}
_SYMPY_BINARY = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
                 "truediv": lambda a, b: a / b, "pow": lambda a, b: a ** b}


class NoRepair(Exception):
    """The body has no rolling update; the message says why."""


@dataclass
class Repair:
    """t_new = t_old * factor(r_old, r_new), valid for the consumer over producer `producer`."""

    producer: str
    factor: sympy.Expr  # over R_OLD, R_NEW
    g: sympy.Expr  # the consumer's term as derived, over _R and opaque symbols (for reports)
    pivot: Expr = None  # φ(r): how the body reads the producer (r itself, or e.g. a guarded r)

    @property
    def h(self) -> sympy.Expr:
        return T * self.factor

    def describe(self) -> str:
        shown = self.h.subs({R_OLD: sympy.Symbol("r"), R_NEW: sympy.Symbol("r'")})
        return f"rolling update over {self.producer}: h(t, r, r') = {sympy.sstr(shown)}"

    def factor_expr(self, r_old: Expr, r_new: Expr) -> Expr:
        """The factor as an IR expression over the producer's running values."""

        def at(value):
            return transform(self.pivot, lambda n: cast(value, n.dtype)
                             if isinstance(n, Load) and n.buffer == self.producer else None)

        return _to_ir(self.factor, {R_OLD: cast(at(r_old), dt.float32), R_NEW: cast(at(r_new), dt.float32)})


def _reads_producer(e: Expr, producer: str) -> bool:
    return any(isinstance(n, Load) and n.buffer == producer for n in walk(e))


def _is_pivot(e: Expr, producer: str) -> bool:
    """True for a subexpression of the producer's value alone (no other data, no reduction
    index): the body sees the earlier result only through such an expression φ(r)."""
    for n in walk(e):
        if isinstance(n, Load) and n.buffer != producer:
            return False
        if isinstance(n, Index) and any(str(s).startswith("r") for s in n.expr.free_symbols):
            return False
    return _reads_producer(e, producer)


def _pivots(e: Expr, producer: str, found: set) -> None:
    if _is_pivot(e, producer):
        found.add(e)
        return
    for k in e.children():
        _pivots(k, producer, found)


def _to_sympy(e: Expr, producer: str, pivot: Expr, opaque: dict) -> sympy.Expr:
    """The body as sympy: the pivot φ(r) becomes `r`; any subexpression that does not involve
    the producer becomes an opaque symbol."""
    if e == pivot:
        return _R
    if not _reads_producer(e, producer):
        if isinstance(e, Const) and e.value != "nan":
            return sympy.nsimplify(e.value) if e.dtype.is_float else sympy.Integer(e.value)
        if e not in opaque:
            opaque[e] = sympy.Symbol(f"c{len(opaque)}", real=True)
        return opaque[e]
    if isinstance(e, Cast):
        if not e.dtype.is_float:
            raise NoRepair(f"the body casts the earlier result to {e.dtype}")
        return _to_sympy(e.x, producer, pivot, opaque)
    if isinstance(e, Unary) and e.op in _SYMPY_UNARY:
        return _SYMPY_UNARY[e.op](_to_sympy(e.x, producer, pivot, opaque))
    if isinstance(e, Binary) and e.op in _SYMPY_BINARY:
        return _SYMPY_BINARY[e.op](_to_sympy(e.a, producer, pivot, opaque), _to_sympy(e.b, producer, pivot, opaque))
    raise NoRepair(f"the body applies {getattr(e, 'op', type(e).__name__)} to data and the earlier result together")


def derive_rolling_update(body: Expr, combiner: str, producer: str) -> Repair:
    """Derive h for `combiner_j body(r, c_j)` where `producer` names r. Raises NoRepair."""
    if combiner != "sum":
        raise NoRepair(f"the consumer combines with {combiner}; only sums are re-based")
    pivots: set = set()
    _pivots(body, producer, pivots)
    if len(pivots) != 1:
        raise NoRepair(f"the body reads the earlier result through {len(pivots)} different expressions")
    (pivot,) = pivots
    opaque: dict = {}
    g = _to_sympy(body, producer, pivot, opaque)
    cs = set(opaque.values())
    g_new = g.subs(_R, R_NEW)
    g_old = g.subs(_R, R_OLD)
    factor = sympy.simplify(sympy.powsimp(g_new / g_old, force=True))
    if factor.free_symbols & cs:
        raise NoRepair(f"g(r', c) / g(r, c) = {factor} depends on the data, so no h re-bases a partial sum")
    if sympy.fraction(sympy.together(factor))[1].free_symbols & {R_OLD, R_NEW}:
        raise NoRepair(f"the factor {factor} has a pole in r")
    h = T * factor
    # condition 1: h(g(r, c), r, r') == g(r', c)
    lhs = h.subs(T, g_old)
    if sympy.simplify(sympy.powsimp(sympy.expand(lhs - g_new), force=True)) != 0:
        raise NoRepair("h(g(r, c), r, r') != g(r', c)")
    # condition 2: h distributes over the sum
    a, b = sympy.symbols("a b", real=True)
    if sympy.simplify(h.subs(T, a + b) - h.subs(T, a) - h.subs(T, b)) != 0:
        raise NoRepair("h does not distribute over the sum")
    return Repair(producer=producer, factor=factor, g=g, pivot=pivot)


def _to_ir(e: sympy.Expr, env: dict) -> Expr:
    f32 = dt.float32
    if e in env:
        return env[e]
    if e.is_Number:
        return const(float(e), f32)
    if e.is_Add:
        out = _to_ir(e.args[0], env)
        for a in e.args[1:]:
            out = binary("add", out, _to_ir(a, env))
        return out
    if e.is_Mul:
        out = _to_ir(e.args[0], env)
        for a in e.args[1:]:
            out = binary("mul", out, _to_ir(a, env))
        return out
    if isinstance(e, sympy.exp):
        return unary("exp", _to_ir(e.args[0], env))
    if isinstance(e, sympy.log):
        return unary("log", _to_ir(e.args[0], env))
    if e.is_Pow:
        base, ex = e.args
        if ex == -1:
            return binary("truediv", const(1.0, f32), _to_ir(base, env))
        if base == 2:
            return unary("exp2", _to_ir(ex, env))
        return binary("pow", _to_ir(base, env), _to_ir(ex, env))
    raise NoRepair(f"cannot generate code for the factor term {e}")


__all__ = ["Repair", "NoRepair", "derive_rolling_update"]
