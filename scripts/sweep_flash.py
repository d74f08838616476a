"""Sweep the attention kernel's block configuration and split factor on the GPU (until the
autotuner chooses them).

    PYTHONPATH=src python scripts/sweep_flash.py [--out DIR] [--configs M,N,W,S;...] [--splits 1,2,4]

Prints one line per (case, configuration) and writes sweep.json into DIR.
"""
import argparse
import json

import torch
from bench_attention import naive

import tilefuse
from tilefuse.bench.timing import measure

PREFILL = [("plain", (4, 32, 4096, 128)), ("causal", (4, 32, 4096, 128)), ("softcap", (4, 32, 4096, 128)),
           ("plain", (8, 16, 4096, 64)), ("causal", (8, 16, 4096, 64))]
DECODE = [("decode", (32, 32, 1, 128, 8192)), ("decode", (1, 8, 1, 128, 32768))]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--configs", default="64,64,4,3;128,64,8,3;128,64,4,3;128,128,8,3;64,128,4,3")
    p.add_argument("--decode-configs", default="16,64,4,3;16,128,4,3;16,64,4,4")
    p.add_argument("--splits", default="0,1,2,4,8")
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--cases", default="plain,causal,softcap,decode")
    args = p.parse_args()
    rows = []
    for kind, shape in PREFILL + DECODE:
        if kind not in args.cases.split(","):
            continue
        b, h, sq, d = shape[:4]
        sk = shape[4] if len(shape) > 4 else sq
        q = torch.randn(b, h, sq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, h, sk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        flops = 4 * b * h * sq * sk * d / (2 if kind == "causal" else 1)
        kv_bytes = 2 * b * h * sk * d * 2
        configs = args.decode_configs if kind == "decode" else args.configs
        splits = [int(s) for s in args.splits.split(",")] if kind == "decode" else [0]
        for cfg in configs.split(";"):
            for split in splits:
                torch._dynamo.reset()
                row = {"case": kind, "shape": list(shape), "config": cfg, "split": split}
                try:
                    f = tilefuse.compile(naive(kind), flash_config=cfg, flash_split=split)
                    f(q, k, v)
                    ms = measure(f, (q, k, v), "cuda", budget_s=args.budget)["p50_ms"]
                    row.update(ms=ms, tflops=flops / ms / 1e9, tbps=kv_bytes / ms / 1e9)
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(f"{args.out}/sweep.json", "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
