"""Which running maxima of a flash plan may give the loop's terms a finite base while a row has
seen only -inf (`finite_bases`).

A flash loop computes each term against the running max: `exp(s - m)`. A row whose scores so far
are all -inf (masked) has m = -inf, and its terms are exp(-inf - -inf) = NaN. The re-basing then
has to drop such a partial sum by a select on every element of the accumulator when the row's
first live score arrives, since NaN·0 is NaN; that select costs a hand-written kernel's worth of
instructions per key tile. FlashAttention instead computes the terms against 0 while m is -inf:
exp(-inf - 0) = 0, the partial sums stay finite (zero), and the re-basing is one product by a
per-row factor.

That is sound for a max `m` when every term the loop computes from m — each repaired sum's
body and the product's weights and values — is a function E(x, m, c..) of the max's own body
x and data c.. such that
  * E(-inf, 0, c..) = 0 for finite c..: in a row whose x are all -inf the shifted terms vanish,
    so the partial sums are what re-basing them onto any later max gives (zero);
  * E(-inf, -inf, c..) is NaN: a row that sees no finite score to the end is NaN in the
    program as written, and the loop restores exactly that after its last tile.
Both are checked symbolically (sympy) on the plan's expressions; a max whose terms read the
data in any other way keeps the select."""
from __future__ import annotations

import functools

import sympy

from ..ir.expr import Expr, Load, walk
from ..ir.monoid import MAX, MIN
from .plan import StageKind
from .repair import NoRepair, _reads_producer, _to_sympy

_M = sympy.Symbol("m", real=True)


def finite_bases(graph, plan) -> frozenset:
    """The max (or min) reductions of flash plan `plan` whose running value the loop's terms
    may read as 0 while it is still the identity (see the module's docstring)."""
    info = plan.flash
    reduces = [st for st in plan.stages if st.kind == StageKind.REDUCE]
    evaluated = [st.body for st in reduces]
    evaluated.append(info.a * info.b)
    evaluated.extend(x for sib in info.siblings for x in (sib.a, sib.b))
    out = set()
    for st in reduces:
        combiner = graph[st.node].combiner
        if combiner not in (MAX, MIN) or not graph[st.node].dtype.is_float:
            continue
        readers = [e for e in evaluated if e is not st.body and _reads_producer(e, st.node)]
        if readers and all(_vanishes(e, st.node, st.body, combiner == MAX) for e in readers):
            out.add(st.node)
    return frozenset(out)


@functools.lru_cache(maxsize=512)
def _vanishes(e: Expr, node: str, body: Expr, is_max: bool) -> bool:
    loads = {n for n in walk(e) if isinstance(n, Load) and n.buffer == node}
    if len(loads) != 1:  # (two different reads of the running value: not one row's base)
        return False
    opaque: dict = {}
    try:
        g = _to_sympy(e, (node,), {loads.pop(): _M}, opaque)
    except NoRepair:
        return False
    x = opaque.get(body)
    if x is None:  # the terms do not read the max's own scores as a whole
        return False
    ident = -sympy.oo if is_max else sympy.oo
    # (xreplace puts both values in at once: `subs` in turn would take exp(c - m) at m = -inf
    # to exp(+inf) before c is -inf)
    dead = g.xreplace({x: ident, _M: sympy.Integer(0)})
    undefined = g.xreplace({x: ident, _M: ident})
    return dead == 0 and undefined is sympy.nan
