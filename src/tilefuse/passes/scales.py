"""Constant scale factors out of sums of products: Σ (x·c)·y = c·Σ x·y.

PyTorch's math attention scales q and k by √s each before their product; users write
`(q * s) @ k.T`. Materialised, each scaled operand is a new fp32 tensor, and a bf16 product
loses its tensor cores (its operands are no longer exact upcasts of bf16 values). This pass
reads the unscaled factor in the sum and multiplies its result by the constants instead, so
the contraction reads the original (low-precision) operands. The value is the same up to
fp32 rounding.

Only cheap factors are rewritten — a scale of a load, possibly cast — so that inlining them
into the sum duplicates no work; the scaled tensor itself stays where other nodes read it.
"""
from __future__ import annotations

from ..ir import dtypes as dt
from ..ir.expr import Binary, Cast, Const, Expr, Index, Load, binary, cast, const, out_index
from ..ir.graph import Graph, Pointwise, Reduce
from ..ir.monoid import SUM
from ..ir.rewrite import substitute_index


def _scale_of(body: Expr) -> tuple[Expr, float] | None:
    """(x, c) for a body `x·c`, `c·x` or `x/c` with a finite, non-zero float constant c and x a
    (cast) load."""
    if not (isinstance(body, Binary) and body.dtype.is_float):
        return None
    pairs = []
    if body.op == "mul":
        pairs = [(body.a, body.b, False), (body.b, body.a, False)]
    elif body.op == "truediv":
        pairs = [(body.a, body.b, True)]
    for x, c, divide in pairs:
        if not isinstance(c, Const) or c.value == "nan" or not _cheap(x) or x.dtype != body.dtype:
            continue
        v = float(c.value)
        if v in (0.0, float("inf"), float("-inf")):
            continue
        return x, (1.0 / v if divide else v)
    return None


def _cheap(x: Expr) -> bool:
    while isinstance(x, Cast):
        x = x.x
    return isinstance(x, Load) and all(isinstance(c, Index) for c in x.index)


def _factors(e: Expr) -> list[Expr]:
    if isinstance(e, Binary) and e.op == "mul" and e.dtype.is_float:
        return _factors(e.a) + _factors(e.b)
    return [e]


def _unscaled(graph: Graph, factor: Expr) -> tuple[Expr, float] | None:
    """A factor `P[idx]` (possibly cast to the accumulation dtype) where P = x·c: returns
    (x at idx, c)."""
    outer = None
    if isinstance(factor, Cast) and factor.x.dtype.is_float and factor.dtype.is_float:
        outer, factor = factor.dtype, factor.x
    if not isinstance(factor, Load) or not all(isinstance(c, Index) for c in factor.index):
        return None
    node = graph.nodes.get(factor.buffer)
    if not isinstance(node, Pointwise) or node.dtype != dt.float32:
        return None  # a rounded (bf16) scaled tensor is not the same value as its scale
    found = _scale_of(node.body)
    if found is None:
        return None
    x, c = found
    x = substitute_index(x, dict(zip(out_index(node.rank), factor.index)))
    return (cast(x, outer) if outer is not None else x), c


def hoist_scales(graph: Graph) -> Graph:
    """Rewrite each sum of products whose factors are constant scales of loads."""
    rewritten: dict[str, list] = {}
    taken: set[str] = set()
    for node in list(graph.nodes.values()):
        if not (isinstance(node, Reduce) and node.combiner == SUM and node.body.dtype.is_float):
            continue
        factors = _factors(node.body)
        if len(factors) < 2:
            continue
        scale, changed = 1.0, False
        for k, f in enumerate(factors):
            found = _unscaled(graph, f)
            if found is not None:
                factors[k], c = found
                scale *= c
                changed = True
        if not changed:
            continue
        acc = node.body.dtype
        body = factors[0]
        for f in factors[1:]:
            body = binary("mul", body, f)
        name = graph.fresh_name("buf")
        while name in taken:
            name = f"{name}_"
        taken.add(name)
        raw = Reduce(name, acc, node.shape, ranges=node.ranges, combiner=SUM, body=body)
        index = tuple(Index(s) for s in out_index(node.rank))
        scaled = Pointwise(node.name, node.dtype, node.shape,
                           body=cast(binary("mul", Load(raw.name, index, acc), const(scale, acc)), node.dtype))
        rewritten[node.name] = [raw, scaled]
    graph.expand_nodes(rewritten)  # (both halves come from the node's ops)
    return graph


__all__ = ["hoist_scales"]
