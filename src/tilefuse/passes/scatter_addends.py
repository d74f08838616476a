"""A sum whose term is a scatter into zeros is a scatter into the other term:
`index_put(zeros, I, V, accumulate=True) + X` becomes `index_put(X, I, V, accumulate=True)`.

A tied embedding's gradient is spelt so: the input embedding's gradient, scattered into a
zero-filled table, added to the output projection's (a product). As written, the table is
filled with zeros, scattered into, then read again with the product's result and a third
table written: at BERT's 30522 × 64 on a CPU, a fill and a pass over three tables for nothing.
Scattered into the product's result instead — in place, by `passes.inplace_externs`, when
nothing else reads it — the sum costs the scatter alone.

The rewrite needs the sum to be exactly `a + b` of the two whole tensors (same shape and dtype,
no broadcast, no cast) and nothing else to read the scatter. The result differs from eager's
only in the order of the additions (the product's value first, then the scattered rows).
"""
from __future__ import annotations

import torch

from ..ir.expr import Binary, Const, Index, Load, out_index
from ..ir.graph import Extern, Graph, Pointwise, TensorArg
from ..ir.origin import merge_into
from .inplace_externs import accumulates, reads_buffer

aten = torch.ops.aten


def scatter_into_addends(graph: Graph) -> Graph:
    users = graph.users()
    outputs = set(graph.output_names())
    for name, node in list(graph.nodes.items()):
        terms = _whole_sum(node)
        if terms is None:
            continue
        for scattered, other in (terms, terms[::-1]):
            scatter = graph.nodes.get(scattered)
            if _scatter_into_zeros(graph, scatter, node, users, outputs) and scattered not in outputs \
                    and users[scattered] == [name] and other in graph.nodes and other != scattered \
                    and _same_type(graph[other], node):
                _take_place(graph, scatter, node, other)
                users = graph.users()
                break
    return graph


def _whole_sum(node) -> tuple[str, str] | None:
    """(a, b) when `node` is `a + b` of two buffers read whole at its own index."""
    if not isinstance(node, Pointwise):
        return None
    body = node.body
    if not (isinstance(body, Binary) and body.op == "add" and body.dtype == node.dtype):
        return None
    index = tuple(Index(s) for s in out_index(node.rank))
    loads = (body.a, body.b)
    if not all(isinstance(x, Load) and x.index == index and x.dtype == node.dtype for x in loads):
        return None
    return body.a.buffer, body.b.buffer


def _scatter_into_zeros(graph: Graph, scatter, node, users, outputs) -> bool:
    """Whether `scatter` accumulates into a zero fill that it alone reads, once, as its base."""
    if not (isinstance(scatter, Extern) and scatter.target is aten.index_put.default and accumulates(scatter)):
        return False
    base = scatter.args[0]
    if not isinstance(base, TensorArg) or not _same_type(scatter, node):
        return False
    zeros = graph.nodes.get(base.name)
    return (isinstance(zeros, Pointwise) and isinstance(zeros.body, Const) and zeros.body.value == 0
            and _same_type(zeros, node) and users[zeros.name] == [scatter.name] and zeros.name not in outputs
            and not reads_buffer((scatter.args[1:], scatter.kwargs), zeros.name))  # (CSE may share one fill)


def _same_type(a, b) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)


def _take_place(graph: Graph, scatter: Extern, node: Pointwise, other: str) -> None:
    """The scatter, into `other`, computes `node` (under its name, where it stood, in the
    layout promised for it: an output's or a saved activation's traced strides)."""
    zeros = scatter.args[0].name
    scatter.args = (TensorArg(other),) + tuple(scatter.args[1:])
    merge_into(graph, node.name, scatter.name)
    old = scatter.name
    scatter.name = node.name
    if node.name in graph.output_strides:
        scatter.strides = tuple(graph.output_strides[node.name])
    for gone in (old, zeros):
        graph.origins.pop(gone, None)
    graph.expand_nodes({old: [], zeros: [], node.name: [scatter]})  # (the zero fill has no other reader)


__all__ = ["scatter_into_addends"]
