"""Which pointwise nodes are inlined into their consumers, and the inlined bodies.

Pointwise chains fuse by substitution: a consumer's load of an inlined producer is replaced
by the producer's body at the loaded index. A pointwise node is *realised* (written to
memory) instead when it is a graph output, an extern reads it, it would be recomputed by a
contraction's inner loop with a costly prologue, or several consumers would recompute a
large body.

The inlined body of each node also loses the index checks that its own index ranges prove
unnecessary (a gather at `arange` positions, or at clamped ones: `ir.bounds`).
"""
from __future__ import annotations

from ..ir.bounds import prune_checks
from ..ir.expr import (Cast, Expr, Load, Unary, count_ops, out_index, red_index, skip_intermediate_rounding, transform,
                       walk)
from ..ir.graph import Extern, ExternResult, Graph, Pointwise, Reduce
from ..ir.rewrite import substitute_index

#: unary ops that cost far more than an add (a contraction prologue of these is realised)
TRANSCENDENTAL = frozenset("exp exp2 log log2 log10 log1p expm1 sin cos tan asin acos atan sinh cosh "
                           "tanh asinh acosh atanh sigmoid erf erfc lgamma pow".split())
MAX_SHARED_OPS = 24  # a body shared by several consumers is recomputed up to this size
MAX_PROLOGUE_OPS = 3  # contraction operand prologues are recomputed once per output tile


def is_contraction_like(node) -> bool:
    from ..ir.expr import Binary

    return isinstance(node, Reduce) and node.combiner == "sum" and isinstance(node.body, Binary) and node.body.op == "mul"


def _costly(body: Expr) -> bool:
    return any(isinstance(e, Unary) and e.op in TRANSCENDENTAL for e in walk(body))


class Inliner:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.users = graph.users()
        self.inlined: set[str] = set()
        self.reasons: dict[str, str] = {}
        self._bodies: dict[str, Expr] = {}
        self._rounded: dict[str, Expr] = {}  # bodies whose explicit narrowing conversions are still loads
        outputs = set(graph.output_names())
        extern_read = set()
        for n in graph.nodes.values():
            if isinstance(n, (Extern, ExternResult)):
                extern_read |= n.inputs()
        for node in graph.nodes.values():
            if not isinstance(node, Pointwise):
                continue
            body = self.body(node.name)
            users = self.users[node.name]
            if node.name in outputs:
                self.reasons[node.name] = "graph output"
            elif node.name in extern_read:
                self.reasons[node.name] = "read by an extern call"
            elif any(is_contraction_like(self.graph[u]) for u in users) and (
                    count_ops(body) > MAX_PROLOGUE_OPS or _costly(body)):
                self.reasons[node.name] = "costly prologue of a contraction: computed once, in its producer's kernel"
            elif len(users) > 1 and count_ops(body) > MAX_SHARED_OPS:
                self.reasons[node.name] = f"{len(users)} consumers would recompute {count_ops(body)} ops"
            elif not users:
                self.reasons[node.name] = "unused"
            else:
                self.inlined.add(node.name)

    def body(self, name: str) -> Expr:
        """The node's body with every inlined producer substituted."""
        if name in self._bodies:
            return self._bodies[name]

        def fn(e):
            if isinstance(e, Load) and e.buffer in self.inlined:  # only explicit conversions are left
                mapping = dict(zip(out_index(self.graph[e.buffer].rank), e.index))
                return substitute_index(self.body(e.buffer), mapping)
            return None

        body = transform(self._with_rounding(name), fn)
        out = self._bodies[name] = prune_checks(body, _index_ranges(self.graph[name]))
        return out

    def _with_rounding(self, name: str) -> Expr:
        """The inlined body before explicit narrowing conversions (`x.to(bfloat16)`) are
        substituted: they stay loads while `skip_intermediate_rounding` runs, because their
        rounding is what they are for (fake quantisation, overflow checks); only the rounding
        an op applies to its own result is skipped between fused ops."""
        if name in self._rounded:
            return self._rounded[name]
        node = self.graph[name]

        def fn(e):
            if isinstance(e, Load) and e.buffer in self.inlined and not _narrowing_conversion(self.graph[e.buffer]):
                producer = self.graph[e.buffer]
                mapping = dict(zip(out_index(producer.rank), e.index))
                return substitute_index(self._with_rounding(e.buffer), mapping)
            return None

        out = transform(node.body, fn)
        if out is not node.body:
            out = skip_intermediate_rounding(out)
        self._rounded[name] = out
        return out


def _index_ranges(node) -> dict:
    """Each index symbol of the node's body -> its extent (for the checks `prune_checks` drops:
    an index built from these is in range for every element)."""
    ranges = dict(zip(out_index(node.rank), node.shape))
    if isinstance(node, Reduce):
        ranges.update(zip(red_index(len(node.ranges)), node.ranges))
    return ranges


def _narrowing_conversion(node) -> bool:
    """A node that only converts a wider float to bfloat16/float16: `x.to(dtype)`."""
    body = node.body
    return (isinstance(node, Pointwise) and isinstance(body, Cast) and body.dtype.is_low_precision
            and isinstance(body.x, Load) and body.x.dtype.is_float and not body.x.dtype.is_low_precision)
