"""Attention forward + backward on the CPU (the C++ backend), naive PyTorch compiled by
tilefuse: the median of timed steps, for comparing two versions of the compiler in
interleaved processes. Cases: `causal` (a mask from positions), `alibi` (a distance bias from
positions, `slopes · (j − i)`, in fp32).

    PYTHONPATH=src python scripts/bench_cpu_attention_training.py [--case causal] [--shape 1,8,1024,64] [--steps 15]
"""
from __future__ import annotations

import argparse
import math
import time

import torch

import tilefuse  # noqa: F401  (registers the backend)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--case", choices=("causal", "alibi"), default="causal")
    p.add_argument("--shape", default="1,8,1024,64")
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args()
    b, h, s, d = (int(x) for x in args.shape.split(","))
    torch.manual_seed(0)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]

    def causal(q, k, v):
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        return torch.softmax(torch.where(j > i, float("-inf"), scores), dim=-1) @ v

    slopes = torch.tensor([2.0 ** (-8.0 * (x + 1) / h) for x in range(h)]).view(h, 1, 1)

    def alibi(q, k, v):
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        return torch.softmax(scores + slopes * (j - i), dim=-1) @ v

    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    d_out = torch.randn(b, h, s, d)
    compiled = torch.compile({"causal": causal, "alibi": alibi}[args.case], backend="tilefuse")

    def step():
        return torch.autograd.grad(compiled(q, k, v), (q, k, v), d_out)

    for _ in range(3):
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    times.sort()
    print(f"{args.case} fwd+bwd {args.shape}: median {times[len(times) // 2] * 1e3:.2f} ms, best {times[0] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
