"""The derived attention backward on the GPU: the three products over recomputed scores
(dV = Pᵀ·dO, dQ = dS·K, dKᵀ = Qᵀ·dS; `fusion.recompute`; dK and dV in one kernel unless
`--separate`) per tile configuration, against
PyTorch's FlashAttention-2 backward (SDPA, `is_causal`) in the same process.

    PYTHONPATH=src python scripts/probe_attention_backward.py [--shape 8,12,1024,64] [--configs 128,64,8,3;64,64,4,2] [--separate]

The backward is written as `frontend.attention_chains` writes it (a `tril` mask, scale
1/√d, the logsumexp of the forward), compiled by tilefuse under each `flash_config`; a
configuration Triton cannot launch is reported with the shared memory it asked for.
Prints one line per configuration (µs per call, TFLOP/s of the 2.5× forward's work, max
difference from the fp32 math) and the SDPA backward's time.
"""
from __future__ import annotations

import argparse
import math
import re

import torch
import torch.nn.functional as F

import tilefuse


def backward_math(q, k, v, o, do, lse, keep):
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.exp(s.float() - lse)
    pw = p.to(q.dtype)
    dv = pw.transpose(-1, -2) @ do
    dp = do @ v.transpose(-1, -2)
    row = (do.float() * o.float()).sum(-1, keepdim=True)
    ds = (p * (dp.float() - row)).to(q.dtype).masked_fill(~keep, 0) * (1.0 / math.sqrt(q.shape[-1]))
    return ds @ k, ds.transpose(-1, -2) @ q, dv


def timed(fn, *args, iters=20) -> float:
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def kernel_times(fn, *args) -> list:
    """(kernel, µs per call) under the profiler, longest first."""
    from torch.profiler import ProfilerActivity, profile

    fn(*args)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn(*args)
        torch.cuda.synchronize()
    times = {}
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", 0) or getattr(evt, "self_cuda_time_total", 0)
        if t:
            times[evt.key[-28:]] = t / 5
    return sorted(times.items(), key=lambda kv: -kv[1])[:6]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8,12,1024,64")
    ap.add_argument("--configs", default="default;128,64,8,3;128,64,8,2;64,64,4,3;64,64,4,2;128,32,8,2;64,32,4,3;"
                                         "64,128,4,2;128,128,8,2;32,64,4,3")
    ap.add_argument("--sources", default="", help="write the kernels' sources (default tiles) into this folder")
    ap.add_argument("--separate", action="store_true",
                    help="dK and dV as two kernels, each computing the score tiles (the merge turned off)")
    args = ap.parse_args()
    if args.separate:
        import tilefuse.fusion.recompute as recompute

        recompute.merge_siblings = lambda steps, graph, note: steps
    b, h, t, d = (int(x) for x in args.shape.split(","))
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    keep = torch.tril(torch.ones(t, t, device="cuda", dtype=torch.bool))
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(d)
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1, keepdim=True)
    o = (torch.softmax(s, -1) @ v.float()).to(q.dtype)
    want = backward_math(*(x.float() for x in (q, k, v, o, do)), lse, keep)
    flops = 2.5 * 4 * b * h * t * t * d / 2  # causal: half the tiles
    for cfg in args.configs.split(";"):
        options = {"autotune": "0"} if cfg == "default" else {"flash_config": cfg, "autotune": "0"}
        torch._dynamo.reset()
        fn = tilefuse.compile(backward_math, options={**options, "fallback": "error"})
        try:
            got = fn(q, k, v, o, do, lse, keep)
            us = timed(fn, q, k, v, o, do, lse, keep)
        except Exception as err:  # noqa: BLE001 - a probe reports every failure and goes on
            text = str(err)
            need = re.search(r"Required: (\d+)", text)
            print(f"{cfg:>14}: failed ({'shared memory ' + need.group(1) if need else type(err).__name__}: "
                  f"{text.splitlines()[0][:160]})")
            continue
        err = max((g.float() - w).abs().max().item() for g, w in zip(got, want))
        print(f"{cfg:>14}: {us:8.1f} µs  {flops / us / 1e6:6.1f} TFLOP/s  max diff {err:.3g}")
        print("                " + ", ".join(f"{name} {t:.0f} µs" for name, t in kernel_times(fn, q, k, v, o, do, lse, keep)))
        if args.sources and cfg == args.configs.split(";")[0]:
            import os
            os.makedirs(args.sources, exist_ok=True)
            torch._dynamo.reset()
            report = tilefuse.explain(backward_math, q, k, v, o, do, lse, keep, options=options)
            for kern in report.kernels:
                with open(os.path.join(args.sources, kern.name + ".py"), "w") as f:
                    f.write(kern.source)
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))

    def sdpa_backward():
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        return torch.autograd.grad(out, (qs, ks, vs), do)

    def sdpa_forward():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    both, fwd = timed(sdpa_backward), timed(sdpa_forward)
    print(f"{'SDPA (flash)':>14}: forward+backward {both:.1f} µs, forward {fwd:.1f} µs, backward ≈ {both - fwd:.1f} µs "
          f"({flops / (both - fwd) / 1e6:.1f} TFLOP/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
