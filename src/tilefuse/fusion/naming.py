"""Kernel names: which graph, which kind of kernel, which fused ops.

A plan is named `<graph>_<kind>_<ops>_<k>`, e.g. `forward_3fa2c1_red_pow_mean_add_rsqrt_mul_1`:

* `<graph>` — the kind of graph (`forward`, `backward`) and a fingerprint of what it computes
  (`ir.identifiers.graph_tag`);
* `<kind>` — `pw`, `red`, `mm`, `flash`, or `scatter` for an in-place indexed write;
* `<ops>` — the ATen ops the kernel computes, in program order: those of its members and of
  the producers inlined into them (`fusion.inline`), or merged into it (the score and
  reduction kernels a flash kernel absorbs). Copies, casts and views only count when nothing
  else is there; at most `MAX_OPS_CHARS` characters of whole names, as Inductor caps its
  `fused_...` part;
* `<k>` — the kernel's index among the graph's kernels, which makes the name unique.

Nothing in a name depends on the order in which a process compiles graphs (the API's count in
`forward0`, `backward1`): the same graph gets the same kernel names and so the same kernel
sources, which the disk caches key on, in this process and the next; different graphs get
different names. (A profile shows the API's graph name too: the graph's own range, `tilefuse
forward0`, holds its kernels'.) Kernels the compiler derives from a plan add a suffix
(`_epilogue`, `_partial`, `_merge`, `_part_<what>`). Extern calls get profile labels alike:
`forward_3fa2c1_extern_convolution_buf3`.

The planner names its plans `kernel<N>` while it works and its decisions say so; `name_kernels`
gives the final names once the plans are complete, and `renamer` rewrites those decisions.
"""
from __future__ import annotations

import re

from ..ir.expr import Load, walk
from ..ir.graph import Graph
from ..ir.identifiers import graph_tag, identifier_part, short_op_name
from ..ir.origin import Origin, origin_of_nodes
from .plan import ExternStep, KernelPlan, PlanKind, StageKind

KIND_LABELS = {PlanKind.POINTWISE: "pw", PlanKind.REDUCTION: "red", PlanKind.CONTRACTION: "mm",
               PlanKind.FLASH: "flash"}
MAX_OPS_CHARS = 32

#: ops that only move or convert values: named only in a kernel that does nothing else
PLUMBING = frozenset({
    "clone", "copy", "to_copy", "convert_element_type", "alias", "detach", "lift_fresh_copy", "view",
    "unsafe_view", "reshape", "expand", "permute", "t", "transpose", "unsqueeze", "squeeze", "slice",
    "select", "contiguous", "as_strided", "cat", "split", "unbind",
})


def kind_label(plan: KernelPlan) -> str:
    if plan.kind == PlanKind.POINTWISE and any(st.kind == StageKind.SCATTER for st in plan.stages):
        return "scatter"
    return KIND_LABELS.get(plan.kind, identifier_part(plan.kind) or "kernel")


def ops_part(ops) -> str:
    """The `<ops>` fragment: the op names that fit in `MAX_OPS_CHARS`, plumbing only when alone."""
    names = [identifier_part(op) for op in ops]
    names = [op for op in names if op]
    useful = [op for op in names if op not in PLUMBING] or names
    out = ""
    for op in useful:
        joined = f"{out}_{op}" if out else op
        if len(joined) > MAX_OPS_CHARS:
            if not out:
                out = op[:MAX_OPS_CHARS].rstrip("_")
            break
        out = joined
    return out


def kernel_name(tag: str, label: str, ops, index: int) -> str:
    """`<tag>_<label>_<ops>_<index>`; `tag` is `ir.identifiers.graph_tag` of the graph."""
    parts = [tag, label, ops_part(ops), str(index)]
    return "_".join(p for p in parts if p)


def inlined_closure(graph: Graph, names, inlined: set) -> list[str]:
    """`names` and every inlined producer substituted into their bodies, in graph order."""
    found: set[str] = set()
    stack = list(names)
    while stack:
        name = stack.pop()
        if name in found or name not in graph.nodes:
            continue
        found.add(name)
        body = getattr(graph[name], "body", None)
        if body is not None:
            stack.extend(e.buffer for e in walk(body) if isinstance(e, Load) and e.buffer in inlined)
    return [n for n in graph.nodes if n in found]


def kernel_origin(graph: Graph, members, inlined: set) -> Origin:
    return origin_of_nodes(graph, inlined_closure(graph, members, inlined))


def name_kernels(graph: Graph, steps: list, inlined: set, planned: dict) -> dict[str, str]:
    """Give every plan of `steps` its final name and origin, every extern step its label.
    `planned`: each provisional plan name -> its members when planning ended (before kernels
    were merged). Returns provisional name -> final name, for merged-away plans the name of
    the plan that absorbed them."""
    tag = graph_tag(graph)
    for s in steps:
        if isinstance(s, ExternStep):
            s.label = f"{tag}_extern_{short_op_name(graph[s.node].target_name) or 'call'}_{identifier_part(s.node)}"
    kernels = [s for s in steps if isinstance(s, KernelPlan)]
    final_of = {st.node: k for k in kernels for st in k.stages}
    absorbed: dict[int, list[str]] = {id(k): [] for k in kernels}
    owner: dict[str, KernelPlan] = {}
    for old, members in planned.items():
        k = next((final_of[m] for m in members if m in final_of), None)
        if k is not None:
            owner[old] = k
            absorbed[id(k)].extend(members)
    mapping: dict[str, str] = {}
    for index, k in enumerate(kernels):
        old = k.name
        k.origin = kernel_origin(graph, [*k.members, *absorbed[id(k)]], inlined)
        k.name = kernel_name(tag, kind_label(k), k.origin.ops, index)
        mapping[old] = k.name
    for old, k in owner.items():
        mapping.setdefault(old, k.name)
    return mapping


def renamer(mapping: dict):
    """A function of a text: the text with every provisional kernel name of `mapping` (a whole
    word) replaced. (One pattern for all the texts of a graph: built per text, it cost
    0.2 s of a training graph's planning.)"""
    if not mapping:
        return lambda text: text
    names = sorted(mapping, key=len, reverse=True)
    pattern = re.compile(r"\b(?:" + "|".join(re.escape(n) for n in names) + r")\b")
    return lambda text: pattern.sub(lambda m: mapping[m.group(0)], text)


__all__ = ["kernel_name", "kind_label", "ops_part", "kernel_origin", "name_kernels", "renamer", "MAX_OPS_CHARS"]
