"""Autotuning on the GPU: each workload compiled with TILEFUSE_AUTOTUNE=0 (rules / cost model)
and =1 (measured search), next to cuBLAS (torch.mm / F.linear in eager) and Inductor, with the
tuning time per kernel; then, in a second process with the same cache, the warm compile
(which must measure nothing).

    PYTHONPATH=src:scripts python scripts/bench_tuning.py --out DIR [--warm]
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.bench.timing import measure


def matmul(a, b):
    return a @ b


def gelu_linear(x, w, b):
    return F.gelu(x @ w + b)


def attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v


def cases():
    bf = dict(device="cuda", dtype=torch.bfloat16)
    yield "matmul 4096³", matmul, (torch.randn(4096, 4096, **bf), torch.randn(4096, 4096, **bf)), 2 * 4096**3
    yield ("gelu(x@w+b) 8192×4096×4096", gelu_linear,
           (torch.randn(8192, 4096, **bf), torch.randn(4096, 4096, **bf), torch.randn(4096, **bf)), 2 * 8192 * 4096**2)
    yield ("attention 4,32,4096,128", attention, tuple(torch.randn(4, 32, 4096, 128, **bf) for _ in range(3)),
           4 * 4 * 32 * 4096**2 * 128)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--warm", action="store_true", help="second process: tuning must come from the cache")
    p.add_argument("--cases", default="", help="comma-separated name prefixes (default: all)")
    args = p.parse_args()
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    rows = []
    for name, fn, inputs, flops in cases():
        if wanted and not any(name.startswith(w) for w in wanted):
            continue
        peers = {} if args.warm else {"eager (cuBLAS)": fn, "inductor": torch.compile(fn)}
        for level in (["1"] if args.warm else ["0", "1"]):
            torch._dynamo.reset()
            t0 = time.perf_counter()
            rep = tilefuse.explain(fn, *inputs, autotune=level)
            compile_s = time.perf_counter() - t0
            notes = [n for k in rep.kernels for n in k.notes if "schedule" in n or "ATen" in n]
            tune_s = sum(k.tune_seconds for k in rep.kernels)
            torch._dynamo.reset()
            peers[f"tilefuse autotune={level}"] = tilefuse.compile(fn, autotune=level)
            rows.append({"case": name, "level": level, "compile_s": compile_s, "tune_s": tune_s, "schedule": notes})
            print(json.dumps(rows[-1]), flush=True)
        for peer, f in peers.items():
            f(*inputs)
            ms = measure(f, inputs, "cuda", budget_s=0.3)["p50_ms"]
            rows.append({"case": name, "backend": peer, "ms": ms, "tflops": flops / ms / 1e9})
            print(json.dumps(rows[-1]), flush=True)
    with open(f"{args.out}/tuning{'-warm' if args.warm else ''}.json", "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
