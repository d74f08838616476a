"""Steady-state latency of a callable: `measure(fn, inputs, device)`.

CUDA: CUDA events around every call after a warm-up, the way `triton.testing.do_bench`
does it. By default the L2 cache is flushed before every call (a 256 MiB buffer is
zeroed outside the timed region), so small workloads are timed from memory, not from a
warm L2; pass `flush_l2=False` for warm-cache numbers. Each sample includes whatever
host overhead the call has (guards, launches) when that overhead exceeds the GPU time.

CPU: a `time.perf_counter_ns` loop, one sample per call, after a warm-up.

`host_time(fn, inputs, device)` (CUDA): how long a call takes to return with the device idle,
the host's part of a step (what CUDA graphs remove).

Both run for about `budget_s` seconds, between `min_samples` and `max_samples` calls (on
CPU, a call slower than the budget gets fewer samples: sampling stops after
max(5·budget_s, 1 s)), and report the median (p50) and 99th percentile in milliseconds. Timings are never asserted
in tests; they depend on the machine.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

_L2_FLUSH_BYTES = 256 * 1024 * 1024


def _percentiles(samples_ms: Sequence[float]) -> dict:
    s = sorted(samples_ms)
    n = len(s)

    def q(p: float) -> float:  # linear interpolation, as numpy's default
        pos = p * (n - 1)
        lo = int(pos)
        hi = min(lo + 1, n - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    return {"p50_ms": q(0.50), "p99_ms": q(0.99), "min_ms": s[0],
            "mean_ms": sum(s) / n, "samples": n}


def measure(fn: Callable, inputs: Sequence[torch.Tensor], device: str | torch.device, *,
            budget_s: float | None = None, min_samples: int = 5, max_samples: int = 1000,
            warmup_s: float | None = None, flush_l2: bool = True) -> dict:
    """Time `fn(*inputs)`; returns {p50_ms, p99_ms, min_ms, mean_ms, samples}."""
    device = torch.device(device)
    if device.type == "cuda":
        return _measure_cuda(fn, inputs, device, 0.3 if budget_s is None else budget_s,
                             max(min_samples, 10), max_samples,
                             0.025 if warmup_s is None else warmup_s, flush_l2)
    return _measure_host(fn, inputs, 0.2 if budget_s is None else budget_s,
                         min_samples, max_samples, 0.02 if warmup_s is None else warmup_s)


def host_time(fn: Callable, inputs: Sequence, device: str | torch.device, calls: int = 21) -> float | None:
    """CUDA: the median time in milliseconds a call takes to return, each call started with
    the device idle — Python, guards, allocation and kernel launches, not the kernels (they
    are only enqueued). When it is close to the p50 time the step is bound by the host (a
    call that synchronises inside, `.item()`, counts the GPU's time too). None on CPU, where
    a call's time is all host."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    samples = []
    for _ in range(calls):
        torch.cuda.synchronize(device)
        t = time.perf_counter_ns()
        fn(*inputs)
        samples.append((time.perf_counter_ns() - t) / 1e6)
    torch.cuda.synchronize(device)
    return sorted(samples)[len(samples) // 2]


def _measure_host(fn, inputs, budget_s, min_samples, max_samples, warmup_s) -> dict:
    t0 = time.perf_counter()
    fn(*inputs)  # at least one warm-up call, more while within warmup_s
    while time.perf_counter() - t0 < warmup_s:
        fn(*inputs)
    samples: list[float] = []
    start = time.perf_counter()
    hard_stop = start + max(5 * budget_s, 1.0)  # slow calls: fewer than min_samples
    while len(samples) < max_samples:
        t = time.perf_counter_ns()
        fn(*inputs)
        samples.append((time.perf_counter_ns() - t) / 1e6)
        now = time.perf_counter()
        if now >= hard_stop or (len(samples) >= min_samples and now - start >= budget_s):
            break
    return _percentiles(samples)


def _measure_cuda(fn, inputs, device, budget_s, min_samples, max_samples, warmup_s,
                  flush_l2) -> dict:
    with torch.cuda.device(device):
        flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.int8, device=device) if flush_l2 else None
        fn(*inputs)
        torch.cuda.synchronize()
        # estimate the cost of one call (flush included) to size warm-up and repetitions
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            if flush is not None:
                flush.zero_()
            fn(*inputs)
        end.record()
        torch.cuda.synchronize()
        est_ms = max(start.elapsed_time(end) / 5, 1e-3)
        n_warm = max(1, min(100, int(warmup_s * 1e3 / est_ms)))
        n_rep = max(min_samples, min(max_samples, int(budget_s * 1e3 / est_ms)))
        for _ in range(n_warm):
            fn(*inputs)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
        for s, e in zip(starts, ends):
            if flush is not None:
                flush.zero_()
            s.record()
            fn(*inputs)
            e.record()
        torch.cuda.synchronize()
        result = _percentiles([s.elapsed_time(e) for s, e in zip(starts, ends)])
        result["l2_flushed"] = flush is not None
        return result


def synchronize(device: str | torch.device) -> None:
    """Wait for queued work on `device` (a no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
