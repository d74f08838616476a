"""Autotuning of one kernel plan: find its configuration in the tuning cache, or rank the
plan's schedule space with the cost model, measure the best candidates with the bandit search
within a time budget, and store the winner.

`TILEFUSE_AUTOTUNE`: `0` — no measurement, the cost model's choice (the rules' default unless
the model predicts a clear win); `1` (default) — up to 8 candidates, about 10 s per kernel;
`max` — up to 32 candidates, about 60 s. Only kernels with static sizes are measured, on
synthetic inputs of the plan's shapes. The machinery is backend-neutral: the same spaces,
search and cache tune the C++ kernels of the CPU backend (host-timed), at `max` only — each
candidate is a C++ compile, and the CPU backend's default keeps a new kernel under a second.

No configuration over the target's limits (`tile.limits`) is compiled: candidates are lowered
and checked before the search measures any, and a tuning-cache record that is not one of the
space's configurations, or does not fit, is discarded and tuned again.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, replace

from .. import logs
from ..backends.triton import generate, load_kernel
from ..tile.lower import LoweringOptions, lower_plan_kernels, schedule_space
from ..tile.space import describe
from .cache import TuningCache, tuning_key
from .cost import NOMINAL, Ceilings, choose_without_measuring, measure_ceilings, rank
from .search import Candidate, TuningError, search

#: level -> (candidates measured, budget seconds); the default's 8 s leaves room for the compile
#: of the last candidate and the lookups inside the 10 s a new kernel may cost
LEVELS = {"1": (8, 8.0), "max": (32, 60.0)}
#: memory-bound kernels (reductions, pointwise) gain little from tuning: a smaller search
MEMORY_LEVELS = {"1": (6, 3.0), "max": (16, 20.0)}
#: the CPU backend (C++ kernels, a compile per candidate): measured only when asked for
CPU_LEVELS = {"max": (12, 20.0)}


@dataclass
class TuneOutcome:
    config: dict | None  # None: the plan has nothing to tune
    source: str  # "rules" | "model" | "cache" | "measured"
    seconds: float = 0.0  # time spent tuning (lookups and measurements)
    measured: int = 0  # measurements taken
    best_time: float | None = None  # measured seconds per launch of the chosen configuration
    note: str = ""

    def describe(self) -> str:
        if self.config is None:
            return f"schedule by the lowering's rules ({self.note})" if self.note else ""
        what = {"model": "cost model (not measured)", "cache": "tuning cache hit (not re-measured)",
                "measured": f"measured {self.measured} runs in {self.seconds:.1f} s"}.get(self.source, self.source)
        best = f", {self.best_time * 1e6:.1f} us" if self.best_time else ""
        why = f" ({self.note})" if self.note else ""
        return f"schedule {describe(self.config)} — {what}{best}{why}"


_ceilings: dict = {}


def device_ceilings(device) -> Ceilings:
    """Measured once per device and process, and cached on disk across processes."""
    if device.type != "cuda":
        return NOMINAL
    key = str(device)
    if key not in _ceilings:
        from ..runtime.cache import DiskCache, cache_key, environment_fingerprint

        cache = DiskCache("tune-ceilings")
        entry = cache.get_or_create(cache_key("ceilings", environment_fingerprint()),
                                    lambda: {"ceilings.json": measure_ceilings(device).to_json().encode()})
        try:
            _ceilings[key] = Ceilings.from_json(entry["ceilings.json"].decode()) if entry else measure_ceilings(device)
        except (KeyError, TypeError, ValueError):
            _ceilings[key] = measure_ceilings(device)
    return _ceilings[key]


def tune_plan(graph, plan, options: LoweringOptions, *, level: str, device, backend: str, aten=None) -> TuneOutcome:
    """`aten`: builds the plan's library step (a plain matmul), measured as `impl=aten`."""
    notes = list(plan.notes)
    try:
        return _tune_plan(graph, plan, options, level, device, backend, aten)
    except Exception as err:  # noqa: BLE001 — tuning is an optimisation: never the reason a graph fails
        logs.log("tune", "%s: tuning failed, the rules choose: %s: %s", plan.name, type(err).__name__, err)
        return TuneOutcome(None, "rules", note=f"tuning failed: {type(err).__name__}: {err}"[:200])
    finally:
        plan.notes[:] = notes  # lowering candidates annotates the plan: keep only the final lowering's notes


def _tune_plan(graph, plan, options: LoweringOptions, level: str, device, backend: str, aten) -> TuneOutcome:
    t0 = time.perf_counter()
    if backend not in ("triton", "cpu") or options.flash_config or options.flash_split:
        return TuneOutcome(None, "rules")  # the interpreter's tiles, or the user's own choice
    space = schedule_space(graph, plan, options)
    if space is None or (backend == "cpu" and space.kind == "flash"):
        return TuneOutcome(None, "rules")
    static = all(v is not None for v in space.sizes.values())
    measurable = static and (level in LEVELS and device.type == "cuda" or level in CPU_LEVELS and backend == "cpu")
    if backend == "cpu" and not measurable:  # the model's terms are the GPU's: the rules choose
        return TuneOutcome(None, "rules")
    with real_tensors():
        ceilings = device_ceilings(device) if measurable else NOMINAL
    if not measurable:
        return TuneOutcome(choose_without_measuring(space, ceilings), "model", time.perf_counter() - t0)
    default_kernels = lower_plan_kernels(graph, plan, replace(options, schedule=space.default))
    source = canonical_source("\n".join(_source(tk, backend) for tk in default_kernels), default_kernels)
    dtypes = sorted({str(graph[n].dtype) for tk in default_kernels for n in tk.reads if n in graph.nodes})
    key = tuning_key(source, space.sizes, dtypes, {"name": ceilings.name, "kind": space.kind},
                     extra={k: list(v) for k, v in space.knobs.items()})  # a new knob invalidates old results
    bench = _Bench(graph, plan, options, device, aten, backend)
    try:
        with real_tensors():
            outcome = select_config(space, key, level, ceilings, bench.measure, TuningCache(), plan.name,
                                    levels=CPU_LEVELS if backend == "cpu" else None, misfit=bench.misfit)
    except TuningError as err:  # nothing measurable: the model's choice, and say why
        logs.log("tune", "%s: %s", plan.name, err)
        outcome = TuneOutcome(choose_without_measuring(space, ceilings), "model", note=str(err)[:200])
    outcome.seconds = time.perf_counter() - t0
    return outcome


def real_tensors():
    """Compilation runs inside AOTAutograd's fake-tensor mode; measuring needs real tensors
    (as Inductor's autotuning does, this leaves that mode for the duration)."""
    import contextlib

    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:  # a PyTorch without it: nothing to leave
        return contextlib.nullcontext()
    return unset_fake_temporarily()


def select_config(space, key: str, level: str, ceilings: Ceilings, measure, cache, name: str,
                  levels: dict | None = None, misfit=None) -> TuneOutcome:
    """A cache hit, else the search over the model's best candidates (stored for next time).
    `misfit(cfg)`: why a configuration does not fit the target (None: it does); a cached one
    that does not is discarded, and candidates that do not are never measured."""
    t0 = time.perf_counter()
    configs = space.configs()

    def accept(cfg: dict) -> str | None:
        if cfg not in configs:
            return "not a configuration of the kernel's schedule space"
        return misfit(cfg) if misfit is not None else None

    hit = cache.lookup(key, accept=accept)
    if hit is not None:
        return TuneOutcome(dict(hit["config"]), "cache", time.perf_counter() - t0, best_time=hit.get("time_s"))
    keep, budget = (levels or (MEMORY_LEVELS if space.kind == "memory" else LEVELS))[level]
    ranked = rank(space, ceilings, keep=keep)
    if misfit is not None:
        ranked = _fitting(ranked, rank(space, ceilings), keep, misfit, name)
    result = _search(ranked, measure, budget, name)
    cache.store(key, result.best, result.best_time, {"kind": space.kind, "candidates": len(ranked)})
    logs.log("tune", "%s: %s in %d measurements (%s)", name, describe(result.best), result.measured,
             ", ".join(f"{describe(c)}: {e}" for c, e in result.failures[:3]))
    failed = (f"{len(result.failures)} candidate(s) failed, first: {describe(result.failures[0][0])}: "
              f"{result.failures[0][1]}"[:200] if result.failures else "")
    return TuneOutcome(dict(result.best), "measured", time.perf_counter() - t0, measured=result.measured,
                       best_time=result.best_time, note=failed)


def _fitting(ranked: list, everything: list, keep: int, misfit, name: str) -> list:
    """The ranked candidates that fit the target, topped up to `keep` from the rest of the
    space in the model's order; a space with none that fits is a `TuningError`."""
    out, dropped = [], []
    chosen = [cfg for _, cfg in ranked]
    rest = [x for x in everything if x[1] not in chosen]
    for k, (predicted, cfg) in enumerate(ranked + rest):
        if k >= len(ranked) and len(out) >= keep:
            break
        why = misfit(cfg)
        if why:
            dropped.append((cfg, why))
        else:
            out.append((predicted, cfg))
    for cfg, why in dropped:
        logs.log("tune", "%s: candidate %s dropped: %s", name, describe(cfg), why)
    if not out:
        raise TuningError(f"no candidate fits the target: {describe(dropped[0][0])}: {dropped[0][1]}"
                          if dropped else "no candidate")
    return sorted(out, key=lambda x: x[0])


def _search(ranked, measure, budget, name):
    candidates = [Candidate(cfg, predicted) for predicted, cfg in ranked]
    bar = _progress(name, len(candidates))
    try:
        return search(candidates, measure, budget_s=budget, progress=bar)
    finally:
        if bar is not None:
            bar.close()


class _progress:
    """A one-line progress display on an interactive terminal (nothing otherwise)."""

    def __new__(cls, name, total):
        return super().__new__(cls) if sys.stderr.isatty() else None

    def __init__(self, name, total):
        self.name = name

    def __call__(self, done, total, best):
        best_us = f"{best * 1e6:.1f} us" if best is not None and math.isfinite(best) else "-"
        sys.stderr.write(f"\rtilefuse: tuning {self.name}: {done} runs, best {best_us}   ")
        sys.stderr.flush()

    def close(self):
        sys.stderr.write("\n")


class _Bench:
    """Builds the plan's kernels for a configuration (once) and times one launch of all of
    them on synthetic buffers of the plan's shapes (random floats; zeros for integer and
    boolean inputs, so that any index they hold is in range)."""

    def __init__(self, graph, plan, options, device, aten=None, backend="triton"):
        self.graph, self.plan, self.options, self.device, self.aten = graph, plan, options, device, aten
        self.backend = backend
        self.built: dict = {}
        self.buffers: dict = {}
        self.lowerings: dict = {}
        self.check = None
        if getattr(options, "limits", None) is not None:
            from ..backends.limits import kernel_check

            self.check = kernel_check(backend, options.limits)

    def lowered(self, cfg) -> list:
        """The plan's tile kernels under `cfg` (lowered once)."""
        key = tuple(sorted(cfg.items()))
        if key not in self.lowerings:
            self.lowerings[key] = lower_plan_kernels(self.graph, self.plan, replace(self.options, schedule=cfg))
        return self.lowerings[key]

    def misfit(self, cfg) -> str | None:
        """Why `cfg` does not fit the target (None: it does, or a library call is measured)."""
        if self.check is None or cfg.get("impl") == "aten":
            return None
        for tk in self.lowered(cfg):
            found = self.check(tk)
            if found is not None:
                return str(found)
        return None

    def _buffer(self, name, spec):
        import torch

        from ..ir import symbolic
        from ..ir.interpret import torch_dtype

        if name in self.buffers:
            return self.buffers[name]
        shape = tuple(int(symbolic.evaluate(d, {})) for d in spec.shape)
        strides = getattr(spec, "strides", None) or self.graph.output_strides.get(name)
        dtype = torch_dtype(spec.dtype)
        if strides is not None:
            t = torch.empty_strided(shape, tuple(int(symbolic.evaluate(s, {})) for s in strides), dtype=dtype,
                                    device=self.device)
        else:
            t = torch.empty(shape, dtype=dtype, device=self.device)
        if dtype.is_floating_point:
            t.normal_()
        else:
            t.zero_()
        self.buffers[name] = t
        return t

    def _kernels(self, cfg):
        key = tuple(sorted(cfg.items()))
        if key not in self.built and cfg.get("impl") == "aten":
            step = self.aten()
            for name in step.reads + step.writes:
                self._buffer(name, self.graph[name])
            self.built[key] = [step.launch]
            for _ in range(3):  # the library's first calls choose its algorithm and workspace
                self._run(self.built[key])
        if key not in self.built:
            launchers = []
            for tk in self.lowered(cfg):
                launchers.append(_load(tk, self.backend, getattr(self.check, "source", None)))
                for name in list(tk.reads) + list(tk.writes):
                    spec = tk.scratch.get(name) or self.graph[name]
                    self._buffer(name, spec)
            self.built[key] = launchers
            self._run(launchers)  # compiles: not timed
        return self.built[key]

    def _run(self, launchers):
        for launch in launchers:
            launch(self.buffers, {})

    def measure(self, cfg) -> float:
        """One sample: the median of 5 launches, each timed by its own events (a clock or
        cache hiccup in one launch does not make a good configuration look bad)."""
        import torch

        launchers = self._kernels(cfg)
        if self.backend == "cpu":  # host time; the kernels run synchronously
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                self._run(launchers)
                times.append(time.perf_counter() - t0)
            return sorted(times)[2]
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(5)]
        for start, end in events:
            start.record()
            self._run(launchers)
            end.record()
        events[-1][1].synchronize()
        times = sorted(start.elapsed_time(end) for start, end in events)
        return times[len(times) // 2] / 1e3


def canonical_source(source: str, kernels) -> str:
    """`source` with the names that differ between kernels identical in all else — their own
    names and their buffers' — replaced by positional ones, so that one tuning result serves
    every copy of a kernel (the q, k and v projections of a layer; every layer of a model)."""
    import re

    mapping: dict[str, str] = {}
    for tk in kernels:
        for name in [tk.name] + [p.name for p in tk.params if p.kind == "buffer"] + list(tk.scratch):
            mapping.setdefault(name, f"n{len(mapping)}")
    if not mapping:
        return source
    names = "|".join(re.escape(n) for n in sorted(mapping, key=len, reverse=True))
    # a buffer appears as itself, as `ptr_<name>` and in its run-time stride parameters
    pattern = re.compile(rf"\b(ptr_)?({names})(?=\b|_)")
    return pattern.sub(lambda m: (m.group(1) or "") + mapping[m.group(2)], source)


def _source(tk, backend: str) -> str:
    if backend == "cpu":
        from ..backends import cpu

        return cpu.generate(tk)
    return generate(tk, interpret=False)


def _load(tk, backend: str, printed=None):
    if backend == "cpu":
        from ..backends import cpu

        return cpu.load_kernel(tk, (printed and printed(tk)) or cpu.generate(tk))
    return load_kernel(tk, generate(tk, interpret=False), False)


__all__ = ["tune_plan", "select_config", "TuneOutcome", "device_ceilings", "LEVELS"]
