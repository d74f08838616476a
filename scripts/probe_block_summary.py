"""Per-kernel GPU times of attention with a mask read from a tensor (nanoGPT's tril buffer,
a precomputed window), with and without the run-time block summary, and the generated
sources: `python scripts/probe_block_summary.py --out DIR`."""
from __future__ import annotations

import argparse
import math

import torch
from torch.profiler import ProfilerActivity, profile

import tilefuse


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--shape", default="4,32,4096,128")
    args = p.parse_args()
    b, h, t, d = (int(x) for x in args.shape.split(","))
    q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    tril = torch.tril(torch.ones(t, t, device="cuda")).view(1, 1, t, t) == 0

    def fn(q, k, v):
        s = q @ k.transpose(-1, -2) / math.sqrt(d)
        return torch.softmax(s.masked_fill(tril, float("-inf")), dim=-1) @ v

    outs = {}
    for summary in (True, False):
        torch._dynamo.reset()
        c = torch.compile(fn, backend="tilefuse", options={"block_summary": summary})
        for _ in range(3):
            outs[summary] = c(q, k, v)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                c(q, k, v)
            torch.cuda.synchronize()
        print(f"--- block_summary={summary}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))
        torch._dynamo.reset()
        rep = tilefuse.explain(fn, q, k, v, options={"block_summary": summary})
        with open(f"{args.out}/sources_{summary}.txt", "w") as f:
            for kern in rep.kernels:
                f.write(f"# ---- {kern.name} ({kern.kind})\n{kern.tile_ir}\n{kern.source}\n")


    print("max difference with and without the summary:", (outs[True].float() - outs[False].float()).abs().max().item())


if __name__ == "__main__":
    main()
