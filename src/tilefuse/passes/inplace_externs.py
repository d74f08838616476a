"""Library scatters into a buffer nothing else reads run in place.

An embedding's gradient is `index_put(zeros, [ids], grads, accumulate=True)`: the functional op
copies the whole zero-filled table before it adds the few rows, and on a CPU at a BERT
vocabulary (30522 × 64 floats) the copy was most of its 1.7 ms. When the buffer the op would
copy is computed by a kernel of this graph (a pointwise or reduction node: its own buffer, not
an input, a constant or another call's result), is read by nothing but this call and is not an
output, the call takes the in-place overload (`index_put_`) instead: the result is that buffer
itself. (The runtime then never gives the buffer's memory to another: an ATen call read it.)
An accumulating call of `row_scatter.ROWS_FROM` values or more (or a number known only at run
time) becomes `tilefuse::index_put_accumulate_` (`frontend.row_scatter`): on a CPU, `index_add_`
along the rows where that is the same sum and faster.
"""
from __future__ import annotations

import sympy
import torch

from ..ir.graph import Extern, Graph, Pointwise, Reduce, TensorArg
from ..frontend.row_scatter import ROWS_FROM, index_put_accumulate_

aten = torch.ops.aten

#: functional library ops whose in-place overload takes the same arguments and returns `self`
IN_PLACE = {aten.index_put.default: aten.index_put_.default}


def scatter_in_place(graph: Graph) -> Graph:
    users = graph.users()
    outputs = set(graph.output_names())
    for name, node in graph.nodes.items():
        if not (isinstance(node, Extern) and node.target in IN_PLACE and node.args):
            continue
        base = node.args[0]
        if not isinstance(base, TensorArg) or base.name not in graph.nodes:
            continue
        src = graph[base.name]
        if not isinstance(src, (Pointwise, Reduce)) or src.name in outputs or users[src.name] != [name]:
            continue
        if src.dtype != node.dtype or tuple(src.shape) != tuple(node.shape) \
                or reads_buffer((node.args[1:], node.kwargs), src.name):
            continue
        if accumulates(node) and not _few_values(graph, node.args[2]):
            node.target, node.args, node.kwargs = index_put_accumulate_, tuple(node.args[:3]), {}
        else:
            node.target = IN_PLACE[node.target]
        node.target_name = str(node.target)
    return graph


def _few_values(graph: Graph, values) -> bool:
    """Values known to be fewer than `row_scatter.ROWS_FROM`: the scatter would be `index_put_`
    anyway, called directly (the op's own test costs a Python call)."""
    if not isinstance(values, TensorArg) or values.name not in graph.nodes:
        return False
    numel = sympy.Mul(*graph[values.name].shape)
    return bool(numel.is_Integer) and int(numel) < ROWS_FROM


def accumulates(node: Extern) -> bool:
    """`index_put(self, indices, values, accumulate)` with accumulate a literal True."""
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    return len(node.args) >= 3 and accumulate is True


def reads_buffer(args, name: str) -> bool:
    """Whether extern arguments (nested lists, tuples and dicts) name the buffer `name`."""
    if isinstance(args, TensorArg):
        return args.name == name
    if isinstance(args, (list, tuple)):
        return any(reads_buffer(a, name) for a in args)
    if isinstance(args, dict):
        return any(reads_buffer(a, name) for a in args.values())
    return False


__all__ = ["scatter_in_place", "IN_PLACE", "accumulates", "reads_buffer"]
