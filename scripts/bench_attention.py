"""Attention on the GPU: tilefuse on naive PyTorch next to SDPA (flash, cuDNN), FlexAttention
(compiled, same variant) and Inductor on the same naive code, in one run.

    PYTHONPATH=src python scripts/bench_attention.py --out DIR

Prints a table and writes attention.json / attention.md into DIR. TFLOP/s counts 4·B·H·Sq·Sk·D
(halved for causal; the sliding window counts dense-equivalent work, as FlexAttention reports it);
decode reports TB/s of K and V read. `--cases causal_tril,window_tensor` picks kinds.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.bench.timing import measure


def naive(kind, cap=20.0):
    def plain(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v

    def causal(q, k, v):
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        i = torch.arange(s.shape[-2], device=q.device)[:, None]
        j = torch.arange(s.shape[-1], device=q.device)[None, :]
        return torch.softmax(torch.where(j > i, float("-inf"), s), dim=-1) @ v

    def softcap(q, k, v):
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        return torch.softmax(torch.tanh(s / cap) * cap, dim=-1) @ v

    def masked_by(mask):
        """The mask read from a tensor made before compiling (True where masked), applied as
        nanoGPT's `masked_fill` does."""
        def fn(q, k, v):
            s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
            return torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1) @ v
        return fn

    def sdpa_with(keep):
        """A boolean mask handed to SDPA (gpt-fast's spelling): on CUDA PyTorch makes it a
        bias of 0 and -65504, a finite fill."""
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    if kind == "causal_sdpa_mask":
        return sdpa_with(~_tril(*MASK_SHAPE))
    if kind in MASKS:
        return masked_by(MASKS[kind](*MASK_SHAPE))
    return {"plain": plain, "causal": causal, "softcap": softcap, "decode": plain}[kind]


def _tril(sq, sk, device):
    return torch.tril(torch.ones(sq, sk, device=device)).view(1, 1, sq, sk) == 0


def _window(sq, sk, device):
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return ((j > i) | (i - j >= WINDOW)).view(1, 1, sq, sk)


#: masks read from tensors (nanoGPT's tril buffer, a precomputed window), by case
MASKS = {"causal_tril": _tril, "window_tensor": _window}
#: (queries, keys, device) of the masks `naive` builds: set per case
MASK_SHAPE = [0, 0, "cuda"]


#: the sliding window of `window_tensor` (keys i-255 .. i)
WINDOW = 256


def peers(kind, shape):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    if kind == "causal_sdpa_mask":
        out["sdpa-eager-mask"] = naive(kind)
    if kind not in ("softcap", "window_tensor"):
        def sdpa(backend):
            def run(q, k, v):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=kind in CAUSAL)
            return run
        out["sdpa-flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
        out["sdpa-cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention)
        b, h, sq, d = shape[0], shape[1], shape[2], shape[3]
        sk = shape[4] if len(shape) > 4 else sq
        if kind in CAUSAL:
            mask = create_block_mask(lambda b_, h_, qi, ki: qi >= ki, None, None, sq, sk)
            out["flex"] = lambda q, k, v: flex(q, k, v, block_mask=mask)
        elif kind == "window_tensor":
            mask = create_block_mask(lambda b_, h_, qi, ki: (qi >= ki) & (qi - ki < WINDOW), None, None, sq, sk)
            out["flex"] = lambda q, k, v: flex(q, k, v, block_mask=mask)
        elif kind == "softcap":
            out["flex"] = lambda q, k, v: flex(q, k, v, score_mod=lambda s, b_, h_, qi, ki: torch.tanh(s / 20.0) * 20.0)
        else:
            out["flex"] = lambda q, k, v: flex(q, k, v)
    except Exception as err:  # noqa: BLE001
        print("flex unavailable:", err)
    out["inductor"] = torch.compile(naive(kind))
    out["tilefuse"] = torch.compile(naive(kind), backend="tilefuse")
    if kind in ("causal_tril", "window_tensor", "causal_sdpa_mask"):  # the same program without the run-time block summary
        out["tilefuse-no-summary"] = torch.compile(naive(kind), backend="tilefuse", options={"block_summary": False})
    return out


CASES = [("plain", (4, 32, 4096, 128)), ("causal", (4, 32, 4096, 128)), ("softcap", (4, 32, 4096, 128)),
         ("plain", (8, 16, 4096, 64)), ("causal", (8, 16, 4096, 64)), ("decode", (32, 32, 1, 128, 8192)),
         ("causal_tril", (4, 32, 4096, 128)), ("window_tensor", (4, 32, 4096, 128)),
         ("causal_sdpa_mask", (4, 32, 4096, 128))]
#: the causal kinds (SDPA and FlexAttention peers run them as causal)
CAUSAL = ("causal", "causal_tril", "causal_sdpa_mask")
#: dense-equivalent work: the fraction of scores a masked variant computes
WORK = {"causal": 0.5, "causal_tril": 0.5, "causal_sdpa_mask": 0.5}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--cases", default="all")
    args = p.parse_args()
    rows = []
    wanted = None if args.cases == "all" else set(args.cases.split(","))
    for kind, shape in CASES:
        if wanted is not None and kind not in wanted:
            continue
        b, h, sq, d = shape[:4]
        sk = shape[4] if len(shape) > 4 else sq
        MASK_SHAPE[:] = [sq, sk, "cuda"]
        q = torch.randn(b, h, sq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, h, sk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ref = naive(kind)(q.double(), k.double(), v.double()) if sq * sk * b * h <= 2**28 else None
        flops = 4 * b * h * sq * sk * d * WORK.get(kind, 1.0)  # (window: dense-equivalent, as FlexAttention's)
        kv_bytes = 2 * b * h * sk * d * 2
        for name, fn in peers(kind, shape).items():
            torch._dynamo.reset() if name.startswith("tilefuse") else None
            try:
                t0 = time.perf_counter()
                out = fn(q, k, v)
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                m = measure(fn, (q, k, v), torch.device("cuda"))
                ms = m["p50_ms"]
                err = (out.double() - ref).abs().max().item() if ref is not None else float("nan")
                row = {"case": kind, "shape": list(shape), "backend": name, "ms": ms, "first_s": first,
                       "tflops": flops / ms / 1e9, "tbps": kv_bytes / ms / 1e9, "err": err}
            except Exception as e:  # noqa: BLE001
                row = {"case": kind, "shape": list(shape), "backend": name, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            if name == "tilefuse" and "error" not in row:
                try:
                    torch._dynamo.reset()
                    rep = tilefuse.explain(naive(kind), q, k, v)
                    row["kernels"] = [kk.kind for kk in rep.kernels]
                except Exception as e:  # noqa: BLE001
                    row["kernels"] = f"? {e}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_results(args.out, "attention", rows,
                  ["case", "B,H,Sq,D(,Sk)", "backend", "ms", "TFLOP/s", "KV TB/s", "max err vs fp64", "kernels"],
                  lambda r: [f"{r['ms']:.3f}", f"{r['tflops']:.0f}", f"{r['tbps']:.2f}", f"{r['err']:.1e}",
                             str(r.get("kernels", ""))])


def write_results(out: str, stem: str, rows: list, header: list, cells) -> None:
    """`rows` as `stem`.json and as a Markdown table `stem`.md in `out` (also printed): the
    first three columns are each row's case, shape and backend, the rest `cells(row)`, or the
    row's error."""
    os.makedirs(out, exist_ok=True)
    with open(f"{out}/{stem}.json", "w") as f:
        json.dump(rows, f, indent=1)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 3 + "---:|" * (len(header) - 3)]
    for r in rows:
        rest = [f"n/a: {r['error'][:80]}"] + [""] * (len(header) - 4) if "error" in r else cells(r)
        lines.append("| " + " | ".join([r["case"], str(r["shape"]), r["backend"], *rest]) + " |")
    with open(f"{out}/{stem}.md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))

if __name__ == "__main__":
    main()
