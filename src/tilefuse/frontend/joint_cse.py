"""Common subexpressions of a training graph's joint forward-backward, merged before the
min-cut partition chooses what the forward saves.

AOTAutograd's partitioner merges them itself (`torch._functorch.config.cse`), but its pass
imports Inductor's pattern matcher, and with it Inductor's lowerings: 0.6 s of every process's
first training compile, cold or warm, for a backend that uses nothing else of Inductor (a warm
nanoGPT training step's first call, fresh process, 2-core host: 1.6 s with it, 1.1 s
without). The partition runs with that pass off and this one first.

Two calls merge when they are the same operator on the same arguments (nodes, and constants of
the same type and spelling: `0.0` and `-0.0`, `1` and `1.0` stay apart), in the same mutation
region (a call that writes into a tensor starts a new one). Never merged: anything that
writes or has a side effect, operators tagged random (`nondeterministic_seeded`), `empty`'s
uninitialised memory, calls whose value shares storage with a graph output (two outputs that
eager returns as separate tensors stay separate), and calls whose arguments this pass cannot
compare (symbolic values, unknown objects).
"""
from __future__ import annotations

import operator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

aten = torch.ops.aten

#: operators whose results are uninitialised memory: two of them are not the same value
_UNINITIALISED = frozenset({aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty,
                            aten.new_empty_strided, aten.empty_permuted, torch.ops.prims.empty_strided,
                            torch.ops.prims.empty_permuted})


class _Incomparable(Exception):
    """An argument this pass cannot compare by value."""


def eliminate_common_subexpressions(gm: torch.fx.GraphModule) -> int:
    """Merge repeated pure calls of `gm`'s graph in place; the number of calls removed."""
    graph = gm.graph
    output = next(iter(reversed(graph.nodes)))
    returned = {s for n in output.all_input_nodes for s in _storages(n)} if output.op == "output" else set()
    first: dict = {}
    region = 0
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if _writes(node):
            region += 1
            continue
        if not _pure(node) or (returned and not returned.isdisjoint(_storages(node))):
            continue
        try:
            key = (region, node.target, _frozen(node.args), _frozen(node.kwargs))
        except _Incomparable:
            continue
        kept = first.setdefault(key, node)
        if kept is not node:
            node.replace_all_uses_with(kept)
            graph.erase_node(node)
            removed += 1
    if removed:
        gm.recompile()
    return removed


def _writes(node: torch.fx.Node) -> bool:
    """Whether the call writes into a tensor (a mutation region ends)."""
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable) or "out" in node.kwargs


def _pure(node: torch.fx.Node) -> bool:
    """Whether two such calls on the same arguments give the same value and nothing else."""
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload) or node.is_impure():
        return False  # higher-order operators, Python functions on sizes, asserts
    if torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return target.overloadpacket not in _UNINITIALISED


def _storages(node: torch.fx.Node) -> set:
    """The storages of the node's value: a tensor's, or each tensor's of a tuple (`topk`)."""
    val = node.meta.get("val")
    out = set()
    for t in val if isinstance(val, (list, tuple)) else (val,):
        if isinstance(t, torch.Tensor):
            try:
                out.add(StorageWeakRef(t.untyped_storage()))
            except (NotImplementedError, RuntimeError):
                pass  # a tensor with no storage to compare (as AOTAutograd's pass, it counts as unshared)
    return out


def _frozen(value):
    """A hashable stand-in for an argument, equal only for arguments that are the same value
    of the same type."""
    if isinstance(value, torch.fx.Node):
        return value
    if value is None or isinstance(value, (bool, int, str)):
        return (type(value).__name__, value)
    if isinstance(value, float):
        return ("float", repr(value))  # (-0.0 and 0.0 differ; nan equals nan)
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return (type(value).__name__, str(value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_frozen(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), _frozen(v)) for k, v in value.items())))
    if isinstance(value, slice):
        return ("slice", _frozen(value.start), _frozen(value.stop), _frozen(value.step))
    if value is Ellipsis:
        return ("ellipsis",)
    raise _Incomparable(type(value).__name__)


__all__ = ["eliminate_common_subexpressions"]
