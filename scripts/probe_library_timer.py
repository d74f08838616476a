"""Does the tuner's GPU timer see a library product as the benchmark does? The LM head's
product (8192 x 768 @ 768 x 50304, bf16) timed by `targets._CudaTimer` as cuBLAS, by CUDA
events in a loop, and compiled by tilefuse with the product forced to ATen and left to tuning.

    PYTHONPATH=src python scripts/probe_library_timer.py [M K N]
"""
from __future__ import annotations

import sys
import time

import torch

import tilefuse
from tilefuse.backends.targets import _CudaTimer
from tilefuse.bench.timing import measure


def main() -> int:
    m, k, n = (int(v) for v in sys.argv[1:4]) if len(sys.argv) > 3 else (8192, 768, 50304)
    dev = torch.device("cuda")
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    timer = _CudaTimer(dev)
    for name, fn in [("matmul out=", lambda: torch.matmul(a, w.t(), out=out)),
                     ("matmul", lambda: torch.matmul(a, w.t())),
                     ("F.linear", lambda: torch.nn.functional.linear(a, w))]:
        for _ in range(3):
            fn()
        samples = [timer(fn) * 1e6 for _ in range(6)]
        print(f"timer {name:12s}: " + " ".join(f"{s:.0f}" for s in samples) + f" us (cycles {timer.cycles})")
    for idle in (0.5, 3.0):  # the GPU idle before the sample, as while a tuner waits for compiles
        got = []
        for _ in range(3):
            time.sleep(idle)
            got.append(timer(lambda: torch.matmul(a, w.t(), out=out)) * 1e6)
        print(f"timer after {idle} s idle: " + " ".join(f"{s:.0f}" for s in got) + " us")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        torch.matmul(a, w.t(), out=out)
    torch.cuda.synchronize()
    print(f"loop matmul out=: {(time.perf_counter() - t0) / 20 * 1e6:.0f} us")

    from tilefuse.runtime import aten_matmul

    original, seen = aten_matmul.AtenMatmul._run, []

    def traced(self, z, a, b, out, bias=None):
        if len(seen) < 6:
            seen.append(1)
            va, vb = z.a.view(a), z.b.view(b)
            print(f"  library call: a {tuple(va.shape)} {va.stride()} {va.dtype}, b {tuple(vb.shape)} {vb.stride()} "
                  f"{vb.dtype}, out {tuple(out.shape)} {out.stride()} {out.dtype}, split {z.aligned_columns(out)}",
                  flush=True)
        return original(self, z, a, b, out, bias)

    aten_matmul.AtenMatmul._run = traced
    product = aten_matmul._product

    def product_traced(bias, a, b, alpha, out=None):
        if out is None:  # the copy path: the product made apart, then copied into the output
            print(f"  product copied: a {tuple(a.shape)} {a.stride()} {a.dtype}, b {tuple(b.shape)} {b.stride()} "
                  f"{b.dtype}", flush=True)
        return product(bias, a, b, alpha, out)

    aten_matmul._product = product_traced
    call = aten_matmul.AtenMatmul.__call__

    def call_traced(self, buffers, env):
        v = self.views
        print("  library step:", {n: (tuple(buffers[n].shape), buffers[n].stride(), buffers[n].dtype)
                                  for n in (v.a.buffer, v.b.buffer, v.out)}, flush=True)
        return call(self, buffers, env)

    aten_matmul.AtenMatmul.__call__ = call_traced

    def head(x, w):
        return x @ w.t()

    for opts in ({"matmul": "aten"}, {}):
        seen.clear()
        fn = torch.compile(head, backend="tilefuse", options=opts)
        fn(a, w)
        r = measure(fn, (a, w), dev)
        print(f"tilefuse {opts or 'tuned'}: p50 {r['p50_ms'] * 1e3:.0f} us")
    r = measure(head, (a, w), dev)
    print(f"eager: p50 {r['p50_ms'] * 1e3:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
