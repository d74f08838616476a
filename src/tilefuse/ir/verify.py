"""Structural checks on a graph: names resolve, loads match ranks, index symbols are in scope.

`verify(graph)` raises `IRVerificationError` naming the node and the problem; the compiler
runs it after lowering and after every pass when `TILEFUSE_VERIFY` is set.
"""
from __future__ import annotations

import sympy

from .expr import CheckedIndex, Index, Load, walk
from .graph import Extern, ExternResult, Graph, Input, Pointwise, Reduce, Scatter
from .monoid import Monoid


class IRVerificationError(ValueError):
    pass


def _check_body(graph: Graph, node, seen: set, allowed: set, body=None) -> None:
    for e in walk(node.body if body is None else body):
        if isinstance(e, Load):
            if e.buffer not in seen:
                raise IRVerificationError(f"{node.name}: loads {e.buffer}, which is not defined before it")
            src = graph.nodes[e.buffer]
            if len(e.index) != src.rank:
                raise IRVerificationError(
                    f"{node.name}: loads {e.buffer} with {len(e.index)} indices, but it has rank {src.rank}"
                )
            if e.dtype != src.dtype:
                raise IRVerificationError(f"{node.name}: load of {e.buffer} as {e.dtype}, buffer is {src.dtype}")
        if isinstance(e, CheckedIndex):
            if not (e.x.dtype.is_int and e.dtype.is_int):
                raise IRVerificationError(f"{node.name}: checked index of dtype {e.x.dtype}")
            if any(str(s)[0] in "ir" and str(s)[1:].isdigit() for s in sympy.sympify(e.size).free_symbols):
                raise IRVerificationError(f"{node.name}: the bound {e.size} of a checked index depends on an index")
        if isinstance(e, Index):
            for s in e.expr.free_symbols:
                name = str(s)
                if name[0] in "ir" and name[1:].isdigit() and s not in allowed:
                    raise IRVerificationError(f"{node.name}: index symbol {s} out of scope")


def verify(graph: Graph) -> Graph:
    seen: set[str] = set()
    for node in graph.nodes.values():
        for d in node.shape:
            if not isinstance(d, sympy.Basic):
                raise IRVerificationError(f"{node.name}: shape entry {d!r} is not a sympy expression")
        if isinstance(node, Pointwise):
            allowed = {sympy.Symbol(f"i{k}", integer=True, nonnegative=True) for k in range(node.rank)}
            _check_body(graph, node, seen, allowed)
        elif isinstance(node, Reduce):
            if not isinstance(node.combiner, Monoid):
                raise IRVerificationError(f"{node.name}: combiner {node.combiner!r} is not a Monoid")
            allowed = {sympy.Symbol(f"i{k}", integer=True, nonnegative=True) for k in range(node.rank)}
            allowed |= {sympy.Symbol(f"r{k}", integer=True, nonnegative=True) for k in range(len(node.ranges))}
            _check_body(graph, node, seen, allowed)
        elif isinstance(node, Scatter):
            target = graph.nodes.get(node.target)
            if not isinstance(target, Input) or node.target not in seen:
                raise IRVerificationError(f"{node.name}: writes into {node.target}, which is not a graph input")
            if len(node.index) != target.rank or (node.dtype, tuple(node.shape)) != (target.dtype, tuple(target.shape)):
                raise IRVerificationError(f"{node.name}: does not match its target {node.target}")
            allowed = {sympy.Symbol(f"i{k}", integer=True, nonnegative=True) for k in range(len(node.space))}
            for e in (node.body, *node.index):
                _check_body(graph, node, seen, allowed, e)
        elif isinstance(node, (Extern, ExternResult)):
            missing = node.inputs() - seen
            if missing:
                raise IRVerificationError(f"{node.name}: uses undefined {sorted(missing)}")
        seen.add(node.name)
    for o in graph.outputs:
        if isinstance(o, str) and o not in seen:
            raise IRVerificationError(f"output {o} is not defined")
    return graph
