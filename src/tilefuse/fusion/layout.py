"""Storage order of the buffers that kernels pass between them.

A buffer written by one kernel and read by others is free to take any layout: the graph
fixes the strides only of inputs and outputs. Row-major is the default; it is changed when
a consumer reads the buffer through index division (`floor`, `Mod`) that another order of
the dimensions removes. The attention output `o[b, h, s, d]` that the output projection
reads as `o[b, ⌊k/D⌋, s, k mod D]` (the transpose-and-reshape of multi-head attention) is
the common case: stored in (b, s, h, d) order, the projection reads one affine row
`s·H·D + k`, a plain matrix that tensor-descriptor loads can describe.

Candidates keep the innermost dimension innermost, so the producing kernel still stores
contiguous runs — or, for a flash kernel's product, put its held dimension innermost, the
columns of the tiles it stores (dKᵀ is [batch, d, keys] but computed as [keys, d] tiles; the
`cat` of the qkv gradient reads it along d). The order with the fewest divisions over all
consumer loads wins, then the one whose consumers read along their innermost index at unit
stride (coalesced) most often, row-major on ties. Chosen layouts go into
`graph.output_strides`, which every later layer honours.

Before that, an elementwise result takes the storage order of the tensors it is computed from,
as eager PyTorch's elementwise ops do (`TensorIterator`): BatchNorm and ReLU over a
channels-last convolution's output store channels-last, so the next convolution gets the
layout it wants and no copy is made on either side. The orders come from the graph's inputs'
strides and from the strides ATen calls returned when traced (`Extern.strides`); the pointwise
kernel then iterates in its output's storage order (`storage_order`), so it reads and writes
contiguous runs.
"""
from __future__ import annotations

import itertools

import sympy

from ..ir.expr import Index, Load, out_index, red_index, walk
from ..ir.graph import Constant, Extern, ExternResult, Graph, Input, Pointwise, Reduce, Scatter
from ..ir.storage import storage_order, strides_for
from ..ir.symbolic import simplify_index
from .plan import GraphPlan, PlanKind

MAX_RANK = 5  # at most 4! candidate orders of the outer dims


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


def _cost(loads, strides, bound=None) -> tuple[int, int]:
    """(index divisions, loads not at unit stride along their reader's innermost index). With
    `bound`, the count stops once it is known not to beat it (the result is then only known
    not to be below `bound`)."""
    divisions = strided = 0
    for load, ranges in loads:
        if not all(isinstance(c, Index) for c in load.index):
            continue
        off = sympy.expand(sum((c.expr * st for c, st in zip(load.index, strides)), sympy.Integer(0)))
        if _divisions(off):  # (simplifying removes divisions, never adds them)
            divisions += _divisions(simplify_index(off, ranges))
        strided += not _unit_stride(off, ranges)
        if bound is not None and divisions > bound[0]:
            break
    return divisions, strided


def _unit_stride(offset, ranges: dict) -> bool:
    """Whether the next element along the reader's innermost index (its last output index
    with an extent above 1) is the next in memory, at the origin of every other index."""
    inner = [s for s in out_index(len(ranges)) if s in ranges and sympy.sympify(ranges[s]) != 1]
    inner = [s for s in inner if s in offset.free_symbols]
    if not inner:
        return True
    origin = {s: 0 for s in ranges}  # (index symbols only: a symbolic size may divide)
    try:
        step = offset.xreplace({**origin, inner[-1]: 1}) - offset.xreplace(origin)  # (xreplace: subs is slow)
    except (ZeroDivisionError, TypeError):
        return True  # (undecided: no preference)
    return step == 1


def _held_dim(graph: Graph, plan, name: str) -> int | None:
    """The dim of `name` that its flash kernel stores along its tiles' columns: the product's
    held dim (a sibling product's, or an epilogue's of the same shape), else None."""
    if plan is None or plan.kind != PlanKind.FLASH or plan.contraction is None:
        return None
    info, con = plan.flash, plan.contraction
    o_node = graph[plan.contraction_stage.node]
    anchors = {o_node.name: con.n_dim}
    held_sym = out_index(o_node.rank)[con.n_dim]
    for sib in getattr(info, "siblings", ()):
        dims = [d for d, e in enumerate(sib.index) if sympy.sympify(e) == held_sym]
        if len(dims) == 1:
            anchors[sib.node] = dims[0]
    if name in anchors:
        return anchors[name]
    same_shape = [a for a in anchors if tuple(graph[a].shape) == tuple(graph[name].shape)]
    if len(same_shape) == 1 and any(st.node == name for st in plan.stages):
        return anchors[same_shape[0]]  # (an epilogue is stored at its product's index)
    return None


# ATen calls that read their argument's storage or need a viewable layout: a buffer they read
# keeps the contiguous layout the graph was traced with
_LAYOUT_BOUND_EXTERNS = frozenset({"as_strided", "as_strided_scatter", "as_strided_copy", "view", "_unsafe_view",
                                   "view_as_real", "view_as_complex", "set_", "_reshape_alias"})


def _known_order(graph: Graph, name: str) -> tuple | None:
    """The storage order of a buffer as far as it is known at compile time."""
    node = graph[name]
    if name in graph.output_strides:
        return storage_order(node.shape, graph.output_strides[name])
    if isinstance(node, (Input, Extern, ExternResult)):
        return storage_order(node.shape, node.strides)
    if isinstance(node, Constant) and hasattr(node.value, "stride"):
        return storage_order(node.shape, node.value.stride())
    return tuple(range(node.rank))  # generated, not chosen yet: row-major


def _elementwise_reads(body, rank: int, graph: Graph):
    """(buffer, dim map) for each load of `body` that reads a buffer of the output's rank with
    each of the buffer's dims indexed by one distinct output dim (a plain read, or a
    permuted/strided view of one): dim map[buffer dim] = output dim, None for dims of extent 1."""
    symbols = out_index(rank)
    for e in walk(body):
        if not isinstance(e, Load) or graph[e.buffer].rank != rank or not all(isinstance(c, Index) for c in e.index):
            continue
        dims, ok = [], True
        for c, n in zip(e.index, graph[e.buffer].shape):
            free = sympy.sympify(c.expr).free_symbols
            used = [k for k, sym in enumerate(symbols) if sym in free]
            if sympy.sympify(n) == 1:
                dims.append(None)
            elif len(used) == 1 and used[0] not in dims:
                dims.append(used[0])
            else:
                ok = False
                break
        if ok:
            yield e.buffer, dims


def _known_strides(graph: Graph, name: str) -> tuple | None:
    """The element strides of a buffer as far as they are known at compile time."""
    node = graph[name]
    if name in graph.output_strides:
        return tuple(graph.output_strides[name])
    if isinstance(node, (Input, Extern, ExternResult)):
        return tuple(node.strides) if node.strides is not None else None
    if isinstance(node, Constant):
        return tuple(node.value.stride()) if hasattr(node.value, "stride") else None
    return strides_for(node.shape, tuple(range(node.rank)))  # generated, not chosen yet: row-major


def _reshaped_read_orders(body, shape, graph: Graph):
    """For each load of `body` from a buffer of another rank (a reshape, often with a
    transpose: the gradient of `o.transpose(1, 2).reshape(B, S, H·D)` read back as
    [B, H, S, D]) whose position in the buffer's storage is affine in the output's indices: the
    output's dims in the order that storage runs through them."""
    symbols = out_index(len(shape))
    for e in walk(body):
        if (not isinstance(e, Load) or graph[e.buffer].rank == len(shape)
                or not all(isinstance(c, Index) for c in e.index)):
            continue
        strides = _known_strides(graph, e.buffer)
        if strides is None or len(strides) != len(e.index):
            continue
        offset = sympy.expand(sum((sympy.sympify(st) * sympy.sympify(c.expr) for st, c in zip(strides, e.index)),
                                  sympy.Integer(0)))
        if offset.has(sympy.floor, sympy.Mod, sympy.ceiling):
            continue
        coefs = [offset.coeff(sym) for sym in symbols]
        rest = sympy.expand(offset - sum((c * sym for c, sym in zip(coefs, symbols)), sympy.Integer(0)))
        if rest.free_symbols & set(symbols) or any(c.free_symbols & set(symbols) for c in coefs):
            continue
        order = storage_order(shape, [abs(c) for c in coefs])  # (a flipped dim runs backwards, in its place)
        if order is not None:
            yield order


def _inherited_order(graph: Graph, body, shape, reshaped: bool = False) -> tuple | None:
    """The storage order an elementwise result takes from what it reads: each read that spans
    every dim of the output votes for its buffer's order carried over to the output's dims
    (a broadcast operand, BatchNorm's per-channel scale, has no say), and with `reshaped` so
    does a reshaped read, for the order in which it runs through its buffer's storage; most
    votes win, the first read's order on ties (eager's `TensorIterator` follows its first
    operand the same way)."""
    rank = len(shape)
    votes: dict = {}
    for buffer, dims in _elementwise_reads(body, rank, graph):
        order = _known_order(graph, buffer)
        if order is None:
            continue
        carried = [dims[d] for d in order if dims[d] is not None]
        missing = [k for k in range(rank) if k not in carried]
        if any(sympy.sympify(shape[k]) != 1 for k in missing):
            continue
        for k in missing:  # dims of extent 1: beside their logical neighbour
            carried.insert(carried.index(k - 1) + 1 if k else 0, k)
        votes[tuple(carried)] = votes.get(tuple(carried), 0) + 1
    for order in _reshaped_read_orders(body, shape, graph) if reshaped else ():
        votes[tuple(order)] = votes.get(tuple(order), 0) + 1
    if not votes:
        return None
    return max(votes, key=votes.get)  # (dicts keep insertion order: the first read wins ties)


def follow_input_layouts(graph: Graph, schedule: GraphPlan) -> None:
    """Store each elementwise intermediate in the storage order of the tensors it is computed
    from, in graph order so that orders carry along chains of kernels. A reshaped read counts
    only for a buffer that only ATen calls read (the gradient of an attention's output,
    reshaped back from its projection's product, handed to cuDNN's backward, which copies a
    gradient not laid out as the output is): one a generated kernel reads is left to the
    choice below, by that kernel's reads (with q and k after RoPE stored (b, s, h, d) for the
    flash kernel, HF Llama's inference took 9.64 ms instead of 6.97 on an H100)."""
    extern_readers: dict = {}
    for n in graph.nodes.values():
        if isinstance(n, Extern):
            op = str(n.target_name).split(".")
            for name in n.inputs():
                extern_readers.setdefault(name, set()).add(op[1] if len(op) > 1 else op[0])
    outputs = set(graph.output_names())
    users = graph.users()
    for plan in schedule.kernels:
        if plan.kind != PlanKind.POINTWISE:
            continue
        for st in plan.stages:
            name = st.node
            node = graph[name]
            if (not st.store or not isinstance(node, Pointwise) or name in outputs or name in graph.output_strides
                    or not 2 <= node.rank or extern_readers.get(name, set()) & _LAYOUT_BOUND_EXTERNS):
                continue
            only_aten = name in extern_readers and all(isinstance(graph[u], Extern) for u in users[name])
            order = _inherited_order(graph, st.body, node.shape, reshaped=only_aten)
            if order is None or order == tuple(range(node.rank)):
                continue
            graph.output_strides[name] = strides_for(node.shape, order)
            dims = ", ".join(f"d{d}" for d in order)
            schedule.decisions.append(f"{name}: stored in ({dims}) order, the order of the tensors it is "
                                      f"computed from (as eager does)")


def assign_layouts(graph: Graph, schedule: GraphPlan) -> None:
    """Choose the storage order of every intermediate buffer: elementwise results follow their
    inputs' order; buffers whose consumers divide indices take the order that removes the
    divisions."""
    follow_input_layouts(graph, schedule)
    loads = _consumer_loads(graph, schedule)
    producer = {name: plan for plan in schedule.kernels for name in plan.stores}
    for name in sorted(_candidates(graph, schedule)):
        reads = loads.get(name)
        if not reads:
            continue
        shape = graph[name].shape
        rank = len(shape)
        row_major = tuple(range(rank))
        best, best_cost = row_major, _cost(reads, strides_for(shape, row_major))
        innermost = [rank - 1]
        held = _held_dim(graph, producer.get(name), name)
        if held is not None and held != rank - 1:
            innermost.append(held)
        if best_cost == (0, 0) or (best_cost[0] == 0 and len(innermost) == 1):
            continue  # (with the innermost dim kept, strided reads stay strided: not worth the search)
        for last in innermost:
            for outer in itertools.permutations([d for d in range(rank) if d != last]):
                if best_cost == (0, 0):
                    break  # (nothing beats it: the first order to reach it wins)
                order = (*outer, last)
                cost = _cost(reads, strides_for(shape, order), best_cost)
                if cost < best_cost:
                    best, best_cost = order, cost
        if best != row_major:
            graph.output_strides[name] = strides_for(shape, best)
            dims = ", ".join(f"d{d}" for d in best)
            before = _cost(reads, strides_for(shape, row_major))
            schedule.decisions.append(f"{name}: stored in ({dims}) order: its consumers read it with "
                                      f"{best_cost[0]} index divisions instead of {before[0]}"
                                      + (f", {best_cost[1]} strided reads instead of {before[1]}"
                                         if best_cost[1] != before[1] else ""))


__all__ = ["assign_layouts", "follow_input_layouts", "strides_for"]
