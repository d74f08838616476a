"""A compiled graph: kernel launches and extern calls over planned buffers.

Each step allocates its outputs (contiguous, on the graph's device) just before it runs (an
in-place write into an input writes the input's own tensor);
every intermediate buffer is released right after its last use, so peak memory follows the
live set rather than the whole graph (PyTorch's caching allocator reuses the freed blocks).
Symbolic sizes are bound from the call's arguments on every call, so one compiled graph
serves every size. A graph may be called from several threads at once: a call's buffers and
sizes are its own; the per-size layouts (a bounded cache) are shared, never changed once
computed.

Under an active `torch.profiler` session every step is a named range: a kernel's own name
(`forward_3fa2c1_red_pow_mean_add_rsqrt_mul_1`), an extern call's label
(`forward_3fa2c1_extern_convolution_buf3`), inside one range for the whole graph (`tilefuse
forward0`); see `runtime.profiling`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..ir import symbolic
from ..ir.graph import Constant, Extern, ExternResult, Graph, Input, ScalarInput, Scatter
from ..ir.storage import promised_strides
from ..ir.interpret import PreparedExtern, bind_from, bind_result_sizes, output_value, symbol_sources, torch_dtype
from .profiling import profiled, profiler_enabled, step_label
from . import straight_line
from .. import logs
from ..backends.size_cache import SizeCache, size_key

#: a set of sizes whose call is not generated (`straight_line`): it runs the general way
_GENERAL = object()
#: a set of sizes called once: the next call generates its function
_SEEN = object()


@dataclass
class KernelStep:
    name: str
    launch: object  # callable(buffers, env)
    writes: list
    reads: list
    scratch: dict = field(default_factory=dict)  # name -> tile.ir.Scratch it writes or reads (layouts)
    keep: object = None  # what its launcher shares with identical kernels (`dedupe.Shared`), kept alive

    __tilefuse_transient__ = ("keep",)  # (a stored graph shares nothing: `runtime.artifact`)


@dataclass
class ExternCall:
    name: str
    reads: list
    label: str = ""  # its name in profiles


class CompiledGraph:
    def __init__(self, graph: Graph, steps: list, device: torch.device):
        self.graph = graph
        self.steps = steps
        self.device = device
        outputs = set(graph.output_names())
        last_use: dict[str, int] = {}
        for k, step in enumerate(steps):
            for name in step.reads:
                last_use[name] = k
        self.free_after: list[list[str]] = [[] for _ in steps]
        for name, k in last_use.items():
            node = graph.nodes.get(name)
            if name not in outputs and not isinstance(node, (Input, ScalarInput, Constant)):
                self.free_after[k].append(name)
        # lifted constants (a CPU scalar tensor from `where(c, -inf, x)`) live where the kernels run
        self.constants = {n.name: n.value.to(device) if isinstance(n.value, torch.Tensor) else n.value
                          for n in graph.nodes.values() if isinstance(n, Constant)}
        self._layouts = SizeCache()  # size_key(env) -> {buffer: (shape, stride, dtype)}
        self.scratch = {name: spec for step in steps for name, spec in getattr(step, "scratch", {}).items()}
        # in-place writes into inputs: the kernel writes the input's own tensor, and the
        # write's node names that tensor afterwards
        self.in_place = {n.name: n.target for n in graph.nodes.values() if isinstance(n, Scatter)}
        self.inputs = {n.name for n in graph.inputs if isinstance(n, Input)}
        self.extern_results: dict[str, list] = {}
        for n in graph.nodes.values():
            if isinstance(n, ExternResult):
                self.extern_results.setdefault(n.extern, []).append((n.name, n.item))
        promised = {n.name: promised_strides(n) for n in graph.nodes.values() if isinstance(n, (Extern, ExternResult))}
        self.promised = {name: tuple(int(st) for st in strides) for name, strides in promised.items()
                         if strides is not None}
        #: ATen results returned by the graph whose traced strides have symbols: the kernels
        #: here read them at whatever strides they come, but the graph's caller (a training
        #: backward compiled against the traced layout, AOTAutograd's views) expects the traced
        #: ones, so they are conformed to them, evaluated for each call's sizes
        outputs = set(graph.output_names())
        self.promised_symbolic = {
            n.name: tuple(n.strides) for n in graph.nodes.values()
            if isinstance(n, (Extern, ExternResult)) and n.name in outputs and n.name not in self.promised
            and getattr(n, "strides", None) is not None and len(n.strides) == len(n.shape)}
        self.externs: dict = {}  # node name -> PreparedExtern
        self.symbol_sources = symbol_sources(graph)
        # (name, position, 0-dim): only a 0-dim tensor may come on the CPU to a GPU graph
        self.input_slots = [(n.name, n.position, n.rank == 0 and device.type != "cpu")
                            for n in graph.inputs if isinstance(n, Input)]
        self.label = f"tilefuse {graph.name}"
        self.step_labels = [step_label(graph, step) for step in steps]
        self._calls = SizeCache()  # size_key(env) -> generated call (`straight_line`) or _GENERAL
        self._plannable = straight_line.plannable(graph)
        #: later calls of a set of sizes run a generated function (the `generated_wrapper` knob
        #: of the compile, set by the compiler)
        self.generates_calls = True
        #: on the CPU, generated calls launch consecutive kernels as one run (the `kernel_runs` knob)
        self.kernel_runs = True
        #: a graph of static shapes: its one generated call, taken without a size lookup
        self._static_call = None

    def _alloc(self, name: str, env: dict) -> torch.Tensor:
        # (keyed by the sizes at this step: an extern call earlier in the graph may bind more)
        sizes = size_key(env)
        layouts = self._layouts.get(sizes)
        if layouts is None:
            layouts = self._layouts.put(sizes, {})
        layout = layouts.get(name)
        if layout is None:  # evaluated once per set of sizes; a concurrent call may add the same
            layout = layouts.setdefault(name, self._layout(name, env))
        shape, stride, dtype = layout
        if stride is not None:
            return torch.empty_strided(shape, stride, dtype=dtype, device=self.device)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _layout(self, name: str, env: dict) -> tuple:
        node = self.scratch[name] if name in self.scratch else self.graph[name]
        shape = tuple(int(symbolic.evaluate(d, env)) for d in node.shape)
        strides = self.graph.output_strides.get(name)
        stride = tuple(int(symbolic.evaluate(st, env)) for st in strides) if strides is not None else None
        return shape, stride, torch_dtype(node.dtype)

    def __call__(self, *args):
        return self.run(args)

    def generated_call(self, env: dict | None = None):
        """The generated call for the sizes `env` (`straight_line`; its source in
        `__tilefuse_source__`), None where calls with those sizes run the general way or none
        has run yet."""
        call = self._calls.get(size_key(env or {}))
        return None if call is None or call is _GENERAL or call is _SEEN else call

    def _on_device(self, value):
        """A 0-dim CPU tensor input of a GPU graph (Dynamo passes a float computed from a
        symbolic size, e.g. `1 / sqrt(d)`, as one) is moved to where the kernels run; eager
        PyTorch allows such scalars beside GPU tensors, kernels cannot read them."""
        if (isinstance(value, torch.Tensor) and value.dim() == 0 and value.device != self.device
                and value.device.type == "cpu"):
            return value.to(self.device, non_blocking=True)
        return value

    def run(self, args, on_step=None):
        """Run the graph on `args`. `on_step(k, step, buffers)`, when given, is called after
        each step with the live buffers (verify mode records every prefix's state this way)."""
        static = self._static_call
        if static is not None and on_step is None and not profiler_enabled():
            outputs = static(args, {}, self)
            if outputs is not None:
                return outputs
        if profiler_enabled():  # once per call: a profiled call runs each step in its range
            with profiled(self.label):
                return self._run(args, on_step, self.step_labels)
        return self._run(args, on_step, None)

    def _run(self, args, on_step, labels):
        env = bind_from(self.symbol_sources, args)
        if labels is None and on_step is None and self._plannable and self.generates_calls:
            key = size_key(env)
            call = self._calls.get(key)
            if call is None:  # a first call: sizes that may never come again generate nothing
                self._calls.put(key, _SEEN)
            elif call is _SEEN:
                return self._generate(args, env, key)
            elif call is not _GENERAL:
                outputs = call(args, env, self)
                if outputs is not None:
                    return outputs
        return self._general(args, env, on_step, labels)

    def _generate(self, args, env: dict, key: tuple) -> list:
        """The second call of a set of sizes: run the general way, asking each launcher after
        its launch what a generated call would call (`straight_line`); then generate the call
        for these sizes."""
        records = []

        def record(k, step, buffers):
            inline = getattr(step.launch, "inline", None) if isinstance(step, KernelStep) else None
            answer = None
            if inline is not None:
                try:
                    answer = inline(buffers, env)
                except Exception as err:  # noqa: BLE001 - that launch goes the general way
                    logs.log("runtime", "%s: %s launches the general way (%s)", self.graph.name, step.name, err)
            records.append(answer)

        outputs = self._general(args, env, record, None)
        call = _GENERAL
        if size_key(env) == key and len(records) == len(self.steps):
            try:
                call = straight_line.generate(self, env, records)
            except Exception as err:  # noqa: BLE001 - a call that cannot be generated runs the general way
                logs.log("runtime", "%s: no generated call (%s)", self.graph.name, err)
        self._calls.replace(key, call)
        if call is not _GENERAL and not self.symbol_sources:
            self._static_call = call
        return outputs

    def _general(self, args, env: dict, on_step, labels):
        graph = self.graph
        buffers = dict(self.constants)
        for name, position, scalar in self.input_slots:
            buffers[name] = self._on_device(args[position]) if scalar else args[position]
        for name, target in self.in_place.items():
            buffers[name] = buffers[target]
        for k, step in enumerate(self.steps):
            if labels is not None:
                with profiled(labels[k]):
                    self._step(step, buffers, env)
            elif isinstance(step, KernelStep):  # (inline, as `_step` does: a call per step is measurable)
                for name in step.writes:
                    if name not in self.inputs:
                        buffers[name] = self._alloc(name, env)
                step.launch(buffers, env)
            else:
                self._extern(step, buffers, env)
            if on_step is not None:
                on_step(k, step, buffers)
            for name in self.free_after[k]:
                buffers.pop(name, None)
        return [output_value(o, buffers, env) for o in graph.outputs]

    def _step(self, step, buffers: dict, env: dict) -> None:
        if isinstance(step, KernelStep):
            for name in step.writes:
                if name not in self.inputs:
                    buffers[name] = self._alloc(name, env)
            step.launch(buffers, env)
        else:
            self._extern(step, buffers, env)

    def _extern(self, step, buffers: dict, env: dict) -> None:
        call = self.externs.get(step.name)
        if call is None:  # (prepared once; a concurrent call may prepare the same)
            call = self.externs.setdefault(step.name, PreparedExtern(self.graph[step.name]))
        node = call.node
        result = call(buffers, env)
        buffers[node.name] = self._conform(node.name, result, env)
        for name, item in self.extern_results.get(node.name, ()):
            bind_result_sizes(self.graph[name].shape, result[item], env)
            buffers[name] = self._conform(name, result[item], env)

    def promised_layout(self, name: str, env: dict) -> tuple | None:
        """The strides ATen result `name` must have for these sizes (`promised`,
        `promised_symbolic`), or None where any will do."""
        promised = self.promised.get(name)
        if promised is None and name in self.promised_symbolic:
            try:
                promised = tuple(int(symbolic.evaluate(st, env)) for st in self.promised_symbolic[name])
            except (KeyError, TypeError, ValueError):  # a symbol these sizes do not bind
                return None
        return promised

    def _conform(self, name: str, value, env: dict | None = None):
        """An ATen result in the layout the kernels that read it were compiled for
        (`ir.storage.promised_strides`), or that the graph's caller expects of an output: the
        traced layout, which the call nearly always returns; a copy into it when it does not."""
        if not isinstance(value, torch.Tensor):
            return value
        promised = self.promised_layout(name, env or {})
        if promised is None or any(n > 1 and st == 0 for n, st in zip(value.shape, promised)):
            return value  # (an expanded layout cannot be copied into)
        if all(n == 1 or st == want for n, st, want in zip(value.shape, value.stride(), promised)):
            return value
        return torch.empty_strided(value.shape, promised, dtype=value.dtype, device=value.device).copy_(value)


__all__ = ["CompiledGraph", "KernelStep", "ExternCall", "Extern"]
