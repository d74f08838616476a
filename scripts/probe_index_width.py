"""Whether the flash kernel's 32-bit index arithmetic is right at the edge of 32 bits, on a GPU.

    PYTHONPATH=src:tests python scripts/probe_index_width.py [--out DIR] [--shapes 120,32,4096,128;132,32,4096,128]

For each (batch, heads, rows, head dim) shape, compiles naive attention
(`softmax(q @ k.T * s) @ v`, bf16) with tilefuse, prints whether each generated kernel's
program ids are 64-bit (`wide`) or 32-bit, runs it, and compares the last batch entry (the
highest addresses) against an fp32 reference. A shape whose tensors hold more than 2**31
elements must keep 64-bit program ids; one just below may take 32-bit ones. Writes
index_width.json into DIR.
"""
from __future__ import annotations

import argparse
import json
import math

import torch

import tilefuse
from lowered_plans import recorded_lowerings
from tilefuse.bench.timing import measure
from tilefuse.tile.ir import ProgramId


def attention(q, k, v):
    s = 1.0 / math.sqrt(q.shape[-1])
    return torch.softmax(q @ k.transpose(-2, -1) * s, dim=-1) @ v


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--shapes", default="120,32,4096,128;132,32,4096,128")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    results = []
    for text in args.shapes.split(";"):
        b, h, t, d = (int(x) for x in text.split(","))
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, t, d, device=args.device, dtype=torch.bfloat16) for _ in range(3))
        torch._dynamo.reset()
        kernels: list = []
        with recorded_lowerings(kernels):
            fn = torch.compile(attention, backend="tilefuse", dynamic=False)
            out = fn(q, k, v)
        if args.device == "cuda":
            torch.cuda.synchronize()
        widths = sorted({f"{kk.name}: {'wide' if any(isinstance(s, ProgramId) and s.wide for s in kk.body) else 'int32'}"
                         for kk in kernels})
        ref = attention(q[-1:].float(), k[-1:].float(), v[-1:].float())
        err = (out[-1:].float() - ref).abs().max().item()
        first = attention(q[:1].float(), k[:1].float(), v[:1].float())
        err_first = (out[:1].float() - first).abs().max().item()
        ms = measure(fn, [q, k, v], args.device, budget_s=1.0, min_samples=3)["p50_ms"]
        flops = 4 * b * h * t * t * d
        row = {"shape": [b, h, t, d], "elements": b * h * t * d, "over_2_31": b * h * t * d >= 2 ** 31,
               "kernels": widths, "max_err_last": err, "max_err_first": err_first,
               "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
        print(json.dumps(row), flush=True)
        results.append(row)
        del q, k, v, out, fn
        if args.device == "cuda":
            torch.cuda.empty_cache()
    with open(f"{args.out}/index_width.json", "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
