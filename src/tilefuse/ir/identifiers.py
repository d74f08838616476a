"""Identifier fragments for the names of generated code (kernel names, profiler events).

A kernel's name is a C function, a Triton (Python) function and a symbol `perf` and the
profilers show, so every fragment is made of ASCII letters, digits and single underscores, and
never starts or ends with `_` (C and C++ reserve `__` anywhere and `_X` at the start).
"""
from __future__ import annotations

import hashlib
import re

from .graph import format_graph

MAX_GRAPH_TAG = 16  # characters of the graph part of a kernel's name


def identifier_part(text: str) -> str:
    """`text` with other characters as `_`, runs of `_` as one, none at either end."""
    out = []
    for ch in str(text):
        ch = ch if (ch.isascii() and (ch.isalnum() or ch == "_")) else "_"
        if ch == "_" and out and out[-1] == "_":
            continue
        out.append(ch)
    return "".join(out).strip("_")


def short_op_name(target) -> str:
    """`aten.mean.dim` -> "mean", `aten._softmax.default` -> "softmax", a higher-order op or a
    Python function -> its name (an OpOverload, or its printed name as an Extern keeps it)."""
    name = str(getattr(target, "_opname", None) or getattr(target, "__name__", None) or target)
    for prefix in ("aten.", "aten::"):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return identifier_part(name.split(".", 1)[0])


def graph_tag(graph) -> str:
    """The graph part of a kernel name: the kind of graph (its name without the API's count:
    `forward`, `backward`) and `graph_fingerprint`, e.g. `forward_3fa2c1`, at most
    `MAX_GRAPH_TAG` characters."""
    kind = identifier_part(re.sub(r"\d+$", "", graph.name))[:MAX_GRAPH_TAG - 7].rstrip("_") or "graph"
    if not kind[0].isalpha():
        kind = f"g{kind}"[:MAX_GRAPH_TAG - 7].rstrip("_")
    return f"{kind}_{graph_fingerprint(graph)}"


def graph_fingerprint(graph) -> str:
    """Six hex digits that depend only on what the graph computes: its inputs (layouts too),
    nodes and outputs as printed, not its name (the API numbers graphs in the order a process
    compiles them) nor the source lines its nodes come from (editing another line moves them).
    The same graph gets the same kernel names and so the same kernel sources, which the disk
    caches key on, in any process; two graphs share a tag with a chance of one in 16 million."""
    layouts = [(n.name, getattr(n, "strides", None)) for n in graph.inputs]
    text = f"{format_graph(graph, origins=False, name='graph')}\n{layouts}\n{sorted(graph.output_strides.items())}"
    return hashlib.sha256(text.encode()).hexdigest()[:6]


__all__ = ["identifier_part", "short_op_name", "graph_tag", "graph_fingerprint", "MAX_GRAPH_TAG"]
