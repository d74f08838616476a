"""Attention forward + backward on the GPU: tilefuse on naive PyTorch (its derived flash
forward and backward) next to FlexAttention (compiled, the same variant as a score_mod or a
block mask) and SDPA's FlashAttention-2 where it applies, in one run.

    PYTHONPATH=src python scripts/bench_attention_training.py --out DIR [--cases plain,alibi] [--shapes 4,32,4096,128] [--inductor] [--profile]

A step is `out = attention(q, k, v)` then `autograd.grad(out, (q, k, v), dO)`. TFLOP/s count
3.5 · 4·B·H·S²·D (the forward's work and the backward's 2.5×; halved for causal). The error
column is the worst of dq, dk, dv on batch element 0 against an fp32 computation of the naive
program, relative to that gradient's largest magnitude; `eager-bf16` is eager PyTorch's own
error on the same element, the bar the compiled gradients are held to. Writes
attention_training.json and .md into DIR. `--configs` adds a tilefuse row per flash configuration
(every flash kernel of the step takes it). With `--profile`, each row also holds the device time
of every kernel of one step (`kernels`: name, calls, µs per step), printed under the row, so the
forward's and the backward's kernels are compared with the peers' by their own times.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

import tilefuse  # noqa: F401  (registers the backend)
from bench_attention import write_results  # (this script's folder is on the path)
from tilefuse.bench.timing import measure

CAP = 20.0


def naive(kind, seq, heads, device):
    """The variant as users write it, with any tensor it reads made before compiling."""
    i = torch.arange(seq, device=device)[:, None]
    j = torch.arange(seq, device=device)[None, :]
    tril = torch.tril(torch.ones(seq, seq, device=device)).view(1, 1, seq, seq)
    distance = (j - i).float()  # ALiBi's distance, a tensor
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], device=device).view(heads, 1, 1)

    def scores(q, k):
        return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])

    def plain(q, k, v):
        return torch.softmax(scores(q, k), dim=-1) @ v

    def causal(q, k, v):
        return torch.softmax(torch.where(j > i, float("-inf"), scores(q, k)), dim=-1) @ v

    def causal_tril(q, k, v):  # nanoGPT's buffer and masked_fill
        return torch.softmax(scores(q, k).masked_fill(tril == 0, float("-inf")), dim=-1) @ v

    def softcap(q, k, v):
        return torch.softmax(torch.tanh(scores(q, k) / CAP) * CAP, dim=-1) @ v

    def alibi(q, k, v):
        return torch.softmax(scores(q, k) + (slopes * distance).to(q.dtype), dim=-1) @ v

    def alibi_f32(q, k, v):  # the softmax in fp32, the bias not rounded
        return torch.softmax(scores(q, k).float() + slopes * distance, dim=-1).to(q.dtype) @ v

    return {"plain": plain, "causal": causal, "causal_tril": causal_tril,
            "softcap": softcap, "alibi": alibi, "alibi_f32": alibi_f32}[kind], slopes


def peers(kind, shape, inductor, configs=()):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, s, d = shape
    fn, slopes = naive(kind, s, h, "cuda")
    out = {}
    if kind in ("plain", "causal", "causal_tril"):
        def flash(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=kind != "plain")
        out["sdpa-flash"] = flash
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention)
        if kind in ("causal", "causal_tril"):
            mask = create_block_mask(lambda b_, h_, qi, ki: qi >= ki, None, None, s, s)
            out["flex"] = lambda q, k, v: flex(q, k, v, block_mask=mask)
        elif kind == "softcap":
            out["flex"] = lambda q, k, v: flex(q, k, v, score_mod=lambda x, b_, h_, qi, ki: torch.tanh(x / CAP) * CAP)
        elif kind in ("alibi", "alibi_f32"):
            flat = slopes.view(-1)
            out["flex"] = lambda q, k, v: flex(q, k, v, score_mod=lambda x, b_, h_, qi, ki: x + flat[h_] * (ki - qi))
        else:
            out["flex"] = lambda q, k, v: flex(q, k, v)
    except Exception as err:  # noqa: BLE001
        print("flex unavailable:", err)
    if inductor:
        out["inductor"] = torch.compile(fn)
    out["tilefuse"] = torch.compile(fn, backend="tilefuse")
    for cfg in configs:  # every flash kernel of the step (forward, dQ, dK/dV) with these tiles
        out[f"tilefuse[{cfg}]"] = torch.compile(fn, backend="tilefuse", options={"flash_config": cfg})
    return out, fn


def step_of(attention):
    def step(q, k, v, do):
        return torch.autograd.grad(attention(q, k, v), (q, k, v), do)
    return step


def relative_error(grads, ref):
    return max(((g[:1].float() - r).abs().max() / r.abs().max()).item() for g, r in zip(grads, ref))


CASES = ["plain", "causal", "causal_tril", "softcap", "alibi", "alibi_f32"]
SHAPES = [(4, 32, 4096, 128), (4, 32, 4096, 64)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--shapes", default=";".join(",".join(map(str, s)) for s in SHAPES))
    p.add_argument("--inductor", action="store_true", help="also Inductor on the naive code (materialises S×S)")
    p.add_argument("--profile", action="store_true", help="also the device time of each kernel of a step")
    p.add_argument("--configs", default="", help="also tilefuse with each flash_config, ';'-separated "
                   "('BLOCK_M,BLOCK_N,warps,stages'): with --profile, a sweep of each kernel's tiles")
    args = p.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    rows = []
    for shape in shapes:
        b, h, s, d = shape
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                   for _ in range(3))
        do = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        for kind in args.cases.split(","):
            runs, fn = peers(kind, shape, args.inductor, [c for c in args.configs.split(";") if c])
            one = [t[:1].detach().float().requires_grad_() for t in (q, k, v)]
            ref = torch.autograd.grad(fn(*one), one, do[:1].float())
            eager_one = [t[:1].detach().clone().requires_grad_() for t in (q, k, v)]
            eager_err = relative_error(torch.autograd.grad(fn(*eager_one), eager_one, do[:1]), ref)
            del one, eager_one
            flops = 3.5 * 4 * b * h * s * s * d * (0.5 if kind.startswith("causal") else 1.0)
            for name, attention in runs.items():
                torch._dynamo.reset() if name.startswith("tilefuse") else None
                row = {"case": kind, "shape": list(shape), "backend": name, "eager_bf16_err": eager_err}
                try:
                    step = step_of(attention)
                    t0 = time.perf_counter()
                    grads = step(q, k, v, do)
                    torch.cuda.synchronize()
                    row["first_s"] = time.perf_counter() - t0
                    row["err"] = relative_error(grads, ref)
                    del grads
                    m = measure(step, (q, k, v, do), torch.device("cuda"))
                    row.update(ms=m["p50_ms"], p99_ms=m["p99_ms"], tflops=flops / m["p50_ms"] / 1e9)
                    if args.profile:
                        from profile_workload import profile
                        kernels, _, _ = profile(step, (q, k, v, do), iters=5)
                        row["kernels"] = [dict(r, kernel=r["kernel"][:90]) for r in kernels[:8]]
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                print(json.dumps({k: x for k, x in row.items() if k != "kernels"}), flush=True)
                for r in row.get("kernels", []):
                    print(f"    {r['us']:9.1f} us  x{r['calls']:.0f}  {r['kernel']}", flush=True)
            del runs
            torch.cuda.empty_cache()
    write_results(args.out, "attention_training", rows,
                  ["case", "B,H,S,D", "backend", "fwd+bwd ms", "TFLOP/s", "grad err (eager bf16)", "first call s"],
                  lambda r: [f"{r['ms']:.3f}", f"{r['tflops']:.0f}", f"{r['err']:.1e} ({r['eager_bf16_err']:.1e})",
                             f"{r['first_s']:.1f}"])

if __name__ == "__main__":
    main()
