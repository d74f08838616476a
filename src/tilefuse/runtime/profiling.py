"""Compiled graphs as `torch.profiler` sees them: a named range per kernel launch and extern call.

Without this a profile shows one "Torch-Compiled Region" per graph on CPU. The runtime asks
`profiler_enabled()` once per graph call; only a profiled call pays for the ranges, so an
unprofiled call costs one C call more.

The check is `torch._C._autograd._profiler_enabled()` (also exported as
`torch.autograd._profiler_enabled`): the profiler's own state in the C++ core, for the calling
thread, whichever API started it (`torch.profiler.profile`, the legacy
`torch.autograd.profiler.profile`, `_KinetoProfile.start()`), the same state the ranges record
into, and about 50 ns. Inductor reads the Python flag `torch.autograd.profiler._is_profiler_enabled`
instead, which only the Python profiler classes set. Both are private; the C binding has been
there since PyTorch 1.8, and the flag is the fallback.

The ranges are `torch._C._profiler._RecordFunctionFast` (what Inductor's launchers use: under a
microsecond, where `torch.profiler.record_function` dispatches an op to open and close each
range), with `record_function` as the fallback.
"""
from __future__ import annotations

import torch

from ..ir.identifiers import identifier_part, short_op_name


def _python_flag() -> bool:
    return bool(torch.autograd.profiler._is_profiler_enabled)


profiler_enabled = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None) or _python_flag

profiled = getattr(getattr(torch._C, "_profiler", None), "_RecordFunctionFast", None) or torch.profiler.record_function


def step_label(graph, step) -> str:
    """A step's range name: a kernel's own name; an extern call's label from the planner
    (`forward_3fa2c1_extern_convolution_buf3`), or one made here."""
    if hasattr(step, "launch"):
        return step.name
    if getattr(step, "label", ""):
        return step.label
    node = graph[step.name]
    op = short_op_name(getattr(node, "target", None) or getattr(node, "target_name", "")) or "call"
    return f"{identifier_part(graph.name) or 'graph'}_extern_{op}_{identifier_part(step.name)}"


__all__ = ["profiler_enabled", "profiled", "step_label"]
