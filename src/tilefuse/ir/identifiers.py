"""Identifier fragments for the names of generated code (kernel names, profiler events).

A kernel's name is a C function, a Triton (Python) function and a symbol `perf` and the
profilers show, so every fragment is made of ASCII letters, digits and single underscores, and
never starts or ends with `_` (C and C++ reserve `__` anywhere and `_X` at the start).
"""
from __future__ import annotations

MAX_GRAPH_TAG = 16  # characters of a graph's name kept in its kernels' names


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


def graph_tag(graph_name: str) -> str:
    """The graph part of a kernel name: the graph's name (`forward0`), made an identifier that
    starts with a letter, at most `MAX_GRAPH_TAG` characters."""
    tag = identifier_part(graph_name)[:MAX_GRAPH_TAG].rstrip("_") or "graph"
    return tag if tag[0].isalpha() else f"g{tag}"[:MAX_GRAPH_TAG].rstrip("_")


__all__ = ["identifier_part", "short_op_name", "graph_tag", "MAX_GRAPH_TAG"]
