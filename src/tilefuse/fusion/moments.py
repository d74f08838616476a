"""Semantic repair of dependent reductions by moment expansion.

A reduction `t = Σ_j g(r, c_j)` whose body reads `r`, earlier reductions over the same axis,
needs `r` finished before `t` can start — unless `g` is a polynomial in `r` (seen, as in
`fusion.repair`, through pivots φ(r): `r` itself or a row-only expression such as `sum / n`).
Then, expanded around a per-row point `s` (the Taylor expansion of a polynomial is exact),

    t = Σ_j g(r, c_j) = Σ_α (r − s)^α · M_α,     M_α = Σ_j q_α(s, c_j),  q_α = ∂^α g(s, c) / α!

and every moment `M_α` is an independent reduction that the loop can carry next to `r`'s own;
after the loop `t` is combined from the finished `r`. Variance, `E[(x − μ)³]`, `(x − μ)·w`,
`Σ (a·x + r)²` and bodies reading several earlier results all come out of the same derivation:
sympy decides that `g` is polynomial in the pivots and of small degree (it refuses otherwise,
with the reason) and provides the expansion that reports print.

Numerics: the naive `Σx² − n·μ²` cancels catastrophically when |μ| ≫ σ. Expanding around a
point `s` close to the data (the lowering estimates each pivot from the axis's first tile)
keeps `r − s` small, and the coefficients `q_α` are generated from the body's own expression
with the pivot replaced by `s` (truncated Taylor arithmetic on the IR, not sympy's expanded
form), so `(x − s)` is formed before it is squared. A pivot that only scales the body
(`rstd³ · Σ(x − μ)³`) is expanded around 0: it needs no moments of its own.

This module owns the derivation; `fusion.planner` tries it after the rolling update,
`fusion.schedule` runs the stage in its producers' pass and `tile.reduction` lowers it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product as cartesian

import sympy

from ..ir import dtypes as dt
from ..ir.expr import Binary, Cast, Const, Expr, Unary, Var, binary, cast, free_symbols, red_index, unary, where
from ..ir.monoid import SUM, Monoid
from ..ir.printer import format_expr
from .repair import NoRepair, _pivots, _reads_producer, _to_sympy

MAX_DEGREE = 4


@dataclass
class MomentRepair:
    """t = Σ_α Π_k (φ_k − s_k)^α_k · Σ_j q_α(c_j), combined after the loop that carries the
    moments next to the producers."""

    producers: tuple  # kernel members whose finished values the body reads
    pivots: tuple  # φ_k: how the body reads them (expressions over the producers' loads)
    shifts: tuple  # per pivot: the Var holding its per-row expansion point, or None (0)
    terms: tuple  # (α, q_α) with q_α over the data and the shift Vars, in `dtype`
    dtype: object  # accumulation dtype
    text: str = ""

    def describe(self) -> str:
        return self.text

    @staticmethod
    def reads_axis(q: Expr) -> bool:
        """False for a coefficient constant along the reduction axis: its moment is n·q."""
        return _reads_axis(q)

    def combine(self, pivot_values, moments) -> Expr:
        """Σ_α Π_k δ_k^α_k · M_α from the finished pivot values and the moments (in `terms`
        order), as an IR expression."""
        deltas = [cast(v, self.dtype) if s is None else binary("sub", cast(v, self.dtype), s)
                  for v, s in zip(pivot_values, self.shifts)]
        out = None
        for (alpha, _), m in zip(self.terms, moments):
            term, hit = m, None
            for k, a in enumerate(alpha):
                for _ in range(a):
                    term = binary("mul", term, deltas[k])
                if a and self.shifts[k] is not None:
                    zero = binary("eq", deltas[k], Const(0.0, self.dtype))
                    hit = zero if hit is None else binary("logical_or", hit, zero)
            if hit is not None:
                # a shift that is the pivot's final value leaves exactly Σ g(r, c): the term is 0
                # even where its moment is infinite (data of ±inf; inf·0 would give NaN)
                term = where(hit, Const(0.0, self.dtype), term)
            out = term if out is None else binary("add", out, term)
        return out if out is not None else Const(0.0, self.dtype)


def _reads_axis(e: Expr) -> bool:
    return bool(free_symbols(e) & set(red_index(8)))


# ---------------------------------------------------------------- truncated Taylor arithmetic
def _is(e: Expr, value: float) -> bool:
    return isinstance(e, Const) and e.value == value


def _neg(a: Expr) -> Expr:
    if isinstance(a, Const):
        return Const(-a.value, a.dtype)
    if isinstance(a, Unary) and a.op == "neg":
        return a.x
    return unary("neg", a)


def _mul(a: Expr, b: Expr) -> Expr:
    if isinstance(a, Const) and isinstance(b, Const):
        return Const(a.value * b.value, a.dtype)
    if _is(a, 1.0):
        return b
    if _is(b, 1.0):
        return a
    if _is(a, -1.0):
        return _neg(b)
    if _is(b, -1.0):
        return _neg(a)
    return binary("mul", a, b)


def _plus(a: Expr, b: Expr) -> Expr:
    if isinstance(a, Const) and isinstance(b, Const):
        return Const(a.value + b.value, a.dtype)
    if isinstance(b, Unary) and b.op == "neg":
        return binary("sub", a, b.x)
    return binary("add", a, b)


class _Jets:
    """Each subexpression of the body as {α: coefficient of Π δ_k^α_k}, truncated at the
    polynomial's degree: the Taylor coefficients around the shifts, built from the body's own
    operations (so `x − r` becomes `x − s` and the multi-index terms of its powers)."""

    def __init__(self, producers, pivots: dict, shifts, degree: int, dtype):
        self.producers, self.pivots, self.degree, self.dtype = producers, pivots, degree, dtype
        self.zero = (0,) * len(shifts)
        self.seeds = []
        for k, s in enumerate(shifts):
            unit = tuple(int(j == k) for j in range(len(shifts)))
            seed = {unit: Const(1.0, dtype)}
            if s is not None:
                seed[self.zero] = s
            self.seeds.append(seed)
        self.memo: dict = {}

    def __call__(self, e: Expr) -> dict:
        if e not in self.memo:
            self.memo[e] = self._jet(e)
        return self.memo[e]

    def _add(self, a: dict, b: dict, sign: float = 1.0) -> dict:
        out = dict(a)
        for k, v in b.items():
            v = v if sign > 0 else _neg(v)
            out[k] = _plus(out[k], v) if k in out else v
        return out

    def _product(self, a: dict, b: dict) -> dict:
        out: dict = {}
        for (ka, va), (kb, vb) in cartesian(a.items(), b.items()):
            k = tuple(x + y for x, y in zip(ka, kb))
            if sum(k) > self.degree:
                continue
            t = _mul(va, vb)
            out[k] = _plus(out[k], t) if k in out else t
        return out

    def _jet(self, e: Expr) -> dict:
        if e in self.pivots:
            return self.seeds[self.pivots[e]]
        if not _reads_producer(e, self.producers):
            return {self.zero: cast(e, self.dtype)}
        if isinstance(e, Cast) and e.dtype.is_float and e.x.dtype.is_float:
            return self(e.x)
        if isinstance(e, Unary) and e.op == "neg":
            return {k: _neg(v) for k, v in self(e.x).items()}
        if isinstance(e, Binary) and e.op in ("add", "sub"):
            return self._add(self(e.a), self(e.b), 1.0 if e.op == "add" else -1.0)
        if isinstance(e, Binary) and e.op == "mul":
            return self._product(self(e.a), self(e.b))
        if isinstance(e, Binary) and e.op == "truediv" and not _reads_producer(e.b, self.producers):
            d = cast(e.b, self.dtype)
            return {k: binary("truediv", v, d) for k, v in self(e.a).items()}
        if isinstance(e, Binary) and e.op == "pow" and isinstance(e.b, Const) and e.b.value != "nan" \
                and float(e.b.value).is_integer() and 0 <= float(e.b.value) <= self.degree:
            out = {self.zero: Const(1.0, self.dtype)}
            for _ in range(int(e.b.value)):
                out = self._product(out, self(e.a))
            return out
        raise NoRepair(f"the body applies {getattr(e, 'op', type(e).__name__)} to an earlier result "
                       f"in a way the expansion cannot follow")


# ---------------------------------------------------------------- derivation
def derive_moments(body: Expr, combiner: Monoid, producers, name: str = "t") -> MomentRepair:
    """Expand `combiner_j body(r.., c_j)` as a polynomial in the values of `producers` (one
    name or several). Raises NoRepair when the body is not a small polynomial in them."""
    producers = (producers,) if isinstance(producers, str) else tuple(producers)
    if combiner != SUM:
        raise NoRepair(f"the consumer combines with {combiner}; only sums expand into moments")
    if not body.dtype.is_float:
        raise NoRepair(f"the body is {body.dtype}, not floating point")
    found: list = []
    for prod in producers:
        here: set = set()
        _pivots(body, prod, here)
        found.extend(sorted(here - set(found), key=str))
    if not found:
        raise NoRepair("the body reads no earlier result")
    producers = tuple(p for p in producers if _reads_producer(body, p))
    single = len(found) == 1
    syms = [sympy.Symbol("r" if single else f"r_{k}", real=True) for k in range(len(found))]
    pivots = dict(zip(found, syms))
    opaque: dict = {}
    g = _to_sympy(body, producers, pivots, opaque)
    if g.is_polynomial(*syms) is not True:
        raise NoRepair(f"the body {sympy.sstr(g)} is not polynomial in {', '.join(map(str, syms))}")
    poly = sympy.Poly(g, *syms)
    monoms = poly.monoms()
    # a pivot that appears with one power only scales the body: expanding it around 0 needs
    # no moments of its own and cannot cancel
    shifted = [len({m[k] for m in monoms}) > 1 for k in range(len(found))]
    degree = max(sum(e for e, sh in zip(m, shifted) if sh) for m in monoms)  # moments grow with it
    if degree > MAX_DEGREE:
        names = ", ".join(str(r) for r, sh in zip(syms, shifted) if sh)
        raise NoRepair(f"the body has degree {degree} in {names} (at most {MAX_DEGREE} expands)")
    accd = dt.float64 if body.dtype == dt.float64 else dt.float32
    shifts = tuple(Var(f"shift_{name}_{k}", accd) if sh else None for k, sh in enumerate(shifted))
    jets = _Jets(producers, {p: k for k, p in enumerate(found)}, shifts, poly.total_degree(), accd)(body)
    # sympy's Taylor coefficient q_α = ∂^α g / α! at the shifts, for the report; a term whose
    # coefficient only cancels structurally in the IR is dropped
    single = len(syms) == 1
    s_syms = [sympy.Symbol("s" if single else f"s_{k}", real=True) for k in range(len(syms))]
    at = {r: (sv if s is not None else 0) for r, sv, s in zip(syms, s_syms, shifts)}
    terms, coefficients = [], []
    for alpha, q in sorted(jets.items(), key=lambda kv: (sum(kv[0]), kv[0])):
        deriv = g
        for r, a in zip(syms, alpha):
            if a:
                deriv = sympy.diff(deriv, r, a)
        q_sym = sympy.factor_terms(deriv.subs(at, simultaneous=True) / math.prod(math.factorial(a) for a in alpha))
        if q_sym != 0:
            terms.append((alpha, q))
            coefficients.append(q_sym)
    text = _describe(name, producers, found, syms, s_syms, shifts, terms, coefficients, opaque)
    return MomentRepair(producers=producers, pivots=tuple(found), shifts=shifts, terms=tuple(terms), dtype=accd,
                        text=text)


def _describe(name, producers, found, syms, s_syms, shifts, terms, coefficients, opaque) -> str:
    """The expansion as reports print it: t = Σ_α δ^α M_α, each moment M_i = Σ_j q_α (n·q_α
    for a coefficient constant along the axis)."""
    single = len(syms) == 1
    d_syms = [sympy.Symbol("d" if single else f"d_{k}", real=True) if s is not None else r
              for k, (r, s) in enumerate(zip(syms, shifts))]
    n = sympy.Symbol("n", positive=True)
    total, defs, count = sympy.Integer(0), [], 0
    for (alpha, q), q_sym in zip(terms, coefficients):
        mono = sympy.Mul(*(d ** a for d, a in zip(d_syms, alpha)))
        if not _reads_axis(q):
            total += mono * n * q_sym
            continue
        m = sympy.Symbol(f"M{count}")
        count += 1
        total += mono * m
        defs.append(f"{m} = Σ {sympy.sstr(q_sym)}")
    where = []
    for r, d, sv, s, p in zip(syms, d_syms, s_syms, shifts, found):
        where.append(f"{r} = {format_expr(p)}")
        if s is not None:
            where.append(f"{d} = {r} - {sv}, {sv} = {r} estimated from the first tile")
    where += [f"{c} = {format_expr(e)}" for e, c in opaque.items()]
    return (f"moment expansion over {', '.join(producers)}: {name} = {sympy.sstr(sympy.factor_terms(total))}"
            + (f"; {'; '.join(defs)}" if defs else "") + f" where {'; '.join(where)}")


__all__ = ["MomentRepair", "derive_moments", "MAX_DEGREE"]
