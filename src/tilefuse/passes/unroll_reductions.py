"""Reductions over a handful of elements become pointwise: `Σ_{r<R} f(r)` with R a constant of
at most `UNROLL_MAX` is `f(0) + f(1) + … + f(R−1)`, one node per output element.

A reduction kernel vectorises along its reduced axis; with R = 2 (a top-2 router's weighting
of each token's experts, `einsum("tkd,tk->td")`) its vectors hold two lanes and every output
pays a horizontal sum. Spelt out, the terms are loads at constant offsets of an ordinary
pointwise body: it vectorises along the output, fuses with its producers and consumers as any
pointwise node does, and the graph loses a kernel boundary. Inductor does the same for
reductions of at most 8 elements (`unroll_reductions_threshold`).

Sums of products of two different tensors (matrix products; not a variance's sum of squares)
stop at `PRODUCT_TERMS_MAX` terms: beyond, they stay the contractions that the planner fuses
(an attention's scores with head dim 8). Sums, products, max and min only (the
arg-reductions yield an index, `any`/`all` a truth value), in the body's dtype — the
accumulation dtype the reduction had — and in the order of the range, as a serial loop adds
them.
"""
from __future__ import annotations

import itertools

import sympy

from ..ir.expr import Binary, Cast, Index, buffers_read, cast, red_index
from ..ir.graph import Graph, Pointwise, Reduce
from ..ir.rewrite import substitute_index

#: the most elements a reduction spelt out as pointwise may combine
UNROLL_MAX = 8
#: ... when it sums products of two operands, the most terms: a product over more is a
#: contraction the planner may fuse as one (the scores of attention with head dim 8 feed a
#: flash kernel; MoE's combination of its top-2 experts' outputs is better spelt out)
PRODUCT_TERMS_MAX = 4


def unroll_small_reductions(graph: Graph) -> Graph:
    rewritten: dict[str, Pointwise] = {}
    for node in graph.nodes.values():
        if not isinstance(node, Reduce) or not node.combiner.numeric or not node.combiner.op:
            continue
        extents = [sympy.sympify(r) for r in node.ranges]
        if not extents or not all(e.is_Integer and int(e) >= 1 for e in extents):
            continue
        if sympy.Mul(*extents) > (PRODUCT_TERMS_MAX if _contraction(node) else UNROLL_MAX):
            continue
        symbols = red_index(len(extents))
        body = None
        for point in itertools.product(*(range(int(e)) for e in extents)):
            term = substitute_index(node.body, {s: Index(sympy.Integer(v)) for s, v in zip(symbols, point)})
            body = term if body is None else Binary(node.combiner.op, body, term, node.body.dtype)
        rewritten[node.name] = Pointwise(node.name, node.dtype, node.shape, body=cast(body, node.dtype))
    if rewritten:
        graph.nodes = {name: rewritten.get(name, n) for name, n in graph.nodes.items()}
    return graph


def _contraction(node: Reduce) -> bool:
    """A sum of products of two operands reading different tensors (a matrix product; not a
    sum of squares such as a variance's)."""
    body = node.body
    while isinstance(body, Cast):
        body = body.x
    if node.combiner.op != "add" or not (isinstance(body, Binary) and body.op == "mul"):
        return False
    a, b = buffers_read(body.a), buffers_read(body.b)
    return bool(a) and bool(b) and a != b


__all__ = ["unroll_small_reductions", "UNROLL_MAX", "PRODUCT_TERMS_MAX"]
