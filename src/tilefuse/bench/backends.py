"""Backends of the benchmark: how a workload is compiled, called, and counted.

`prepare(name, workload, inputs, device)` returns a `Prepared`: the callable to time, the
arguments it takes (the torch inputs, or for JAX the same values converted once to jax
arrays), how to turn its output back into torch tensors for the fp64 check, a compile
counter (Dynamo graphs compiled, or the jit cache size for JAX) and, after the first call,
kernel/extern counts and autotune time where the backend tells them.

Backends: `eager`; `inductor` (torch.compile default); `inductor-max-autotune` and
`inductor-max-autotune-no-cudagraphs` (GPU only; the first replays CUDA graphs, which copy
every input that is not a parameter into the graph's own buffers on each call — for a
memory-bound workload that copy can cost more than the kernels — the second times the tuned
kernels alone); `inductor-reduce-overhead` (CUDA graphs, no tuning);
`tilefuse` (`tilefuse.compile(fn, fallback="error")`, so that an internal failure is a
reported n/a, not a silent eager run); `tilefuse-reduce-overhead` (the same with
`mode="reduce-overhead"`: CUDA graphs, GPU only); `tilefuse-max-autotune` and
`tilefuse-max-autotune-no-cudagraphs` (the wide search, GPU only, as Inductor's); `jax` (jax.jit of the jax.numpy twin, when JAX is
importable); any other registered Dynamo backend by name. `BackendUnavailable` carries the
reason a backend cannot be used.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

DEFAULT_BACKENDS = ("eager", "inductor", "inductor-max-autotune", "tilefuse", "jax")
#: the models group: Inductor's default mode is the peer (max-autotune takes too long there)
MODEL_BACKENDS = ("eager", "inductor", "tilefuse")
#: backends whose compile latency and caches the cold/warm measurement knows how to isolate
CACHED_BACKENDS = ("inductor", "inductor-max-autotune", "inductor-max-autotune-no-cudagraphs",
                   "inductor-reduce-overhead", "tilefuse", "tilefuse-reduce-overhead", "tilefuse-max-autotune",
                   "tilefuse-max-autotune-no-cudagraphs", "jax")
#: backend name -> torch.compile mode
INDUCTOR_MODES = {"inductor": None, "inductor-max-autotune": "max-autotune",
                  "inductor-max-autotune-no-cudagraphs": "max-autotune-no-cudagraphs",
                  "inductor-reduce-overhead": "reduce-overhead"}
#: backend name -> tilefuse.compile mode
TILEFUSE_MODES = {"tilefuse": None, "tilefuse-reduce-overhead": "reduce-overhead",
                  "tilefuse-max-autotune": "max-autotune",
                  "tilefuse-max-autotune-no-cudagraphs": "max-autotune-no-cudagraphs"}

#: name -> (fn -> callable): extra or overriding backends, e.g. for tests
Compilers = Mapping[str, Callable[[Callable], Callable]]


class BackendUnavailable(Exception):
    """The backend cannot be used here; the message is the reason shown in the report."""


def compiled_program(workload, backend: str) -> Callable:
    """The workload's timed program (its `step` around the call, if any) with the call compiled
    by `backend` — "eager", "tilefuse" or "tilefuse-reduce-overhead", an Inductor mode's name,
    or any torch.compile backend —
    after a Dynamo reset; for the scripts that profile or time backends side by side."""
    import tilefuse

    torch._dynamo.reset()
    if backend == "eager":
        run = workload.fn
    elif backend in TILEFUSE_MODES:
        run = tilefuse.compile(workload.fn, mode=TILEFUSE_MODES[backend], fallback="error")
    elif backend in INDUCTOR_MODES:
        run = torch.compile(workload.fn, mode=INDUCTOR_MODES[backend])
    else:
        run = torch.compile(workload.fn, backend=backend)
    return workload.program(run)


def describe(exc: BaseException) -> str:
    """One line: the exception types down the cause chain and the innermost message."""
    chain, e, seen = [], exc, set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = getattr(e, "inner_exception", None) or e.__cause__
    msg = next((ln.strip() for ln in str(chain[-1]).splitlines() if ln.strip()), "")
    text = " ← ".join(type(c).__name__ for c in chain) + (f": {msg}" if msg else "")
    return text if len(text) <= 300 else text[:297] + "..."


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@dataclass
class Prepared:
    call: Callable
    args: tuple
    to_torch: Callable[[Any], Any] = lambda out: out
    #: total compiles so far (None: the backend does not compile)
    compiles: Callable[[], int] | None = None
    #: convert fresh torch inputs (other sizes of a sweep) to this backend's arguments
    convert: Callable[[tuple], tuple] = lambda inputs: tuple(inputs)
    #: host-timed even on CUDA (JAX: block_until_ready, no CUDA events)
    host_timed: bool = False
    #: context for the first call, which collects counts into `info`
    first_call: Callable[[], Any] = contextlib.nullcontext
    info: dict = field(default_factory=dict)


def prepare(name: str, workload, inputs: tuple, device: str,
            compilers: Compilers | None = None) -> Prepared:
    """The `Prepared` callable for backend `name`; raises `BackendUnavailable`."""
    program = workload.program  # the compiled fn, inside a step (training) where there is one
    if compilers and name in compilers:
        return _torch_prepared(program(compilers[name](workload.fn)), inputs)
    if name == "eager":
        return Prepared(program(workload.fn), tuple(inputs))
    if name == "jax":
        return _jax_prepared(workload, inputs, device)
    if name in TILEFUSE_MODES:
        mode = TILEFUSE_MODES[name]
        if mode and torch.device(device).type != "cuda":
            raise BackendUnavailable(f"{mode} is measured on GPUs only, as Inductor's" if "autotune" in mode
                                     else f"{mode} replays CUDA graphs: GPU only")
        return _tilefuse_prepared(workload, inputs, mode)
    if name in INDUCTOR_MODES:
        mode = INDUCTOR_MODES[name]
        if mode and torch.device(device).type != "cuda":
            raise BackendUnavailable(f"{mode} is measured on GPUs only (on a CPU it tunes "
                                     "little beyond the default and takes minutes)"
                                     if "autotune" in mode else
                                     f"{mode} replays CUDA graphs: GPU only")
        return _inductor_prepared(program(torch.compile(workload.fn, mode=mode)), inputs)
    try:
        compiled = torch.compile(workload.fn, backend=name)
    except Exception as e:
        raise BackendUnavailable(f"backend {name!r} unavailable: {describe(e)}") from e
    return _torch_prepared(program(compiled), inputs)


def _torch_prepared(compiled: Callable, inputs) -> Prepared:
    return Prepared(compiled, tuple(inputs), compiles=_dynamo_graphs)


# ----------------------------------------------------------------------------- inductor

_KERNEL_RE = re.compile(r"=\s*async_compile\.(?:triton|cpp_pybinding|cpp|cuda|halide)\(")
_EXTERN_RE = re.compile(r"\b(?:extern_kernels\.\w+|(?:torch\.ops\.)?aten\.\w+\.\w+)\(")
_STRING_RE = re.compile(r"'''.*?'''|\"\"\".*?\"\"\"", re.S)  # kernel sources
_COMMENT_RE = re.compile(r"#[^\n]*")


def count_inductor_code(sources: list[str]) -> tuple[int, int]:
    """(generated kernels, extern calls) in Inductor's output code (wrapper modules).

    Extern calls are counted in the whole module, not only in `call`: with CUDA graphs
    Inductor partitions the graph, and the calls sit in `partition_N` functions that `call`
    runs. Kernel sources (string literals), comments and the benchmark harness at the end
    are left out."""
    kernels = sum(len(_KERNEL_RE.findall(s)) for s in sources)
    externs = 0
    for s in sources:
        code = s.split("def benchmark_compiled_module", 1)[0]
        code = _COMMENT_RE.sub("", _STRING_RE.sub("", code))
        externs += len(_EXTERN_RE.findall(code))
    return kernels, externs


def _inductor_prepared(compiled: Callable, inputs) -> Prepared:
    prepared = Prepared(compiled, tuple(inputs), compiles=_dynamo_graphs)

    @contextlib.contextmanager
    def first_call():
        from unittest import mock

        from torch._inductor.graph import GraphLowering

        sources: list[str] = []
        with mock.patch.object(GraphLowering, "save_output_code", sources.append):
            yield
        if sources:  # also called on an FX-graph cache hit, with the cached code
            prepared.info["kernels"], prepared.info["externs"] = count_inductor_code(sources)

    prepared.first_call = first_call
    return prepared


# ----------------------------------------------------------------------------- tilefuse

def _tilefuse_prepared(workload, inputs, mode: str | None = None) -> Prepared:
    try:
        tilefuse = importlib.import_module("tilefuse")
        api = importlib.import_module("tilefuse.api")
    except Exception as e:
        raise BackendUnavailable(f"import tilefuse failed: {describe(e)}") from e
    try:
        compiled = tilefuse.compile(workload.fn, fallback="error", mode=mode)
    except Exception as e:
        raise BackendUnavailable(f"tilefuse.compile failed: {describe(e)}") from e
    prepared = Prepared(workload.program(compiled), tuple(inputs), compiles=_dynamo_graphs)

    @contextlib.contextmanager
    def first_call():
        # the compile reports `tilefuse.explain` collects, taken from this first compile so
        # that the autotune time is the real one (a later explain would hit the tune cache)
        sinks = getattr(api, "_report_sinks", None)
        reports: list = []
        if sinks is not None:
            sinks.append(reports)
        try:
            yield
        finally:
            if sinks is not None:
                sinks.remove(reports)
        if reports:
            kernels = [k for r in reports for k in r.kernels]
            prepared.info["kernels"] = len(kernels)
            prepared.info["externs"] = sum(len(r.externs) for r in reports)
            prepared.info["autotune_s"] = sum(getattr(k, "tune_seconds", 0.0) for k in kernels)
            prepared.info["extern_ops"] = sorted({str(t) for r in reports for _, t, _ in r.externs})

    prepared.first_call = first_call
    return prepared


# ----------------------------------------------------------------------------- jax

def jax_unavailable(device: str) -> str | None:
    """Why the jax backend cannot run on `device`, or None."""
    # XLA would otherwise take 75% of the GPU's memory at import and hold it for the rest of
    # the run: every later workload of every backend would run out of memory
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        jax = importlib.import_module("jax")
    except Exception as e:
        return f"JAX is not importable ({type(e).__name__}); pip install jax to compare XLA"
    want = "gpu" if torch.device(device).type == "cuda" else "cpu"
    try:
        jax.devices(want)
    except Exception:
        return f"JAX has no {want} device here (it has {jax.devices()[0].platform})"
    return None


def _to_jax(t: torch.Tensor, jax_device):
    import jax
    import jax.numpy as jnp

    if t.dtype == torch.bfloat16:
        arr = jnp.asarray(t.detach().float().cpu().numpy()).astype(jnp.bfloat16)
    else:
        arr = jnp.asarray(t.detach().cpu().numpy())
    return jax.device_put(arr, jax_device)


def _from_jax(out, device: str):
    import numpy as np

    if isinstance(out, (tuple, list)):
        return type(out)(_from_jax(o, device) for o in out)
    arr = np.asarray(out.astype("float32") if str(out.dtype) == "bfloat16" else out)
    return torch.from_numpy(arr.copy()).to(device)


def _jax_prepared(workload, inputs, device: str) -> Prepared:
    reason = jax_unavailable(device)
    if reason:
        raise BackendUnavailable(reason)
    import jax

    from .jax_workloads import JAX_FNS, JAX_NA

    if workload.name not in JAX_FNS:
        raise BackendUnavailable(JAX_NA.get(workload.name, "no jax.numpy twin of this workload"))
    jax_device = jax.devices("gpu" if torch.device(device).type == "cuda" else "cpu")[0]
    jitted = jax.jit(JAX_FNS[workload.name])

    def call(*args):
        return jax.block_until_ready(jitted(*args))

    def convert(ts):
        return tuple(_to_jax(t, jax_device) for t in ts)

    return Prepared(call, convert(inputs), to_torch=lambda out: _from_jax(out, device),
                    compiles=jitted._cache_size, convert=convert, host_timed=True)
