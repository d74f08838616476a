"""Host overhead per call of a compiled graph next to its GPU time (small decode, RMSNorm).

    PYTHONPATH=src python scripts/probe_overhead.py
"""
import time

import torch
from bench_attention import naive

import tilefuse
from tilefuse.bench.timing import measure


def host_us(fn, args, n=200):
    fn(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn(*args)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def rmsnorm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


cases = []
q = torch.randn(1, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(1, 8, 32768, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
cases.append(("decode 1,8,32768", naive("decode"), (q, k, v)))
x, w = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16), torch.randn(4096, device="cuda", dtype=torch.bfloat16)
cases.append(("rmsnorm 8x4096", rmsnorm, (x, w)))
for name, fn, args in cases:
    for backend in ("inductor", "tilefuse"):
        torch._dynamo.reset()
        f = torch.compile(fn, backend=backend if backend == "tilefuse" else "inductor")
        f(*args)
        gpu = measure(f, args, "cuda", budget_s=0.2)["p50_ms"] * 1e3
        print(f"{name} {backend}: p50 {gpu:.1f} us (events, L2 flushed), host {host_us(f, args):.1f} us/call", flush=True)
