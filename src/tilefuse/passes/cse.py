"""Common-subexpression elimination across nodes: two Pointwise or Reduce nodes with the same
shape, dtype and body (after renaming earlier duplicates) become one, which keeps the origins
of both. Every later reader of a removed duplicate reads the survivor: bodies, a scatter's
index components and body, an extern's tensor arguments."""
from __future__ import annotations

from ..ir.expr import Load, transform
from ..ir.graph import Graph, Pointwise, Reduce, Scatter
from ..ir.origin import merge_into


def _key(node):
    if isinstance(node, Pointwise):
        return ("pw", node.dtype, tuple(node.shape), node.body)
    if isinstance(node, Reduce):
        return ("red", node.dtype, tuple(node.shape), tuple(node.ranges), node.combiner, node.body)
    return None


def eliminate_common_subexpressions(graph: Graph) -> Graph:
    seen: dict = {}
    rename: dict[str, str] = {}

    def fix(e):
        if isinstance(e, Load) and e.buffer in rename:
            return Load(rename[e.buffer], e.index, e.dtype)
        return None

    outputs = set(graph.output_names())
    for name, node in list(graph.nodes.items()):
        if isinstance(node, (Pointwise, Reduce)):
            if rename:
                node.body = transform(node.body, fix)
            key = _key(node)
            if key in seen and name not in outputs:
                rename[name] = seen[key]
                merge_into(graph, seen[key], name)  # the survivor computes both ops now
                del graph.nodes[name]
            else:
                seen.setdefault(key, name)
        elif rename and isinstance(node, Scatter):  # (a KV-cache write at a position computed twice)
            node.body = transform(node.body, fix)
            node.index = tuple(transform(c, fix) for c in node.index)
        elif rename and hasattr(node, "args"):
            from ..ir.graph import TensorArg

            def conv(a):
                if isinstance(a, TensorArg) and a.name in rename:
                    return TensorArg(rename[a.name])
                if isinstance(a, (list, tuple)):
                    return type(a)(conv(x) for x in a)
                if isinstance(a, dict):
                    return {k: conv(v) for k, v in a.items()}
                return a

            node.args = conv(node.args)
            node.kwargs = conv(node.kwargs)
    return graph
