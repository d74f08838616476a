"""Pointwise kernels over rows of columns on the CPU — `cat`/`stack` along the last dim, sin/cos,
a batch norm's values per channel — tilefuse's C++ kernels against eager and Inductor, per call
(median of many calls, backends alternating in rounds).

    PYTHONPATH=src python scripts/bench_cpu_columns.py [--threads 1]

Cases: Hugging Face's RoPE (`rotate_half`, a `cat` of two halves), gpt-fast's RoPE (a `stack`
of the rotated pairs), a `stack` of three values, a `cat` of `sin` and `cos` of unequal widths,
an inference batch norm with a residual and ReLU over channels-last images, and `tan`, `log1p`,
`asinh`, `log2` of 2**18 floats (libmvec's vector variants where the host has them).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_rope(q, cos, sin):
    return q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)


def stack3(a, b, c):
    return torch.stack([a * 2, b + 1, c - a], -1)


def sin_cos_cat(a, b):
    return torch.cat([a.sin(), b.cos()], -1)


def _batch_norm(channels: int):
    bn = torch.nn.BatchNorm2d(channels).eval()
    with torch.no_grad():
        bn.running_mean.normal_(), bn.running_var.uniform_(0.5, 2), bn.weight.normal_(), bn.bias.normal_()

    @torch.no_grad()
    def bn_add_relu(x, r):
        return torch.relu(bn(x) + r)

    return bn_add_relu


def cases():
    from tilefuse.bench.zoo.gptfast import apply_rotary_emb  # gpt-fast's own spelling

    b, h, t, d = 8, 8, 256, 64
    return [("HF RoPE (cat of halves)", hf_rope, (torch.randn(b, h, t, d), torch.randn(b, t, d), torch.randn(b, t, d))),
            ("gpt-fast RoPE (stack of pairs)", apply_rotary_emb, (torch.randn(b, t, h, d), torch.randn(t, d // 2, 2))),
            ("stack of three", stack3, tuple(torch.randn(64, 1024) for _ in range(3))),
            ("cat of sin and cos, widths 24 and 40", sin_cos_cat, (torch.randn(4096, 24), torch.randn(4096, 40))),
            ("batch norm + add + ReLU, NHWC 2x64x56x56", _batch_norm(64),
             tuple(torch.randn(2, 64, 56, 56).to(memory_format=torch.channels_last) for _ in range(2)))] + \
        [(f"{fn.__name__} of 2**18 floats", fn, (torch.rand(1 << 18) + 0.1,))
         for fn in (torch.tan, torch.log1p, torch.asinh, torch.log2)]


def _median_us(fn, args, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args(argv)
    sys.path.append(os.path.join(os.path.dirname(__file__), "..", "src"))  # (after PYTHONPATH: an A/B tree there wins)
    import tilefuse

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{torch.get_num_threads()} thread(s); median µs per call (best round)")
    print(f"{'case':40s} {'eager':>9s} {'inductor':>9s} {'tilefuse':>9s}  vs inductor")
    for name, fn, inputs in cases():
        torch._dynamo.reset()
        programs = {"eager": fn, "inductor": torch.compile(fn), "tilefuse": tilefuse.compile(fn, fallback="error")}
        for p in programs.values():
            for _ in range(5):
                p(*inputs)
        torch.testing.assert_close(programs["tilefuse"](*inputs), fn(*inputs))
        best = {k: float("inf") for k in programs}
        for _ in range(args.rounds):
            for k, p in programs.items():
                best[k] = min(best[k], _median_us(p, inputs, args.calls))
        print(f"{name:40s} {best['eager']:9.1f} {best['inductor']:9.1f} {best['tilefuse']:9.1f}  "
              f"{best['inductor'] / best['tilefuse']:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
