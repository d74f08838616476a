"""Measurements beyond latency: the device's ceilings and the roofline fraction, peak memory,
the ATen op count of a workload (for the fusion ratio), the dynamic-shape sweep, and bytes
in a cache directory.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable

import torch

from . import timing


# ----------------------------------------------------------------------------- ceilings

def measure_ceilings(device: str, dtype: torch.dtype, budget_s: float = 0.2) -> dict:
    """The device's measured copy bandwidth (GB/s: bytes read + written by `dst.copy_(src)`)
    and matrix-product rate (TFLOP/s of `a @ b`, benchmark dtype; fp32 on CPU), once per run.
    Sizes: 256 MiB and 8192² on CUDA, 64 MiB and 1024² on CPU."""
    dev = torch.device(device)
    on_cuda = dev.type == "cuda"
    n_copy = (256 if on_cuda else 64) * 2**20 // 4
    src = torch.ones(n_copy, device=dev, dtype=torch.float32)
    dst = torch.empty_like(src)
    t = timing.measure(lambda a, b: b.copy_(a), (src, dst), dev, budget_s=budget_s,
                       flush_l2=False)
    copy_gbps = 2 * src.numel() * 4 / (t["p50_ms"] / 1e3) / 1e9
    del src, dst
    n = 8192 if on_cuda else 1024
    mm_dtype = dtype if on_cuda else torch.float32
    a = torch.randn(n, n, device=dev).to(mm_dtype)
    b = torch.randn(n, n, device=dev).to(mm_dtype)
    t = timing.measure(torch.mm, (a, b), dev, budget_s=budget_s, flush_l2=False)
    mm_tflops = 2 * n**3 / (t["p50_ms"] / 1e3) / 1e12
    return {"copy_gbps": copy_gbps, "matmul_tflops": mm_tflops,
            "how": f"copy_ of {n_copy * 4 // 2**20} MiB fp32; torch.mm {n}² {str(mm_dtype)[6:]}"}


def roofline_fraction(flops: float, nbytes: float, seconds: float, ceilings: dict) -> float | None:
    """Ideal time under the roofline (max of flops / matmul rate and bytes / copy bandwidth)
    over the measured time: 1.0 means at the device's measured ceiling."""
    peak_f = ceilings.get("matmul_tflops") or 0.0
    peak_b = ceilings.get("copy_gbps") or 0.0
    if seconds <= 0 or peak_f <= 0 or peak_b <= 0:
        return None
    ideal = max(flops / (peak_f * 1e12), nbytes / (peak_b * 1e9))
    return ideal / seconds


# ----------------------------------------------------------------------------- memory

@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (the profiler's C++ start/stop lines) for the block."""
    import sys

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def peak_memory(call: Callable, args: tuple, device: str) -> tuple[int | None, str]:
    """(bytes, how) for one steady-state call: the peak allocated above what was allocated
    before the call. CUDA: torch.cuda.max_memory_allocated. CPU: allocations and frees of
    PyTorch's CPU allocator recorded by torch.profiler (profile_memory), summed in time
    order; allocations outside PyTorch (JAX, a library's scratch) are not seen."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        call(*args)
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) - base, "torch.cuda.max_memory_allocated"
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call(*args)
    cur = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        cur += e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        peak = max(peak, cur)
    return peak, "torch.profiler CPU allocator events"


# ----------------------------------------------------------------------------- op count

def count_aten_ops(fn: Callable, inputs: tuple) -> int | None:
    """Core-ATen call_function nodes of `fn`'s forward graphs (after the decompositions
    AOTAutograd applies for tilefuse), summed over graph breaks; the numerator of every
    backend's fusion ratio. None if tracing fails."""
    import operator

    from torch._decomp import core_aten_decompositions
    from torch._functorch.aot_autograd import aot_module_simplified

    total = [0]

    def counting(gm, example_inputs):
        def fw(g, _):
            total[0] += sum(1 for n in g.graph.nodes
                            if n.op == "call_function" and n.target is not operator.getitem)
            return g.forward

        return aot_module_simplified(gm, example_inputs, fw_compiler=fw,
                                     decompositions=core_aten_decompositions())

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(fn, backend=counting)(*inputs)
    except Exception:
        return None
    finally:
        torch._dynamo.reset()
    return total[0]


# ----------------------------------------------------------------------------- dynamic sweep

def dynamic_sweep(prepared, workload, size, device, dtype) -> dict:
    """Call the already-compiled backend at the other sizes of `workload.sweep_sizes(size)`
    (fresh inputs each) and count compiles: {"sizes", "recompiles", "served" (sizes run
    without a new compile), "coverage" (served / other sizes)}."""
    sizes = workload.sweep_sizes(tuple(size))[1:]
    served, recompiles = 0, 0
    for s in sizes:
        before = prepared.compiles()
        inputs = workload.make_inputs(s, torch.device(device), dtype)
        prepared.call(*prepared.convert(inputs))
        timing.synchronize(device)
        new = prepared.compiles() - before
        recompiles += new
        served += new == 0
    return {"sizes": [list(s) for s in sizes], "recompiles": recompiles, "served": served,
            "coverage": served / len(sizes) if sizes else None}


# ----------------------------------------------------------------------------- cache bytes

def tree_bytes(path: str | os.PathLike) -> tuple[int, int]:
    """(files, bytes) under `path` (0, 0 if it does not exist)."""
    files = size = 0
    for root, _, names in os.walk(path):
        for n in names:
            try:
                size += (Path(root) / n).stat().st_size
                files += 1
            except OSError:
                pass
    return files, size


def tree_snapshot(path: str | os.PathLike) -> dict[str, int]:
    """{relative path: size} of the files under `path`."""
    out = {}
    for root, _, names in os.walk(path):
        for n in names:
            p = Path(root) / n
            try:
                out[str(p.relative_to(path))] = p.stat().st_size
            except OSError:
                pass
    return out
