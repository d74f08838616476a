"""The linear layers whole models are made of, one by one: tilefuse's kernels against Inductor's
and eager's at the shapes and in the layouts the model zoo uses (GPT-2's `Conv1D` addmm with a
(K, N) weight, `nn.Linear`'s (N, K) weight, odd vocabularies, epilogues: bias, GELU, residual,
soft-capping). Per case and backend: GPU kernel time per call (profiler) and the rate it
reaches; for tilefuse also its kernels' notes (the chosen schedule and what tuning measured).

    PYTHONPATH=src:scripts python scripts/probe_linear_layers.py --out OUT_DIR [--cases a,b]
"""
from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F

from profile_workload import profile


def gelu_tanh(x):  # Hugging Face's NewGELUActivation, as GPT-2 writes it
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _cases(dev, dt):
    def r(*shape):
        return torch.randn(*shape, device=dev, dtype=dt) * 0.05

    x768, x3072, x2048 = r(8192, 768), r(8192, 3072), r(4096, 2048)
    return {
        # name: (fn, inputs, flops)
        "gpt2_mlp_up_gelu": (lambda x, w, b: gelu_tanh(torch.addmm(b, x, w)),
                             (x768, r(768, 3072), r(3072)), 2 * 8192 * 768 * 3072),
        "gpt2_qkv": (lambda x, w, b: torch.addmm(b, x, w), (x768, r(768, 2304), r(2304)), 2 * 8192 * 768 * 2304),
        "gpt2_down_residual": (lambda h, w, b, res: res + torch.addmm(b, h, w),
                               (x3072, r(3072, 768), r(768), r(8192, 768)), 2 * 8192 * 768 * 3072),
        "linear_gelu": (lambda x, w, b: F.gelu(F.linear(x, w, b)), (x768, r(3072, 768), r(3072)),
                        2 * 8192 * 768 * 3072),
        "linear_bias": (lambda x, w, b: F.linear(x, w, b), (x768, r(2304, 768), r(2304)), 2 * 8192 * 768 * 2304),
        "head_50257": (lambda x, w: x @ w.t(), (x768, r(50257, 768)), 2 * 8192 * 768 * 50257),
        "head_softcap": (lambda x, w: torch.tanh((x @ w.t()) / 30.0) * 30.0, (x2048, r(32000, 2048)),
                         2 * 4096 * 2048 * 32000),
        "llama_gate_up": (lambda x, w1, w3: F.silu(F.linear(x, w1)) * F.linear(x, w3),
                          (x2048, r(5632, 2048), r(5632, 2048)), 2 * 2 * 4096 * 2048 * 5632),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="")
    ap.add_argument("--backends", default="eager,inductor,tilefuse")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    import tilefuse

    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    cases = _cases("cuda", torch.bfloat16)
    chosen = args.cases.split(",") if args.cases else list(cases)
    results = {}
    for name in chosen:
        fn, inputs, flops = cases[name]
        ref = fn(*[t.double() for t in inputs])
        for backend in args.backends.split(","):
            torch._dynamo.reset()
            compiled = {"eager": fn, "inductor": torch.compile(fn),
                        "tilefuse": tilefuse.compile(fn, fallback="error")}[backend]
            out = compiled(*inputs)
            err = (out.double() - ref).abs().max().item()
            rows, wall, _ = profile(compiled, inputs, args.iters)
            us = sum(r["us"] for r in rows)
            results[f"{name}/{backend}"] = {"kernels_us": us, "wall_ms": wall, "tflops": flops / us / 1e6,
                                            "max_err": err, "strides": list(out.stride()), "kernels": rows}
            print(f"{name:20s} {backend:9s} {us:8.1f} µs  {flops / us / 1e6:6.0f} TFLOP/s  err {err:.2e}  "
                  f"strides {tuple(out.stride())}  "
                  + "; ".join(f"{r['kernel'][:48]} {r['us']:.1f}" for r in rows[:3]), flush=True)
            if backend == "tilefuse":
                torch._dynamo.reset()
                report = tilefuse.explain(fn, *inputs, verbose=True)
                with open(os.path.join(args.out, f"explain_{name}.txt"), "w") as f:
                    f.write(str(report))
                    for k in report.kernels:
                        f.write(f"\n# notes of {k.name}\n" + "\n".join(map(str, k.notes)))
    with open(os.path.join(args.out, "linear_layers.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
