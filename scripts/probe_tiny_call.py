"""Per-call time of a tiny compiled graph on the CPU (two elementwise ops on 16 floats): eager,
Inductor and tilefuse in one process, rounds interleaved, the minimum of each backend's round
means. What it measures is the framework around a kernel: Dynamo's guards and frame,
AOTAutograd's wrapper, the compiled call.

    PYTHONPATH=src python scripts/probe_tiny_call.py [--rounds 7] [--calls 20000]
"""
import argparse
import time

import torch

import tilefuse  # noqa: F401  (registers the backend)


def f(x):
    return torch.relu(x * 2 + 1)


def per_call_us(fn, x, calls: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter_ns() - t0) / calls / 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=20000)
    args = p.parse_args()
    x = torch.randn(16)
    backends = {"eager": f, "inductor": torch.compile(f), "tilefuse": torch.compile(f, backend="tilefuse")}
    for fn in backends.values():  # compile, then the calls that generate tilefuse's straight-line call
        for _ in range(3):
            fn(x)
    best = {name: float("inf") for name in backends}
    for _ in range(args.rounds):
        for name, fn in backends.items():
            best[name] = min(best[name], per_call_us(fn, x, args.calls))
    for name, us in best.items():
        print(f"{name:9s} {us:6.2f} µs per call")


if __name__ == "__main__":
    main()
