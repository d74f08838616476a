"""Reductions under dynamic=True against the same code compiled for static shapes, and eager.

    python scripts/bench_dynamic_reductions.py [--device cpu|cuda] [--threads 1] [--rounds 3] [FILTER ...]

Each case is compiled twice (dynamic=True, warmed on another size first so that its graph is
really symbolic; and dynamic=False) and checked against eager. Timing runs in rounds that
alternate eager, static and dynamic (a burst of load from another process hits all three
alike); each column is the best round, in ms per call. FILTER keeps the cases whose name
contains one of the words.
"""
from __future__ import annotations

import argparse
import time

import torch

import tilefuse  # noqa: F401  (registers the backend)

CASES = [
    ("(3,8000).sum(0)", (3, 8000), lambda x: x.sum(0)),
    ("(8000,3).sum(1)", (8000, 3), lambda x: x.sum(1)),
    ("(8000,3).sum(0)", (8000, 3), lambda x: x.sum(0)),
    ("(3,8000).sum(1)", (3, 8000), lambda x: x.sum(1)),
    ("(64,513).softmax(-1)", (64, 513), lambda x: x.softmax(-1)),
    ("(1000,1000).mean(0)", (1000, 1000), lambda x: x.mean(0)),
    ("(1000,1000).var(1)", (1000, 1000), lambda x: x.var(1)),
    ("(3,8000).amax(0)", (3, 8000), lambda x: x.amax(0)),
    ("(17,100).log_softmax(0)", (17, 100), lambda x: torch.log_softmax(x, 0)),
]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_call_ms(f, x, device) -> float:
    for _ in range(3):
        f(x)
    _sync(device)
    t0 = time.perf_counter()
    f(x)
    _sync(device)
    n = max(5, min(2000, int(0.2 / max(time.perf_counter() - t0, 1e-6))))
    t0 = time.perf_counter()
    for _ in range(n):
        f(x)
    _sync(device)
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("filters", nargs="*")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"{'case':26} {'eager ms':>9} {'static ms':>10} {'dynamic ms':>11} {'dyn/static':>10}")
    for name, shape, fn in CASES:
        if args.filters and not any(f in name for f in args.filters):
            continue
        torch.manual_seed(0)
        x = torch.randn(*shape, device=device)
        torch._dynamo.reset()
        static = torch.compile(fn, backend="tilefuse", dynamic=False)
        dynamic = torch.compile(fn, backend="tilefuse", dynamic=True)
        dynamic(torch.randn(*(s + 1 for s in shape), device=device))
        for f in (static, dynamic):
            torch.testing.assert_close(f(x), fn(x), atol=1e-4, rtol=1e-4)
        e = s = d = float("inf")
        for _ in range(args.rounds):
            e = min(e, per_call_ms(fn, x, device))
            s = min(s, per_call_ms(static, x, device))
            d = min(d, per_call_ms(dynamic, x, device))
        print(f"{name:26} {e:9.4f} {s:10.4f} {d:11.4f} {d / s:10.2f}", flush=True)


if __name__ == "__main__":
    main()
