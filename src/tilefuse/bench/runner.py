"""Run workloads × backends and collect metrics: `run(BenchOptions(...)) -> report dict`.

For every (workload, backend) pair, on one device and dtype:

- compile latency: wall time of the first call (compilation happens there), synchronised;
  with TorchInductor's on-disk caches warm this is a cache-hit time, not a cold compile;
- steady-state p50/p99 latency (`timing.measure`) and throughput (GB/s against the
  workload's compulsory bytes, or TFLOP/s for matrix-product workloads);
- numerical error: max |out − ref| where `ref` is the eager function run on float64 copies
  of the same inputs on the same device, next to eager's own error in the benchmark dtype;
  `correct` says whether the backend is no further from fp64 than eager (with the dtype's
  tolerance), the rule of DESIGN.md;
- for tilefuse, the number of generated kernels and extern calls from `tilefuse.explain`.

A backend that cannot be imported, compiled or run is reported with status "n/a" and the
reason; nothing is dropped and nothing here raises for a backend failure. Compiles are
independent: `torch._dynamo.reset()` runs before every backend and after every workload.
"""
from __future__ import annotations

import gc
import importlib
import importlib.metadata
import math
import platform
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping

import torch

from . import timing
from .report import progress_line
from .workloads import Workload, get_workloads

DEFAULT_BACKENDS = ("eager", "inductor", "tilefuse")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: name -> (fn -> callable): extra or overriding backends, e.g. for tests
Compilers = Mapping[str, Callable[[Callable], Callable]]


class BackendUnavailable(Exception):
    """The backend cannot be used here; the message is the reason shown in the report."""


@dataclass
class BenchOptions:
    workloads: list[str] | None = None          # None: all
    backends: list[str] = field(default_factory=lambda: list(DEFAULT_BACKENDS))
    sizes: str | None = None                    # "quick" | "full"; default by device
    dtype: str | None = None                    # default: bfloat16 on CUDA, float32 on CPU
    device: str | None = None                   # default: cuda if available, else cpu
    budget_s: float | None = None               # timing budget per measurement
    flush_l2: bool = True
    seed: int = 0
    quiet: bool = False

    def resolved(self) -> "BenchOptions":
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
        get_workloads(self.workloads)  # validates names
        return BenchOptions(self.workloads, list(self.backends), sizes, dtype, device,
                            self.budget_s, self.flush_l2, self.seed, self.quiet)


@dataclass
class Result:
    workload: str
    backend: str
    size: list[int]
    status: str = "n/a"                 # "ok" or "n/a"
    reason: str = ""                    # why n/a
    detail: str = ""                    # traceback tail of the failure, for developers
    compile_s: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    samples: int | None = None
    throughput: float | None = None
    throughput_unit: str = ""
    gbps: float | None = None
    tflops: float | None = None
    max_abs_err: float | None = None
    eager_max_abs_err: float | None = None
    correct: bool | None = None
    kernels: int | None = None          # tilefuse only; None = unknown
    externs: int | None = None


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


def _describe(exc: BaseException) -> str:
    """One line: the exception types down the cause chain and the innermost message."""
    chain, e, seen = [], exc, set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = getattr(e, "inner_exception", None) or e.__cause__
    msg = next((ln.strip() for ln in str(chain[-1]).splitlines() if ln.strip()), "")
    text = " ← ".join(type(c).__name__ for c in chain) + (f": {msg}" if msg else "")
    return text if len(text) <= 300 else text[:297] + "..."


def compile_backend(name: str, fn: Callable, compilers: Compilers | None = None) -> Callable:
    """A callable running `fn` through backend `name` (compilation is lazy, at first call)."""
    if compilers and name in compilers:
        return compilers[name](fn)
    if name == "eager":
        return fn
    if name == "tilefuse":
        return _compile_tilefuse(fn)
    return torch.compile(fn, backend=name)  # inductor and any other registered Dynamo backend


def _compile_tilefuse(fn: Callable) -> Callable:
    try:
        importlib.import_module("tilefuse")  # importing the package registers the backend
    except Exception as e:
        raise BackendUnavailable(f"import tilefuse failed: {_describe(e)}") from e
    try:
        return torch.compile(fn, backend="tilefuse")
    except Exception as first:
        if type(first).__name__ != "InvalidBackend":
            raise BackendUnavailable(f"backend 'tilefuse' failed to load: {_describe(first)}")
    # not registered (the package is not installed): use the entry point's target directly
    try:
        api = importlib.import_module("tilefuse.api")
        return torch.compile(fn, backend=api.dynamo_backend)
    except Exception as e:
        raise BackendUnavailable("backend 'tilefuse' is not registered and tilefuse.api "
                                 f"is unusable: {_describe(e)}") from e


def _tilefuse_counts(fn: Callable, inputs) -> tuple[int | None, int | None]:
    try:
        report = importlib.import_module("tilefuse").explain(fn, *inputs)
        return len(report.kernels), len(report.externs)
    except Exception:
        return None, None


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


def _bench_pair(w: Workload, backend: str, inputs, ref, ref_scale: float, eager_err: float,
                opts: BenchOptions, compilers: Compilers | None) -> Result:
    r = Result(w.name, backend, list(w.sizes[opts.sizes]), eager_max_abs_err=eager_err)
    torch._dynamo.reset()
    stage = "compile"
    try:
        compiled = compile_backend(backend, w.fn, compilers)
        stage = "first call"
        t0 = time.perf_counter()
        out = compiled(*inputs)
        timing.synchronize(opts.device)
        r.compile_s = time.perf_counter() - t0
        stage = "accuracy check"
        r.max_abs_err = max_abs_error(out, ref)
        r.correct = within_tolerance(r.max_abs_err, eager_err, ref_scale, DTYPES[opts.dtype])
        del out
        stage = "timing"
        t = timing.measure(compiled, inputs, opts.device, budget_s=opts.budget_s,
                           flush_l2=opts.flush_l2)
    except BackendUnavailable as e:
        r.reason = str(e)
        return r
    except Exception as e:
        r.reason = f"{stage}: {_describe(e)}"
        r.detail = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-12:])
        return r
    r.status = "ok"
    r.p50_ms, r.p99_ms, r.samples = t["p50_ms"], t["p99_ms"], t["samples"]
    secs = r.p50_ms / 1e3
    r.throughput, r.throughput_unit = w.throughput(inputs, secs)
    r.gbps = w.bytes(inputs) / secs / 1e9
    r.tflops = w.flops(inputs) / secs / 1e12
    if backend == "tilefuse":
        r.kernels, r.externs = _tilefuse_counts(w.fn, inputs)
    return r


def _release(device: str) -> None:
    torch._dynamo.reset()
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def run(options: BenchOptions | None = None, compilers: Compilers | None = None,
        console=None, workloads: list[Workload] | None = None) -> dict:
    """Benchmark every requested (workload, backend) pair: {"meta": ..., "results": [...]}.

    `workloads` (Workload objects) replaces the named ones of `options`, for custom
    programs or sizes; `compilers` adds or overrides backends by name."""
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                               TextColumn, TimeElapsedColumn)

    opts = (options or BenchOptions()).resolved()
    workloads = list(workloads) if workloads else get_workloads(opts.workloads)
    dtype = DTYPES[opts.dtype]
    console = console or Console(stderr=True)
    results: list[Result] = []
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                        transient=True, disable=opts.quiet)
    with progress:
        task = progress.add_task("benchmarking", total=len(workloads) * len(opts.backends))
        for w in workloads:
            progress.update(task, description=f"{w.name}: inputs and fp64 reference")
            try:
                torch.manual_seed(opts.seed)
                inputs = w.make_inputs(w.sizes[opts.sizes], torch.device(opts.device), dtype)
                ref = w.fn(*[t.double() for t in inputs])
                ref_scale = max(r.abs().max().item() for r in _flat(ref))
                eager_err = max_abs_error(w.fn(*inputs), ref)
            except Exception as e:
                reason = f"workload setup: {_describe(e)}"
                for b in opts.backends:
                    results.append(Result(w.name, b, list(w.sizes[opts.sizes]), reason=reason))
                    progress.advance(task)
                _release(opts.device)
                continue
            for b in opts.backends:
                progress.update(task, description=f"{w.name} · {b}")
                r = _bench_pair(w, b, inputs, ref, ref_scale, eager_err, opts, compilers)
                results.append(r)
                if not opts.quiet:
                    progress.console.print(progress_line(asdict(r)))
                progress.advance(task)
            del inputs, ref
            _release(opts.device)
    meta = environment(opts.device)
    meta.update(dtype=opts.dtype, sizes=opts.sizes, backends=list(opts.backends),
                workloads=[w.name for w in workloads], flush_l2=opts.flush_l2,
                timing=("CUDA events per call, median; L2 flushed before each call"
                        if opts.device.startswith("cuda") and opts.flush_l2 else
                        "CUDA events per call, median; warm L2" if opts.device.startswith("cuda")
                        else "perf_counter per call, median"))
    return {"meta": meta, "results": [asdict(r) for r in results]}
