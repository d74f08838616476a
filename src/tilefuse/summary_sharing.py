"""One block summary per mask per call: attention layers that share a mask share its summary.

A model computes its attention mask once and hands it to every layer (Hugging Face's 4-D
masks, gpt-fast's `causal_mask[None, None, input_pos]`); each layer's flash kernel is the same
kernel (`dedupe`), and so is the pre-kernel that summarises the mask (`tile.block_summary`).
When a later summary step runs the same launcher over the same buffers as an earlier one, and
no step between them writes those buffers, its lists would be identical: the step is dropped
and the kernels that read its lists read the earlier ones (which then stay allocated until
their last reader, as any buffer does).
"""
from __future__ import annotations

from .dedupe import Renamed
from .ir.graph import Graph, Scatter


def _bindings(step) -> tuple[object, dict]:
    """(the launcher that runs, {its buffer parameter: the buffer it gets})."""
    if isinstance(step.launch, Renamed):
        return step.launch.launch, dict(step.launch.pairs)
    return step.launch, {n: n for n in list(step.reads) + list(step.writes)}


def _rebound(step, renames: dict):
    """`step` reading `renames[n]` wherever it read n."""
    if not any(n in renames for n in step.reads):
        return step
    launch, bound = _bindings(step)
    pairs = [(param, renames.get(actual, actual)) for param, actual in bound.items()]
    keep = step.launch.shared if isinstance(step.launch, Renamed) else None
    step.launch = Renamed(launch, pairs, keep)
    step.reads = [renames.get(n, n) for n in step.reads]
    return step


def share_summaries(graph: Graph, steps: list, summaries: set, report=None) -> list:
    """`steps` without the summary steps (names in `summaries`) that repeat an earlier one."""
    seen: list = []  # (launcher, read bindings, step)
    renames: dict = {}
    out = []
    for step in steps:
        step = _rebound(step, renames) if hasattr(step, "launch") else step
        if step.name in summaries:
            launch, bound = _bindings(step)
            reads = {p: a for p, a in bound.items() if a in step.reads}
            earlier = next((s for launcher, r, s in seen if launcher is launch and r == reads), None)
            if earlier is not None:
                _, theirs = _bindings(earlier)
                renames.update({bound[p]: theirs[p] for p in bound if bound[p] in step.writes})
                if report is not None:
                    _note(report, step.name, f"{step.name}: not run — the same mask as {earlier.name}, "
                                             f"whose lists the attention kernel reads")
                continue
            seen.append((launch, reads, step))
        written = set(getattr(step, "writes", ())) | {step.name}
        written |= {n.target for name in list(written) if isinstance(n := graph.nodes.get(name), Scatter)}
        seen = [entry for entry in seen if not written & set(entry[1].values())]
        out.append(step)
    return out


def _note(report, name: str, note: str) -> None:
    for kernel in report.kernels:
        if kernel.name == name:
            kernel.notes = list(kernel.notes) + [note]


__all__ = ["share_summaries"]
