"""Where a graph-IR node came from: the ATen ops it was lowered from and the user's source lines.

An `Origin` is a small immutable record kept in the graph's side table `Graph.origins` (node
name -> Origin). The frontend fills it; passes that merge nodes (CSE) take the union, passes
that split one node into several copy it; kernels report the union over the nodes they compute
(their kernel names, `tilefuse.explain`, the profiler). A node without an entry has no known
origin (graphs built by hand, copies of views realised for an output).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class Origin:
    ops: tuple[str, ...] = ()  # short ATen op names, in program order: ("pow", "mean")
    lines: tuple[str, ...] = ()  # "model.py:42 in forward: x = x * torch.rsqrt(...)"

    def __or__(self, other: "Origin") -> "Origin":
        return Origin(_merge(self.ops, other.ops), _merge(self.lines, other.lines))

    def __bool__(self) -> bool:
        return bool(self.ops or self.lines)

    def comment(self) -> str:
        """One short line for the graph IR text: `mean, rsqrt  (model.py:42)`."""
        places = ", ".join(dict.fromkeys(line.split(" in ", 1)[0] for line in self.lines))
        text = ", ".join(self.ops)
        return f"{text}  ({places})" if places and text else text or f"({places})"


NO_ORIGIN = Origin()


def union(origins: Iterable[Origin]) -> Origin:
    out = NO_ORIGIN
    for o in origins:
        if o:
            out = out | o
    return out


def origin_of_nodes(graph, names: Iterable[str]) -> Origin:
    """The union of the origins of `names` (in the order given)."""
    table = graph.origins
    return union(table[n] for n in names if n in table)


def merge_into(graph, keep: str, gone: str) -> None:
    """`gone` was merged into `keep` (CSE): `keep` now stands for both."""
    table = graph.origins
    if gone in table:
        table[keep] = table.get(keep, NO_ORIGIN) | table[gone]


def _merge(a: tuple, b: tuple) -> tuple:
    if not b:
        return a
    if not a:
        return b
    return tuple(dict.fromkeys(a + b))


__all__ = ["Origin", "NO_ORIGIN", "union", "origin_of_nodes", "merge_into"]
