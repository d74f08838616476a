"""Sums over the rows of [rows, features] tensors (a bias gradient's shape): eager, Inductor,
tilefuse and tilefuse with knob `column_tiles` off, in one process.

    PYTHONPATH=src python scripts/probe_column_sums.py [--shapes 128x768,512x768,512x3072,2048x768]
        [--device cpu] [--calls 50]

Prints each backend's median call in µs per shape (the CPU table of docs/benchmarks.md,
twenty-third section).
"""
from __future__ import annotations

import argparse
import time

import torch

import tilefuse  # noqa: F401 - registers the backend


def _median_us(fn, x, calls: int, sync) -> float:
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(calls):
        sync()
        start = time.perf_counter()
        fn(x)
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="128x768,512x768,512x3072,2048x768")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    fn = lambda g: g.sum(0)  # noqa: E731
    for shape in args.shapes.split(","):
        x = torch.randn(*map(int, shape.split("x")), device=args.device)
        torch._dynamo.reset()
        programs = {"eager": fn, "inductor": torch.compile(fn, backend="inductor"),
                    "tilefuse": torch.compile(fn, backend="tilefuse"),
                    "column_tiles off": torch.compile(fn, backend="tilefuse", options={"column_tiles": False})}
        for name, program in programs.items():
            torch.testing.assert_close(program(x), fn(x), rtol=1e-4, atol=1e-3)
        cells = "  ".join(f"{name} {_median_us(p, x, args.calls, sync):8.1f}" for name, p in programs.items())
        print(f"{shape:>10}: {cells} µs", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
