"""Constant folding inside expressions: arithmetic on constants, identities (x*1, x+0),
casts of constants, and `where` with a constant condition."""
from __future__ import annotations

import math

from ..ir.expr import Binary, Cast, Const, Unary, Where, cast, const, transform
from ..ir.graph import Graph, Pointwise, Reduce

_FOLD = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "maximum": max, "minimum": min,
}


def _value(c: Const):
    return float("nan") if c.value == "nan" else c.value


def fold_expr(e):
    def fn(node):
        if isinstance(node, Binary):
            a, b = node.a, node.b
            if isinstance(a, Const) and isinstance(b, Const) and node.op in _FOLD:
                v = _FOLD[node.op](_value(a), _value(b))
                if not (isinstance(v, float) and (math.isnan(v) or math.isinf(v))):
                    return const(v, node.dtype)
            if node.op == "mul":
                for x, y in ((a, b), (b, a)):
                    if isinstance(y, Const) and y.value == 1 and x.dtype == node.dtype:
                        return x
            if node.op in ("add", "sub"):
                if isinstance(b, Const) and b.value == 0 and a.dtype == node.dtype and not a.dtype.is_float:
                    return a
            return None
        if isinstance(node, Cast) and isinstance(node.x, Const):
            return cast(node.x, node.dtype)
        if isinstance(node, Cast) and node.x.dtype == node.dtype:
            return node.x
        if isinstance(node, Where) and isinstance(node.cond, Const):
            return node.a if node.cond.value else node.b
        if isinstance(node, Unary) and node.op == "neg" and isinstance(node.x, Const) and node.x.value != "nan":
            return const(-node.x.value, node.dtype)
        return None

    return transform(e, fn)


def fold_constants(graph: Graph) -> Graph:
    for node in graph.nodes.values():
        if isinstance(node, (Pointwise, Reduce)):
            node.body = fold_expr(node.body)
    return graph
