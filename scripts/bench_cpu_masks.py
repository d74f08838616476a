"""Attention with a mask from a captured tensor on the CPU (C++ kernels): the unmasked program,
a `tril` buffer (causal) and a 128-wide window from a bool buffer — as the index formulas they
are (the default), read as data with the block summary and without it — and Inductor on the
same code. Each variant is measured three times, interleaved;
the best median counts (a shared host is noisy).

    PYTHONPATH=src python scripts/bench_cpu_masks.py [--shape 1,8,2048,64]
"""
from __future__ import annotations

import argparse

import torch

from tilefuse.bench.timing import measure


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1,8,2048,64")
    args = p.parse_args()
    b, h, t, d = (int(x) for x in args.shape.split(","))
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d) for _ in range(3))
    tril = torch.tril(torch.ones(t, t)).view(1, 1, t, t)
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    window = ((j <= i) & (i - j < 128)).view(1, 1, t, t)

    def plain(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) / d ** 0.5, -1) @ v

    def causal_tril(q, k, v):
        s = q @ k.transpose(-1, -2) / d ** 0.5
        return torch.softmax(s.masked_fill(tril == 0, float("-inf")), -1) @ v

    def windowed(q, k, v):
        s = q @ k.transpose(-1, -2) / d ** 0.5
        return torch.softmax(s.masked_fill(~window, float("-inf")), -1) @ v

    compiled = {}
    for name, fn in (("plain", plain), ("tril", causal_tril), ("window128", windowed)):
        # the buffers are captured: by default their formulas (`index_constants`); read as data,
        # with the block summary and without it
        variants = {"tilefuse": {}} if name == "plain" else \
            {"tilefuse": {}, "tilefuse-data": {"index_constants": False},
             "tilefuse-data-no-summary": {"index_constants": False, "block_summary": False}}
        for label, options in variants.items():
            torch._dynamo.reset()
            c = torch.compile(fn, backend="tilefuse", options=options)
            err = (c(q, k, v) - fn(q, k, v)).abs().max().item()
            compiled[(name, label)] = (c, err)
        torch._dynamo.reset()
        c = torch.compile(fn)
        c(q, k, v)
        compiled[(name, "inductor")] = (c, float("nan"))
    best = {key: float("inf") for key in compiled}
    for _ in range(3):
        for key, (c, _) in compiled.items():
            best[key] = min(best[key], measure(c, (q, k, v), torch.device("cpu"))["p50_ms"])
    base = best[("plain", "tilefuse")]
    print(f"{'program':10s} {'backend':20s} {'ms':>8s} {'vs unmasked':>12s}")
    for (name, label), ms in best.items():
        print(f"{name:10s} {label:20s} {ms:8.2f} {base / ms:11.2f}x  err {compiled[(name, label)][1]:.1e}")


if __name__ == "__main__":
    main()
