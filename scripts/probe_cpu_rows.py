"""Pointwise kernels over rows of several lengths on the CPU, against eager: a cross-entropy
backward as its decomposition spells it (values per row across a vocabulary), a bias with
GELU (a value per column) and a row scale (a value per row).

    PYTHONPATH=src python scripts/probe_cpu_rows.py

Prints per-call medians in microseconds for [64, V] inputs (each compiled column includes the
compiled graph's call, about 10 µs on a small host); docs/benchmarks.md, twenty-first section.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

import tilefuse  # noqa: F401 - registers the backend


def _median_us(fn, *args) -> float:
    fn(*args)
    times = []
    for _ in range(40):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def ce_back(logits, target, lse, g):
    p = torch.exp(logits.float() - lse[:, None])
    return ((p - F.one_hot(target, logits.shape[1]).float()) * g).bfloat16()


def bias_gelu(x, b):
    return F.gelu(x + b)


def row_scale(x, s):
    return x * s[:, None]


def main() -> int:
    for v in (32000, 50257, 768, 3072, 100, 1000):
        x = torch.randn(64, v).bfloat16()
        target, lse, g = torch.randint(0, v, (64,)), torch.logsumexp(x.float(), -1), torch.tensor(0.5)
        xf, b, s = torch.randn(64, v), torch.randn(v), torch.randn(64)
        parts = []
        for fn, args in ((ce_back, (x, target, lse, g)), (bias_gelu, (xf, b)), (row_scale, (xf, s))):
            torch._dynamo.reset()
            compiled = torch.compile(fn, backend="tilefuse")
            torch.testing.assert_close(compiled(*args), fn(*args), atol=1e-2, rtol=1e-2)
            parts.append(f"{fn.__name__} {_median_us(compiled, *args):6.0f} (eager {_median_us(fn, *args):6.0f})")
        print(v, " | ".join(parts), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
