"""CUDA graphs for compiled graphs (`mode="reduce-overhead"`, knob `cuda_graphs`): a graph's
kernel launches, allocations and extern calls are captured once per input layout and replayed
with one call, so a small step (decoding one token) costs the GPU's time, not Python's.

* **Static inputs** (AOTAutograd's static input indices; any `nn.Parameter`; any tensor Dynamo
  marked as a static address, which it does for a module's parameters and buffers, a static
  KV cache among them) are used where they are. If one moves (a new tensor passed in its
  place), the graph is captured again for the new addresses. (A buffer copied in and out of
  the graph's own memory on every replay cost a gpt-fast decode step its whole KV cache twice.)
* **Other tensor inputs** are copied, before each replay, into buffers the captured graph owns;
  those the graph writes into are copied back after it.
* **Outputs** are copied out of the graph's memory (the next replay overwrites it), so every
  call returns tensors of its own, as an uncaptured call does.
* **One capture per input layout**: the sizes of symbolic dims (Dynamo's guards fix the rest);
  at most `MAX_CAPTURES` per compiled graph, then new sizes run uncaptured (logged once).
* **Warm-up**: the first call of each layout runs uncaptured (Triton's JIT, cuBLAS's
  handles); the second captures, then replays.
* **What cannot be captured** (a host sync such as `.item()`, a data-dependent size, a CPU
  tensor input, an op that refuses capture) runs uncaptured from then on, with the reason in the
  runtime log and in `explain` (`CompileReport.cuda_graphs`).
* All captures of a process on one device share one memory pool: each replay's outputs are
  copied out before anything else replays, and replays on one stream never overlap, so a
  graph's transient memory may be another's.

Replays of one compiled graph are serialised (a lock): its captured buffers are shared.
"""
from __future__ import annotations

import threading

import torch

from .. import logs

#: captured graphs kept per compiled graph (one per input layout)
MAX_CAPTURES = 16

_pools: dict = {}  # device index -> the process's memory pool for captures on it


def _pool(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    pool = _pools.get(index)
    if pool is None:
        pool = _pools[index] = torch.cuda.graph_pool_handle()
    return pool


class _Capture:
    """One captured graph: its CUDA graph, the static inputs' addresses it was captured with,
    its own input buffers (position -> tensor) and its outputs in the graph's memory."""

    def __init__(self, graph, static_ptrs: list, owned: dict, outputs: list):
        self.graph = graph
        self.static_ptrs = static_ptrs
        self.owned = owned
        self.outputs = outputs
        # an expanded input (a stride-0 dim) is copied through the view that holds each element once
        self.expanded = {k for k, buf in owned.items() if _has_expanded_dims(buf)}
        self.targets = [_distinct(buf) if k in self.expanded else buf for k, buf in owned.items()]


class CudaGraphRunner:
    """`runner(*args)` with a compiled graph's interface (`.graph`, `.run`), through CUDA graphs.
    `static`: positions of inputs that stay where they are between calls; `mutated`:
    positions of inputs the graph writes into; `report`: the compile report, whose
    `cuda_graphs` field says how the graph runs."""

    def __init__(self, compiled, static: list, mutated: list, report=None):
        self.compiled = compiled
        self.graph = compiled.graph
        self.device = compiled.device
        self.static = sorted(set(static))
        self.mutated = set(mutated)
        self.report = report
        self.varying = _varying_inputs(compiled.graph)
        self.captures: dict = {}  # layout key -> _Capture
        self.warmed: set = set()  # layout keys that ran once uncaptured
        self.refused = ""  # why this graph runs uncaptured ("": it does not)
        self._lock = threading.Lock()
        self._full = False
        self._status("captured on the second call of each input layout")

    def _status(self, text: str) -> None:
        if self.report is not None:
            self.report.cuda_graphs = text

    def __call__(self, *args):
        return self.run(args)

    def run(self, args, on_step=None):
        if on_step is not None or self.refused or self._capturing():
            return self.compiled.run(args, on_step)
        key = self._layout(args)
        with self._lock:
            capture = self.captures.get(key)
            if capture is not None and capture.static_ptrs != [args[k].data_ptr() for k in self.static]:
                del self.captures[key]  # a static input moved: capture again for its new address
                logs.log("runtime", "%s: a static input moved: capturing its CUDA graph again", self.graph.name)
                capture = None
            if capture is None:
                if len(self.captures) >= MAX_CAPTURES:
                    self._full_once()
                    return self.compiled.run(args)
                if key not in self.warmed:  # the first call of a layout: warm-up, uncaptured
                    if len(self.warmed) >= 4 * MAX_CAPTURES:
                        self.warmed.clear()
                    self.warmed.add(key)
                    return self.compiled.run(args)
                capture = self._capture(args, key)
                if capture is None:
                    return self.compiled.run(args)
            return self._replay(capture, args)

    def _full_once(self) -> None:
        if not self._full:
            self._full = True
            logs.log("runtime", "%s: %d input layouts captured: new ones run uncaptured", self.graph.name,
                     MAX_CAPTURES)

    def _layout(self, args) -> tuple:
        """What distinguishes one capture from another: the sizes and strides of inputs with
        symbolic dims and the values of scalar inputs (Dynamo's guards fix everything else)."""
        return tuple((tuple(args[k].shape), args[k].stride()) if isinstance(args[k], torch.Tensor) else args[k]
                     for k in self.varying)

    def _capture(self, args, key):
        self.static = sorted(set(self.static) | {k for k, a in enumerate(args) if _static_address(a)})
        reason = self._uncapturable(args)
        if reason:
            return self._refuse(reason)
        static = set(self.static)
        owned = {k: torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                 for k, a in enumerate(args) if isinstance(a, torch.Tensor) and k not in static}
        for k, buf in owned.items():
            _distinct(buf).copy_(_distinct(args[k]))
        inputs = [owned.get(k, a) for k, a in enumerate(args)]
        try:
            graph, outputs = self._record(lambda: self.compiled.run(inputs))
        except Exception as err:  # noqa: BLE001 - anything capture refuses: run uncaptured
            message = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
            return self._refuse(f"capture failed: {type(err).__name__}: {message}")
        capture = _Capture(graph, [args[k].data_ptr() for k in self.static], owned, outputs)
        self.captures[key] = capture
        logs.log("runtime", "%s: CUDA graph captured (%d of at most %d layouts; %d inputs copied per call)",
                 self.graph.name, len(self.captures), MAX_CAPTURES, len(owned))
        return capture

    def _record(self, run):
        """(CUDA graph, outputs) of `run()` captured on a side stream, in the process's pool."""
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(current)
        try:
            with torch.cuda.graph(graph, pool=_pool(self.device), stream=stream, capture_error_mode="thread_local"):
                outputs = run()
        finally:
            current.wait_stream(stream)
        return graph, outputs

    def _capturing(self) -> bool:
        """Whether the caller is capturing a CUDA graph of its own (then this runs as is)."""
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _uncapturable(self, args) -> str:
        for k, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.device.type != "cuda":
                return f"input {k} is a {a.device.type} tensor"
        return ""

    def _refuse(self, reason: str):
        self.refused = reason
        self._status(f"not used: {reason}")
        logs.log("runtime", "%s runs without CUDA graphs: %s", self.graph.name, reason)
        return None

    def _replay(self, capture: _Capture, args):
        owned = capture.owned
        if owned:
            expanded = capture.expanded
            torch._foreach_copy_(capture.targets, [_distinct(args[k]) if k in expanded else args[k] for k in owned])
        capture.graph.replay()
        for k in self.mutated & owned.keys():
            _distinct(args[k]).copy_(_distinct(owned[k]))
        return [o.clone() if isinstance(o, torch.Tensor) else o for o in capture.outputs]


def _static_address(a) -> bool:
    """A parameter, or a tensor Dynamo marked as staying where it is (`mark_static_address`:
    every buffer and parameter of a module it inlines)."""
    return isinstance(a, torch.nn.Parameter) or (isinstance(a, torch.Tensor)
                                                 and getattr(a, "_dynamo_static_input_type", None) is not None)


def _has_expanded_dims(t: torch.Tensor) -> bool:
    return any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride()))


def _distinct(t: torch.Tensor) -> torch.Tensor:
    """`t` with each expanded (stride-0) dim cut to one element: a view in which no two
    elements share memory, which `copy_` can write."""
    if not _has_expanded_dims(t):
        return t
    return t[tuple(slice(0, 1) if st == 0 and n > 1 else slice(None) for n, st in zip(t.shape, t.stride()))]


def _varying_inputs(graph) -> list:
    """Positions of the inputs whose layout or value a call may change: scalars, and tensors
    with a symbolic size or stride."""
    import sympy

    out = []
    for node in graph.inputs:
        dims = [*node.shape, *(getattr(node, "strides", None) or ())]
        if not hasattr(node, "strides") or any(isinstance(d, sympy.Basic) and d.free_symbols for d in dims):
            out.append(node.position)
    return out


__all__ = ["CudaGraphRunner", "MAX_CAPTURES"]
