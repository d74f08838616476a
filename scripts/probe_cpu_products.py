"""Where a generated product beats the library on this CPU: one `a @ b` compiled by tilefuse with
`matmul="aten"` and with `matmul="generated"`, beside eager, per dtype and size.

    PYTHONPATH=src python scripts/probe_cpu_products.py

Prints per-call medians in microseconds (the compiled columns include the compiled graph's
call). The default tuning level races the two for each static product of at least 32³
multiply-adds (`tune.tuner.library_race`); this shows why: the winner depends on the host and
the dtype (docs/bench/2026-12-04-cpu-race/crossover.txt).
"""
from __future__ import annotations

import statistics
import time

import torch

import tilefuse  # noqa: F401 - registers the backend

SIZES = [(64, 64, 64), (64, 256, 64), (128, 128, 128), (256, 64, 256), (256, 256, 256), (512, 512, 512),
         (64, 2048, 64), (1024, 1024, 1024)]


def _median_us(fn, calls: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _product(a, b):
    return a @ b


def main() -> int:
    for dtype in (torch.bfloat16, torch.float32):
        for m, k, n in SIZES:
            a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
            calls = 100 if m * k * n > 2 ** 25 else 300
            res = {}
            for how in ("aten", "generated"):
                torch._dynamo.reset()
                f = torch.compile(_product, backend="tilefuse", options={"matmul": how})
                f(a, b)
                res[how] = _median_us(lambda: f(a, b), calls)
            eager = _median_us(lambda: _product(a, b), calls)
            print(f"{str(dtype)[6:]:9s} {m}x{k}x{n} macs 2^{(m * k * n).bit_length() - 1}: eager {eager:7.1f}  "
                  f"aten {res['aten']:7.1f}  generated {res['generated']:7.1f}  "
                  f"gen/aten {res['aten'] / res['generated']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
