"""Storage order of the buffers that kernels pass between them.

A buffer written by one kernel and read by others is free to take any layout: the graph
fixes the strides only of inputs and outputs. Row-major is the default; it is changed when
a consumer reads the buffer through index division (`floor`, `Mod`) that another order of
the dimensions removes. The attention output `o[b, h, s, d]` that the output projection
reads as `o[b, ⌊k/D⌋, s, k mod D]` (the transpose-and-reshape of multi-head attention) is
the common case: stored in (b, s, h, d) order, the projection reads one affine row
`s·H·D + k`, a plain matrix that tensor-descriptor loads can describe.

Candidates keep the innermost dimension innermost, so the producing kernel still stores
contiguous runs; the order with the fewest divisions over all consumer loads wins, row-major
on ties. Chosen layouts go into `graph.output_strides`, which every later layer honours.
"""
from __future__ import annotations

import itertools

import sympy

from ..ir.expr import Index, Load, out_index, red_index, walk
from ..ir.graph import Extern, ExternResult, Graph, Pointwise, Reduce, Scatter
from ..ir.symbolic import simplify_index
from .plan import GraphPlan

MAX_RANK = 5  # at most 4! candidate orders of the outer dims


def strides_for(shape, order) -> tuple:
    """Contiguous strides of `shape` stored in `order` (outermost dim first)."""
    strides = [sympy.Integer(0)] * len(shape)
    acc = sympy.Integer(1)
    for d in reversed(order):
        strides[d] = acc
        acc = acc * sympy.sympify(shape[d])
    return tuple(strides)


def _divisions(expr) -> int:
    return sum(1 for a in sympy.preorder_traversal(expr) if isinstance(a, (sympy.floor, sympy.Mod)))


def _consumer_loads(graph: Graph, schedule: GraphPlan) -> dict:
    """buffer -> [(load, ranges of the reading stage's index symbols)] over every kernel that
    reads it (not the kernel that writes it)."""
    found: dict = {}
    for plan in schedule.kernels:
        written = set(plan.stores)
        for st in plan.stages:
            node = graph[st.node]
            space = node.space if isinstance(node, Scatter) else node.shape  # a scatter's index runs over its values
            ranges = dict(zip(out_index(len(space)), (sympy.sympify(d) for d in space)))
            if isinstance(node, Reduce):
                ranges.update(zip(red_index(len(node.ranges)), (sympy.sympify(d) for d in node.ranges)))
            for expr in (st.body, *(st.scatter[1] if st.scatter else ())):
                for e in walk(expr):
                    if isinstance(e, Load) and e.buffer not in written:
                        found.setdefault(e.buffer, []).append((e, ranges))
    return found


def _candidates(graph: Graph, schedule: GraphPlan) -> set:
    """Buffers whose layout is ours to choose: computed by a generated kernel, not a graph
    output, not handed to an ATen call, no layout fixed yet."""
    stored = {name for plan in schedule.kernels for name in plan.stores}
    fixed = set(graph.output_names()) | set(graph.output_strides)
    for n in graph.nodes.values():
        if isinstance(n, (Extern, ExternResult)):
            fixed |= n.inputs()
    return {name for name in stored - fixed
            if isinstance(graph[name], (Pointwise, Reduce)) and 2 <= graph[name].rank <= MAX_RANK}


def _cost(loads, strides) -> int:
    total = 0
    for load, ranges in loads:
        if not all(isinstance(c, Index) for c in load.index):
            continue
        off = sum((c.expr * st for c, st in zip(load.index, strides)), sympy.Integer(0))
        total += _divisions(simplify_index(sympy.expand(off), ranges))
    return total


def assign_layouts(graph: Graph, schedule: GraphPlan) -> None:
    """Choose the storage order of every intermediate buffer whose consumers divide indices."""
    loads = _consumer_loads(graph, schedule)
    for name in sorted(_candidates(graph, schedule)):
        reads = loads.get(name)
        if not reads:
            continue
        shape = graph[name].shape
        rank = len(shape)
        row_major = tuple(range(rank))
        best, best_cost = row_major, _cost(reads, strides_for(shape, row_major))
        if best_cost == 0:
            continue
        for outer in itertools.permutations(range(rank - 1)):
            order = (*outer, rank - 1)
            cost = _cost(reads, strides_for(shape, order))
            if cost < best_cost:
                best, best_cost = order, cost
        if best != row_major:
            graph.output_strides[name] = strides_for(shape, best)
            dims = ", ".join(f"d{d}" for d in best)
            schedule.decisions.append(f"{name}: stored in ({dims}) order: its consumers read it with "
                                      f"{best_cost} index divisions instead of "
                                      f"{_cost(reads, strides_for(shape, row_major))}")


__all__ = ["assign_layouts", "strides_for"]
