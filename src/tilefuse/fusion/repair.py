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

import functools

from dataclasses import dataclass

import sympy

from ..ir import dtypes as dt
from ..ir.expr import Binary, Cast, Const, Expr, Index, Load, Unary, Where, binary, cast, const, transform, walk
from ..ir.monoid import SUM, Monoid
from ..ir.rewrite import sympy_to_expr

T = sympy.Symbol("t", real=True)

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
    """t_new = t_old * factor(r_old.., r_new..) for a consumer reading the running values of
    `producers` (one, like softmax's max; or several, like attention's max and normaliser)."""

    producers: tuple
    factor: sympy.Expr  # over old_k / new_k symbols, one pair per producer
    g: sympy.Expr  # the consumer's term as derived (for reports)
    pivots: tuple = ()  # φ_k(r_k): how the body reads producer k (r_k itself, or a guarded r_k)
    olds: tuple = ()
    news: tuple = ()

    @property
    def producer(self) -> str:
        return self.producers[0]

    @property
    def h(self) -> sympy.Expr:
        return T * self.factor

    def describe(self) -> str:
        names = {}
        for k, (o, n) in enumerate(zip(self.olds, self.news)):
            base = "r" if len(self.producers) == 1 else f"r{k}"
            names[o], names[n] = sympy.Symbol(base), sympy.Symbol(base + "'")
        args = ", ".join(str(names[o]) for o in self.olds) + ", " + ", ".join(str(names[n]) for n in self.news)
        over = ", ".join(self.producers)
        text = f"rolling update over {over}: h(t, {args}) = {sympy.sstr(self.h.subs(names))}"
        shown = [f"{names[o]} = {p}" for o, p in zip(self.olds, self.pivots) if not isinstance(p, Load)]
        return text + (f" where {', '.join(shown)}" if shown else "")

    def factor_expr(self, old_values, new_values) -> Expr:
        """The factor as an IR expression over the producers' running values (one value per
        producer, in `producers` order; a single value may be passed bare)."""
        if isinstance(old_values, Expr):
            old_values, new_values = (old_values,), (new_values,)
        env = {}
        wide = _compute(*old_values, *new_values)
        for prod, pivot, o, n, ov, nv in zip(self.producers, self.pivots, self.olds, self.news, old_values, new_values):
            def at(value, pivot=pivot, prod=prod):
                return transform(pivot, lambda e: cast(value, e.dtype)
                                 if isinstance(e, Load) and e.buffer == prod else None)

            env[o], env[n] = cast(at(ov), wide), cast(at(nv), wide)
        return _to_ir(self.factor, env, wide)


def _reads_producer(e: Expr, producer) -> bool:
    producers = (producer,) if isinstance(producer, str) else producer
    return any(isinstance(n, Load) and n.buffer in producers for n in walk(e))


def _is_pivot(e: Expr, producer: str) -> bool:
    """True for a subexpression of the producer's value alone (no other data, no index terms):
    the body sees the earlier result only through such an expression φ(r)."""

    def clean(n) -> bool:
        if isinstance(n, Load):
            return n.buffer == producer  # its own index addresses the producer: not a term
        if isinstance(n, Index):
            return False
        return all(clean(k) for k in n.children())

    return _reads_producer(e, producer) and clean(e)


def _pivots(e: Expr, producer: str, found: set) -> None:
    if _is_pivot(e, producer):
        found.add(e)
        return
    for k in e.children():
        _pivots(k, producer, found)





def _to_sympy(e: Expr, producers: tuple, pivots: dict, opaque: dict) -> sympy.Expr:
    """The body as sympy: each pivot φ_k(r_k) becomes its symbol; any subexpression that does
    not involve a producer becomes an opaque symbol."""
    if e in pivots:
        return pivots[e]
    if not _reads_producer(e, producers):
        if isinstance(e, Const) and e.value != "nan":
            return sympy.nsimplify(e.value) if e.dtype.is_float else sympy.Integer(e.value)
        if e not in opaque:
            opaque[e] = sympy.Symbol(f"c{len(opaque)}", real=True)
        return opaque[e]
    if isinstance(e, Cast):
        if not e.dtype.is_float:
            raise NoRepair(f"the body casts an earlier result to {e.dtype}")
        return _to_sympy(e.x, producers, pivots, opaque)
    if isinstance(e, Unary) and e.op in _SYMPY_UNARY:
        return _SYMPY_UNARY[e.op](_to_sympy(e.x, producers, pivots, opaque))
    if isinstance(e, Binary) and e.op in _SYMPY_BINARY:
        return _SYMPY_BINARY[e.op](_to_sympy(e.a, producers, pivots, opaque),
                                   _to_sympy(e.b, producers, pivots, opaque))
    raise NoRepair(f"the body applies {getattr(e, 'op', type(e).__name__)} to data and an earlier result together")


def derive_rolling_update(body: Expr, combiner: Monoid, producer) -> Repair:
    """Derive h for `combiner_j body(r.., c_j)` where `producer` names the earlier reduction
    (or a tuple of them) whose running values the body reads. Raises NoRepair."""
    producers = (producer,) if isinstance(producer, str) else tuple(producer)
    if combiner != SUM:
        raise NoRepair(f"the consumer combines with {combiner}; only sums are re-based")
    pivots: dict = {}
    olds, news = [], []
    for k, prod in enumerate(producers):
        found: set = set()
        _pivots(body, prod, found)
        if len(found) != 1:
            raise NoRepair(f"the body reads {prod} through {len(found)} different expressions")
        base = "r" if len(producers) == 1 else f"r{k}"
        pivots[found.pop()] = sympy.Symbol(base, real=True)
        olds.append(sympy.Symbol(f"{base}_old", real=True))
        news.append(sympy.Symbol(f"{base}_new", real=True))
    opaque: dict = {}
    g = _to_sympy(body, producers, pivots, opaque)
    verdict, factor = _rebasing(g, tuple(pivots.values()), tuple(olds), tuple(news), frozenset(opaque.values()))
    if verdict:
        raise NoRepair(verdict)
    return Repair(producers=producers, factor=factor, g=g, pivots=tuple(pivots), olds=tuple(olds), news=tuple(news))


@functools.lru_cache(maxsize=1024)
def _rebasing(g, syms: tuple, olds: tuple, news: tuple, cs: frozenset):
    """("", h's factor) re-basing Σ g(r, c_j) from r to r', or (why not, None). The sympy work
    of a derivation, cached: every layer of a model asks it for the same canonical g (pivots
    r.., data symbols c0, c1, .. in order of appearance)."""
    g_new = g.subs(dict(zip(syms, news)), simultaneous=True)
    g_old = g.subs(dict(zip(syms, olds)), simultaneous=True)
    if _varies_with_data(g_new / g_old, cs):
        # (the common refusal — a variance's (c - r)² — proven by two evaluations instead of
        # `simplify`, which took 0.11 s of a GPT-2's planning to say the same)
        return f"g(r', c) / g(r, c) = {g_new / g_old} depends on the data, so no h re-bases a partial sum", None
    # (softmax's exp(c - r') / exp(c - r) is exp(r - r') here. powsimp's form is the factor the
    # kernel computes where it needs no simplify; a body whose r also sits in a data-free
    # subterm (log(1 + exp(-r))) could keep a 0/0-prone form, but the pivots `_pivots` picks
    # are maximal: such a subterm becomes a pivot of its own, never part of g)
    factor = sympy.powsimp(g_new / g_old, force=True)
    if factor.free_symbols & cs or not (factor.is_positive and factor.is_finite):
        factor = sympy.simplify(factor)
    if factor.free_symbols & cs:
        return f"g(r', c) / g(r, c) = {factor} depends on the data, so no h re-bases a partial sum", None
    if not (factor.is_positive and factor.is_finite):
        # condition 1 divides by g(r, c): a factor that can be 0 or infinite (r'/r when a
        # running value crosses 0) would lose the partial sum at run time
        return f"the factor {factor} is not provably positive and finite", None
    h = T * factor
    # condition 1: h(g(r, c), r, r') == g(r', c)
    if not _is_zero(h.subs(T, g_old) - g_new):
        return "h(g(r, c), r, r') != g(r', c)", None
    # condition 2: h distributes over the sum
    a, b = sympy.symbols("a b", real=True)
    if not _is_zero(h.subs(T, a + b) - h.subs(T, a) - h.subs(T, b)):
        return "h does not distribute over the sum", None
    return "", factor


def _is_zero(e) -> bool:
    """Whether `e` is identically 0: expanded and its powers combined (enough for the repairs
    seen; a process's first `simplify` costs about 0.1 s), else whatever `simplify` shows."""
    e = sympy.powsimp(sympy.expand(e), force=True)
    return e == 0 or sympy.simplify(e) == 0


def _varies_with_data(ratio, cs: frozenset) -> bool:
    """True when `ratio` is shown to take different values for two choices of the data symbols
    `cs` (every other symbol held at one value): evaluated to 30 digits at exact rational
    points, a difference far above the evaluation's error is a proof. False is no proof either
    way (an evaluation that is not a finite real, or two equal values): `simplify` decides."""
    data = sorted(ratio.free_symbols & cs, key=str)
    if not data:
        return False
    held = {s: sympy.Rational(3 + 2 * k, 7) for k, s in enumerate(sorted(ratio.free_symbols - cs, key=str))}
    values = []
    for trial in (1, 2):
        point = {**held, **{c: sympy.Rational(5 * trial + k, 3 + trial) for k, c in enumerate(data)}}
        try:
            v = sympy.N(ratio.subs(point), 30)
        except Exception:  # noqa: BLE001 — an evaluation sympy cannot do proves nothing
            return False
        if not (v.is_real and v.is_finite and v.is_Number):
            return False
        values.append(v)
    return abs(values[0] - values[1]) > sympy.Float("1e-12", 30) * (1 + abs(values[0]))


def _compute(*exprs: Expr):
    """fp64 when a value is double (the repair must not round it to fp32), else fp32."""
    return dt.float64 if any(e.dtype == dt.float64 for e in exprs) else dt.float32


def _to_ir(e: sympy.Expr, env: dict, dtype) -> Expr:
    try:
        return sympy_to_expr(e, env, dtype)
    except NotImplementedError as err:
        raise NoRepair(f"cannot generate code for the factor term {e}") from err


__all__ = ["Repair", "NoRepair", "derive_rolling_update", "Deferred", "defer_row_factors"]


@dataclass
class Deferred:
    """Σ_j φ(r..)·g'(c_j) = φ(r..)·Σ_j g'(c_j): φ depends on the rows' reductions alone, so it
    is applied once after the loop instead of to every term (attention's 1/l)."""

    post: Expr  # φ over loads of the producers (evaluated with their final values)
    factors: tuple  # the remaining term's multiplicative factors, as IR expressions
    guards: tuple = ()  # row-only conditions under which the whole sum is 0 (where(c, 0, x))


def _factors(e: Expr) -> list:
    """Multiplicative factors of an expression as (expr, is_divisor) pairs; float casts are
    looked through (the factors are recombined in fp32, fp64 for double values)."""
    if isinstance(e, Cast) and e.dtype.is_float and e.x.dtype.is_float:
        return _factors(e.x)
    if isinstance(e, Binary) and e.op == "mul":
        return _factors(e.a) + _factors(e.b)
    if isinstance(e, Binary) and e.op == "truediv":
        return _factors(e.a) + [(f, not d) for f, d in _factors(e.b)]
    if isinstance(e, Where) and isinstance(e.a, Const) and e.a.value == 0:
        return [(e.cond, "guard")] + _factors(e.b)
    return [(e, False)]


def defer_row_factors(body: Expr, producers: tuple) -> Deferred | None:
    """Split `body` into factors that depend only on the producers' values (no data, no
    reduction index) and the rest, keeping the original subexpressions."""
    post, rest, guards = [], [], []
    wide = _compute(*(f for f, kind in _factors(body) if kind != "guard"))
    for f, kind in _factors(body):
        row_only = _reads_producer(f, producers) and not any(
            isinstance(n, Load) and n.buffer not in producers for n in walk(f)) and not any(
            isinstance(n, Index) and any(str(s).startswith("r") for s in n.expr.free_symbols) for n in walk(f))
        if kind == "guard":
            if not row_only:
                return None
            guards.append(f)
            continue
        (post if row_only else rest).append((cast(f, wide), kind))
    if not (post or guards) or not rest:
        return None

    def product(parts):
        out = None
        for f, is_div in parts:
            term = binary("truediv", const(1.0, wide), f) if is_div else f
            out = term if out is None else binary("mul", out, term)
        return out

    if any(is_div for _, is_div in rest):
        return None
    return Deferred(post=product(post) if post else const(1.0, wide), factors=tuple(f for f, _ in rest),
                    guards=tuple(guards))
