"""Run workloads × backends and collect metrics: `run(BenchOptions(...)) -> report dict`.

For every (workload, backend) pair, on one device, dtype and size:

- compile latency: wall time of the first call in this process (`compile_s`; on-disk caches
  as the user has them); with `compile_latency=True` also cold and warm compile latency, each
  in a fresh process (`coldstart`): cold with empty cache directories, warm with the caches
  the cold run filled — and the artifact size (bytes the cold compile wrote);
  `compile_latency_only=True` measures only these (a part of a run, merged with --merge);
- compiles of the first call, and a dynamic-shape sweep (`sweep=True`): the batch or
  sequence axis at ½, ¾ and 1½ of its size, counting recompiles and the sizes served without
  one (coverage);
- autotune time (tilefuse: the kernels' tune_seconds of this compile);
- steady-state p50/p99 latency (`timing.measure`), throughput (GB/s against the workload's
  compulsory bytes, or TFLOP/s for matrix-product workloads), and the fraction of the
  device's measured roofline (`metrics.measure_ceilings`, once per run);
- peak memory of one steady-state call (`metrics.peak_memory`: CUDA allocator peak, or
  PyTorch's CPU allocator events through torch.profiler);
- generated kernels, extern calls, and the fusion ratio: core-ATen ops of the workload per
  launched kernel (generated + extern);
- numerical error: max |out − ref| where `ref` is the workload on float64 copies of the
  floating-point inputs, next to eager's own error; `correct` says whether the backend is no
  further from fp64 than eager (with the dtype's tolerance), the rule of DESIGN.md.

A backend that cannot be imported, compiled or run is reported with status "n/a" and the
reason; a metric that does not apply is None with its reason in `na`. Nothing is dropped and
nothing here raises for a backend failure. Compiles are independent: `torch._dynamo.reset()`
runs before every backend and after every workload.
"""
from __future__ import annotations

import gc
import importlib
import importlib.metadata
import math
import platform
import time
import traceback
from dataclasses import asdict, dataclass, field, replace

import torch

from ..config import closest_name
from . import metrics, timing
from .backends import (CACHED_BACKENDS, DEFAULT_BACKENDS, INDUCTOR_MODES, TILEFUSE_MODES, BackendUnavailable,
                       Compilers, Prepared, describe, prepare)
from .coldstart import compile_latency
from .report import progress_line
from .workload_base import DTYPES
from .workloads import WORKLOADS, Workload, get_workloads

__all__ = ["BenchOptions", "Result", "run", "max_abs_error", "within_tolerance",
           "DEFAULT_BACKENDS", "DTYPES", "GROUPS", "BackendUnavailable", "workload_size"]

GROUPS = ("kernels", "models", "all")

_describe = describe


@dataclass
class BenchOptions:
    workloads: list[str] | None = None          # None: every workload of `group`
    group: str | None = None                    # "kernels" (default), "models" or "all"
    layers: int | None = None                   # models: override the size's layer count
    backends: list[str] = field(default_factory=lambda: list(DEFAULT_BACKENDS))
    sizes: str | None = None                    # "quick" | "full"; default by device
    dtype: str | None = None                    # default: bfloat16 on CUDA, float32 on CPU
    device: str | None = None                   # default: cuda if available, else cpu
    budget_s: float | None = None               # timing budget per measurement
    flush_l2: bool = True
    seed: int = 0
    quiet: bool = False
    sweep: bool = True                          # dynamic-shape sweep (recompiles, coverage)
    compile_latency: bool = False               # cold/warm compile in fresh processes
    compile_latency_only: bool = False          # measure nothing else (a part for --merge)
    memory: bool = True                         # peak memory of one call
    ceilings: dict | None = None                # measured ceilings to reuse (else measured)

    def resolved(self, extra_backends=()) -> "BenchOptions":
        """Defaults filled in by device; every name checked (ValueError naming a bad one).
        `extra_backends`: names `run(compilers=...)` adds."""
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda requested but CUDA is not available")
        on_cuda = torch.device(device).type == "cuda"
        dtype = self.dtype or ("bfloat16" if on_cuda else "float32")
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
        sizes = self.sizes or ("full" if on_cuda else "quick")
        if sizes not in ("quick", "full"):
            raise ValueError(f"unknown sizes {sizes!r}; choose quick or full")
        if self.workloads is not None:
            _check_names("workload", self.workloads, WORKLOADS)
        group = self.group or "kernels"
        if group not in GROUPS:
            raise ValueError(f"unknown group {group!r}; choose from {', '.join(GROUPS)}")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"--layers must be at least 1, got {self.layers}")
        _check_backends(self.backends, extra_backends)
        return replace(self, group=group, backends=list(self.backends), sizes=sizes, dtype=dtype,
                       device=device,
                       compile_latency=self.compile_latency or self.compile_latency_only)


_OWN_BACKENDS = ("eager", *INDUCTOR_MODES, *TILEFUSE_MODES, "jax")


def known_backends(extra=()) -> list[str]:
    """Backend names `run` takes: its own, `extra`, and every registered Dynamo backend."""
    names = dict.fromkeys([*_OWN_BACKENDS, *extra])
    names.update(dict.fromkeys(torch._dynamo.list_backends(exclude_tags=())))
    return list(names)


def _check_names(kind: str, names: list[str], known, listing: str | None = None) -> None:
    if not names:
        raise ValueError(f"no {kind}s given")
    for name in names:
        if name not in known:
            close = closest_name(name, known)
            hint = f"did you mean {close!r}? " if close else ""
            raise ValueError(f"unknown {kind} {name!r}; {hint}choose from {listing or ', '.join(known)}")


def _check_backends(names: list[str], extra) -> None:
    own = ", ".join([*_OWN_BACKENDS, *extra])
    dynamo = ", ".join(torch._dynamo.list_backends())  # without debug and experimental ones
    _check_names("backend", names, known_backends(extra), f"{own}, or a Dynamo backend ({dynamo})")


@dataclass
class Result:
    workload: str
    backend: str
    size: list[int]
    status: str = "n/a"                 # "ok" or "n/a"
    reason: str = ""                    # why n/a
    scope: str = "backend"              # "workload": n/a for every backend (setup failed)
    detail: str = ""                    # traceback tail of the failure, for developers
    compile_s: float | None = None      # first call in this process
    compiles: int | None = None         # graphs compiled by the first call
    cold_compile_s: float | None = None
    warm_compile_s: float | None = None
    cold_compiles: int | None = None
    warm_cache_hit: bool | None = None  # the warm process wrote nothing new to the caches
    artifact_bytes: int | None = None   # bytes the cold compile wrote to its caches
    recompiles: int | None = None       # over the dynamic sweep
    dynamic_served: int | None = None   # sweep sizes run without a recompile
    dynamic_sizes: int | None = None    # sweep sizes tried (besides the benchmark size)
    dynamic_coverage: float | None = None
    autotune_s: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    host_ms: float | None = None        # (GPU) the time a call takes to return, kernels only enqueued
    samples: int | None = None
    throughput: float | None = None
    throughput_unit: str = ""
    gbps: float | None = None
    tflops: float | None = None
    roofline: float | None = None       # fraction of the measured roofline
    peak_mem_bytes: int | None = None
    max_abs_err: float | None = None
    eager_max_abs_err: float | None = None
    correct: bool | None = None
    kernels: int | None = None          # generated kernels; None = unknown
    externs: int | None = None          # library (ATen) calls
    aten_ops: int | None = None         # core-ATen ops of the workload
    fusion_ratio: float | None = None   # aten_ops / (kernels + externs)
    extern_ops: list = field(default_factory=list)
    na: dict = field(default_factory=dict)  # metric -> why it is None


def environment(device: str) -> dict:
    """Device name and versions for the report header."""
    dev = torch.device(device)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        name = f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)"
    else:
        name = _cpu_name() + f" ({torch.get_num_threads()} threads)"
    env = {"device": dev.type, "device_name": name, "torch": torch.__version__,
           "python": platform.python_version(), "platform": platform.platform(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    for pkg in ("triton", "tilefuse"):
        try:
            env[pkg] = importlib.metadata.version(pkg)
        except Exception:
            env[pkg] = getattr(_try_import(pkg), "__version__", "n/a")
    return env


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _try_import(name: str):
    try:
        return importlib.import_module(name)
    except Exception:
        return None


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    raise TypeError(f"output of type {type(out).__name__} is not a tensor or tuple of tensors")


def max_abs_error(out, ref) -> float:
    """max |out − ref| over all output tensors, in float64; inf if the structure differs."""
    outs, refs = _flat(out), _flat(ref)
    if len(outs) != len(refs) or any(o.shape != r.shape for o, r in zip(outs, refs)):
        return math.inf
    return max(((o.double() - r).abs().max().item() if o.numel() else 0.0)
               for o, r in zip(outs, refs))


def within_tolerance(err: float, eager_err: float, ref_scale: float, dtype: torch.dtype) -> bool:
    """No further from fp64 than eager is, up to a few ulps of the output's scale."""
    slack = 8 * torch.finfo(dtype).eps * max(ref_scale, 1.0)
    return bool(err <= 3 * eager_err + slack)  # False for nan


_NO_COMPILE = "eager does not compile"


def workload_size(w: Workload, opts: BenchOptions) -> list[int]:
    """The size `w` runs at under `opts`: its quick or full size, with a model's layer count
    (the third field) replaced by `opts.layers` when given."""
    return w.size(opts.sizes, opts.layers)


def _bench_pair(w: Workload, backend: str, inputs, ref, ref_scale: float, eager_err: float,
                aten_ops: int | None, ceilings: dict, opts: BenchOptions,
                compilers: Compilers | None) -> Result:
    size = workload_size(w, opts)
    r = Result(w.name, backend, size, eager_max_abs_err=eager_err, aten_ops=aten_ops)
    torch._dynamo.reset()
    stage = "compile"
    try:
        p: Prepared = prepare(backend, w, inputs, opts.device, compilers)
        stage = "first call"
        before = p.compiles() if p.compiles else 0
        t0 = time.perf_counter()
        with p.first_call():
            out = p.call(*p.args)
            timing.synchronize(opts.device)
        r.compile_s = time.perf_counter() - t0
        r.compiles = (p.compiles() - before) if p.compiles else None
        stage = "accuracy check"
        r.max_abs_err = max_abs_error(p.to_torch(out), ref)
        r.correct = within_tolerance(r.max_abs_err, eager_err, ref_scale, DTYPES[opts.dtype])
        del out
        stage = "timing"
        t = timing.measure(p.call, p.args, "cpu" if p.host_timed else opts.device,
                           budget_s=opts.budget_s, flush_l2=opts.flush_l2)
        r.status = "ok"
        r.p50_ms, r.p99_ms, r.samples = t["p50_ms"], t["p99_ms"], t["samples"]
        secs = r.p50_ms / 1e3
        r.throughput, r.throughput_unit = w.throughput(inputs, secs)
        r.gbps = w.bytes(inputs) / secs / 1e9
        r.tflops = w.flops(inputs) / secs / 1e12
        r.roofline = metrics.roofline_fraction(w.flops(inputs), w.bytes(inputs), secs, ceilings)
        if not p.host_timed:
            stage = "host time"
            r.host_ms = timing.host_time(p.call, p.args, opts.device)
        _after_timing(r, p, w, backend, opts)
    except BackendUnavailable as e:
        r.reason = str(e)
        return r
    except Exception as e:
        if r.status == "ok":  # a secondary metric failed: keep the timing, say why
            r.na["metrics"] = f"{stage}: {describe(e)}"
            return r
        r.reason = f"{stage}: {describe(e)}"
        r.detail = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-12:])
        return r
    return r


def _after_timing(r: Result, p: Prepared, w: Workload, backend: str, opts: BenchOptions):
    r.kernels, r.externs = p.info.get("kernels"), p.info.get("externs")
    r.extern_ops = p.info.get("extern_ops", [])
    if backend == "eager":
        for k in ("kernels", "fusion_ratio", "autotune_s", "recompiles", "artifact_bytes"):
            r.na[k] = _NO_COMPILE
    elif r.kernels is None:
        r.na["kernels"] = f"{backend} does not report its kernels"
    if r.kernels is not None and r.aten_ops:
        launched = r.kernels + (r.externs or 0)
        r.fusion_ratio = r.aten_ops / launched if launched else None
    if "autotune_s" in p.info:
        r.autotune_s = p.info["autotune_s"]
    elif backend != "eager":
        r.na["autotune_s"] = (f"{backend}: autotuning is inside its compile time, not reported "
                              "apart" if backend.startswith("inductor") else
                              f"{backend} does not report autotune time")
    stage = "peak memory"
    if opts.memory and backend == "jax":
        r.na["peak_mem_bytes"] = "JAX allocates outside PyTorch's allocator"
    elif opts.memory:
        r.peak_mem_bytes, how = metrics.peak_memory(p.call, p.args, opts.device)
        r.na["peak_mem_how"] = how
    if opts.sweep and p.compiles and w.dynamic_axis is not None:
        stage = "dynamic sweep"
        try:
            s = metrics.dynamic_sweep(p, w, r.size, opts.device, DTYPES[opts.dtype])
            r.recompiles, r.dynamic_served = s["recompiles"], s["served"]
            r.dynamic_sizes, r.dynamic_coverage = len(s["sizes"]), s["coverage"]
        except Exception as e:
            r.na["recompiles"] = f"{stage}: {describe(e)}"
    elif not opts.sweep:
        r.na.setdefault("recompiles", "sweep off (--no-sweep)")
    if opts.compile_latency and backend in CACHED_BACKENDS:
        _cold_warm(r, backend, opts)
    elif backend != "eager":
        r.na.setdefault("cold_compile_s", "run with --compile-latency" if backend in
                        CACHED_BACKENDS else f"caches of {backend} are not isolated")


def _compile_latency_pair(w: Workload, backend: str, opts: BenchOptions) -> Result:
    """Cold and warm compile latency alone, in fresh processes (no in-process timing)."""
    r = Result(w.name, backend, workload_size(w, opts))
    if backend not in CACHED_BACKENDS:
        r.reason = (_NO_COMPILE if backend == "eager" else
                    f"caches of {backend} are not isolated: no cold/warm compile latency")
        return r
    try:
        _cold_warm(r, backend, opts)
    except Exception as e:  # the parent's own failure (a child's is in r.na)
        r.reason = f"compile latency: {describe(e)}"
        return r
    if r.cold_compile_s is None:
        r.reason = r.na.get("cold_compile_s", "cold compile failed")
    else:
        r.status = "ok"
    return r


def _cold_warm(r: Result, backend: str, opts: BenchOptions) -> None:
    res = compile_latency(r.workload, backend, r.size, opts.dtype, opts.device)
    cold, warm = res["cold"], res["warm"]
    if "error" in cold:
        r.na["cold_compile_s"] = cold["error"]
        return
    r.cold_compile_s, r.cold_compiles = cold["first_call_s"], cold.get("compiles")
    r.artifact_bytes = res["artifact_bytes"]
    if "error" in warm:
        r.na["warm_compile_s"] = warm["error"]
    else:
        r.warm_compile_s = warm["first_call_s"]
        r.warm_cache_hit = res["warm_new_files"] == 0


def _selected(opts: BenchOptions) -> list[Workload]:
    if opts.workloads:
        return get_workloads(opts.workloads)
    return [w for w in get_workloads() if opts.group in ("all", w.group)]


def _release(device: str) -> None:
    torch._dynamo.reset()
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def run(options: BenchOptions | None = None, compilers: Compilers | None = None,
        console=None, workloads: list[Workload] | None = None, on_result=None) -> dict:
    """Benchmark every requested (workload, backend) pair: {"meta": ..., "results": [...]}.

    `workloads` (Workload objects) replaces the named ones of `options`, for custom
    programs or sizes; `compilers` adds or overrides backends by name; `on_result(partial)`
    is called with the report so far after every pair (a long run interrupted keeps what it
    measured)."""
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                               TextColumn, TimeElapsedColumn)

    opts = (options or BenchOptions()).resolved(extra_backends=compilers or ())
    workloads = list(workloads) if workloads else _selected(opts)
    dtype = DTYPES[opts.dtype]
    device = torch.device(opts.device)
    console = console or Console(stderr=True)
    results: list[Result] = []
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                        transient=True, disable=opts.quiet)
    with progress:
        task = progress.add_task("measuring the device's ceilings",
                                 total=len(workloads) * len(opts.backends))
        ceilings = opts.ceilings or ({} if opts.compile_latency_only else
                                     metrics.measure_ceilings(opts.device, dtype))
        if ceilings and not opts.quiet:
            progress.console.print(f"  ceilings: copy {ceilings['copy_gbps']:.1f} GB/s, "
                                   f"matmul {ceilings['matmul_tflops']:.3f} TFLOP/s")

        def record(r: Result) -> None:  # kept, saved (on_result), shown, counted
            results.append(r)
            if on_result is not None:
                on_result(_report(opts, workloads, ceilings, results))
            if not opts.quiet:
                progress.console.print(progress_line(asdict(r)))
            progress.advance(task)

        for w in workloads:
            progress.update(task, description=f"{w.name}: inputs and fp64 reference")
            size = workload_size(w, opts)
            try:
                reason = w.unsupported(device)
                if reason:
                    raise BackendUnavailable(reason)
                if opts.compile_latency_only:
                    for b in opts.backends:
                        progress.update(task, description=f"{w.name} · {b}: cold and warm compile")
                        record(_compile_latency_pair(w, b, opts))
                    continue
                torch.manual_seed(opts.seed)
                inputs = w.make_inputs(tuple(size), device, dtype)
                ref = w.reference(inputs)
                ref_scale = max(r.abs().max().item() for r in _flat(ref))
                eager_err = max_abs_error(w.program(w.fn)(*inputs), ref)
                compiling = [b for b in opts.backends if b != "eager"]
                aten_ops = metrics.count_aten_ops(w.fn, inputs) if compiling else None
            except Exception as e:
                reason = str(e) if isinstance(e, BackendUnavailable) else \
                    f"workload setup: {describe(e)}"
                for b in opts.backends:
                    record(Result(w.name, b, size, reason=reason, scope="workload"))
                _release(opts.device)
                continue
            for b in opts.backends:
                progress.update(task, description=f"{w.name} · {b}")
                r = _bench_pair(w, b, inputs, ref, ref_scale, eager_err, aten_ops, ceilings,
                                opts, compilers)
                record(r)
            del inputs, ref
            _release(opts.device)
    return _report(opts, workloads, ceilings, results)


def _report(opts: BenchOptions, workloads, ceilings: dict, results: list) -> dict:
    meta = environment(opts.device)
    on_cuda = opts.device.startswith("cuda")
    meta.update(dtype=opts.dtype, sizes=opts.sizes, backends=list(opts.backends),
                workloads=[w.name for w in workloads], flush_l2=opts.flush_l2,
                ceilings=ceilings, sweep=opts.sweep, compile_latency=opts.compile_latency,
                compile_latency_only=opts.compile_latency_only,
                timing=("CUDA events per call, median; L2 flushed before each call"
                        if on_cuda and opts.flush_l2 else
                        "CUDA events per call, median; warm L2" if on_cuda
                        else "perf_counter per call, median") + "; jax host-timed",
                memory=("torch.cuda.max_memory_allocated" if on_cuda else
                        "PyTorch CPU allocator events (torch.profiler)") if opts.memory else "off",
                group=opts.group, layers=opts.layers,
                sizes_by_workload={w.name: {"size": workload_size(w, opts),
                                            "fields": w.size_names} for w in workloads})
    return {"meta": meta, "results": [asdict(r) for r in results]}
