"""Every schedule of a decode step's products (a few rows against an `nn.Linear` weight),
timed like the benchmark, with cuBLAS (`F.linear`) beside them and the cost model's pick:

    PYTHONPATH=src:scripts python scripts/probe_skinny_products.py --out DIR [--rows 1,8]

The shapes are gpt-fast's Llama-style layer at width 2048 (qkv, out, w1/w3, w2) and its
32000-word head. Prints, per shape, the fastest schedules, the model's first, and the weight's
bandwidth at each.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from sweep_space import sweep_first_plan

SHAPES = {"qkv": (3072, 2048), "out": (2048, 2048), "w13": (5632, 2048), "w2": (2048, 5632), "head": (32000, 2048)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--rows", default="1")
    p.add_argument("--shapes", default=",".join(SHAPES))
    args = p.parse_args()
    for m in (int(r) for r in args.rows.split(",")):
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            torch._dynamo.reset()
            rows = sweep_first_plan(lambda x, w: F.linear(x, w), (x, w), f"{name}-m{m}", args.out,
                                    keep=lambda cfg: cfg.get("impl", "generated") == "generated",
                                    cublas=lambda: F.linear(x, w))
            weight = n * k * 2
            for r in rows[:4] + [r for r in rows if r["config"] == "library"]:
                if "us" in r:
                    print(f"   {r['us']:7.1f} us  {weight / r['us'] / 1e6:5.2f} TB/s  {r['config']}")


if __name__ == "__main__":
    main()
