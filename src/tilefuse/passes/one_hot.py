"""Sums over one-hot rows collapse: Σ_r f(where(r == e, a, 0)) = where(0 ≤ e < R, f(a), 0) + 0·b.

The gradient of a classification loss (`nll_loss`, `cross_entropy`) is one-hot per sample,
`where(class == target, -w, 0)`, and `log_softmax`'s backward sums it over the classes. Summed
as written, that is a pass over every class (50 304 of them for GPT-2's head), a comparison
per element, for a value a single element of the row decides — and a reduction that keeps the
whole backward kernel in two passes over the logits. When the summed term `f(where(r == e, a,
0))` is, with the selection taken, `f(a)` not depending on the summed index r, and, with it not
taken, zero times factors `b` not depending on r (through roundings: autocast's bf16 gradient),
the sum is the selected term, if `e` selects one at all.

The value is eager's: the unselected terms are exact zeros (sums of them change nothing), and
`0·b` keeps the NaN that each of them is when `b` is not finite. The rewrite needs at least two
terms (R ≥ 2) for that NaN to exist in eager too.
"""
from __future__ import annotations

import sympy

from ..ir.expr import Binary, Cast, Const, Expr, Index, Load, Where, binary, cast, const, count_ops, free_symbols, \
    out_index, red_index, transform, walk, where
from ..ir.graph import Graph, Pointwise, Reduce
from ..ir.monoid import SUM
from ..ir.rewrite import substitute_index

MAX_DEPTH = 8  # producers looked through, from the sum's body down
MAX_OPS = 256  # an expanded body larger than this is not searched


def _expanded(graph: Graph, e: Expr, depth: int = 0) -> Expr:
    """`e` with pointwise producers read at plain indices substituted (their own rounding kept)."""
    if depth >= MAX_DEPTH:
        return e

    def fn(n):
        src = _plain_producer(graph, n)
        if src is None:
            return None
        body = substitute_index(src.body, dict(zip(out_index(src.rank), n.index)))
        if body.dtype != src.dtype:
            body = Cast(body, src.dtype)
        return _expanded(graph, body, depth + 1)

    return transform(e, fn)


def _plain_producer(graph: Graph, n: Expr):
    """The pointwise node a load at plain indices reads (what `_expanded` substitutes), or None."""
    if isinstance(n, Load) and all(isinstance(c, Index) for c in n.index):
        src = graph.nodes.get(n.buffer)
        return src if isinstance(src, Pointwise) else None
    return None


def _compares_for_equality(graph: Graph, e: Expr, memo: dict, depth: int = 0) -> bool:
    """Whether `_expanded(graph, e, depth)` would hold an `==` or `!=` (a selection needs one):
    most sums hold none, and are not expanded at all. `memo` answers each (producer, depth)
    once."""
    for n in walk(e):
        if isinstance(n, Binary) and n.op in ("eq", "ne"):
            return True
        src = _plain_producer(graph, n)
        if src is not None and depth < MAX_DEPTH:
            key = (src.name, depth + 1)
            if key not in memo:
                memo[key] = _compares_for_equality(graph, src.body, memo, depth + 1)
            if memo[key]:
                return True
    return False


def _selection(f: Expr, r) -> tuple[Expr, Expr, Expr] | None:
    """(e, chosen, other) when `f` is `where(r == e, chosen, other)` (either side of ==; for !=,
    the branches swap) with e not depending on r."""
    if not isinstance(f, Where) or not isinstance(f.cond, Binary) or f.cond.op not in ("eq", "ne"):
        return None
    chosen, other = (f.a, f.b) if f.cond.op == "eq" else (f.b, f.a)
    for index, e in ((f.cond.a, f.cond.b), (f.cond.b, f.cond.a)):
        if isinstance(index, Index) and index.expr == r and r not in free_symbols(e):
            return e, chosen, other
    return None


def _zero_times(e: Expr) -> list[Expr] | None:
    """The factors b when `e` is 0·b₁·b₂… up to float conversions — exactly zero for finite b,
    NaN otherwise (rounding keeps both) — else None. [] for a plain zero."""
    while isinstance(e, Cast) and e.dtype.is_float and e.x.dtype.is_float:
        e = e.x
    if isinstance(e, Const):
        return [] if e.value == 0 and e.dtype.is_float else None
    if isinstance(e, Binary) and e.op == "mul" and e.dtype.is_float:
        for x, y in ((e.a, e.b), (e.b, e.a)):
            found = _zero_times(x)
            if found is not None:
                return found + [y]
    return None


def _collapsed(node: Reduce, expanded: Expr) -> Expr | None:
    (r,) = red_index(1)
    (extent,) = node.ranges
    extent = sympy.sympify(extent)
    if not (extent.is_Integer and int(extent) >= 2):
        return None
    selections = {n: s for n in walk(expanded) if (s := _selection(n, r)) is not None}
    if len(selections) != 1:
        return None
    ((selector, (e, chosen, other)),) = selections.items()
    picked = transform(expanded, lambda n: chosen if n == selector else None)
    unpicked = transform(expanded, lambda n: other if n == selector else None)
    factors = _zero_times(unpicked)
    if r in free_symbols(picked) or factors is None or any(r in free_symbols(f) for f in factors):
        return None
    acc = expanded.dtype
    in_range = binary("logical_and", binary("ge", e, const(0, e.dtype)), binary("lt", e, const(int(extent), e.dtype)))
    body = where(in_range, picked, const(0.0, acc))
    if factors:  # each unpicked term is 0·b: NaN where b is not finite, as in eager
        nan_or_zero = const(0.0, acc)
        for f in factors:
            nan_or_zero = binary("mul", nan_or_zero, cast(f, acc))
        body = binary("add", body, nan_or_zero)
    return binary("add", body, const(0.0, acc))  # a sum starts from +0: a selected −0 gives +0


def collapse_one_hot_sums(graph: Graph) -> Graph:
    """Rewrite each sum over one index of a one-hot selection into the selected term."""
    rewritten: dict[str, Pointwise] = {}
    compares: dict = {}
    for node in graph.nodes.values():
        if not (isinstance(node, Reduce) and node.combiner == SUM and len(node.ranges) == 1
                and node.body.dtype.is_float and _compares_for_equality(graph, node.body, compares)):
            continue
        expanded = _expanded(graph, node.body)
        if count_ops(expanded, limit=MAX_OPS) > MAX_OPS:
            continue
        body = _collapsed(node, expanded)
        if body is not None:
            rewritten[node.name] = Pointwise(node.name, node.dtype, node.shape, body=cast(body, node.dtype))
    if rewritten:
        graph.nodes = {name: rewritten.get(name, n) for name, n in graph.nodes.items()}
    return graph


__all__ = ["collapse_one_hot_sums"]
