"""On a CUDA machine: do tilefuse's kernel names reach the GPU timeline, and does compiling
leave the process's environment alone?

    PYTHONPATH=src python scripts/gpu_profile_names.py [--out DIR]

Compiles a small pre-norm GPT block (bf16) through tilefuse, prints `tilefuse.explain`'s
summary, runs the compiled block under `torch.profiler` with CPU and CUDA activities, and
reports which of the explained kernels appear as device kernels and as CPU ranges, and any
environment variable that changed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ENV_BEFORE = dict(os.environ)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import tilefuse  # noqa: E402


class Block(nn.Module):
    def __init__(self, d=256, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    block = Block().cuda().to(torch.bfloat16)
    x = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ex = tilefuse.explain(block, x, options={"autotune": "0"})
        print(ex)
        compiled = torch.compile(block, backend="tilefuse", options={"autotune": "0"})
        compiled(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            out = compiled(x)
            torch.cuda.synchronize()
        err = (out.float() - block.float()(x.float())).abs().max().item()
    device_kernels = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
    cpu_ranges = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU})
    names = [k.name for k in ex.kernels if k.kind not in ("aten-matmul", "empty")]
    changed = {k: (ENV_BEFORE.get(k), v) for k, v in os.environ.items() if ENV_BEFORE.get(k) != v}
    changed.update({k: (v, None) for k, v in ENV_BEFORE.items() if k not in os.environ})
    result = {
        "generated_kernels": names,
        "on_gpu_timeline": [n for n in names if any(n in d for d in device_kernels)],
        "missing_from_gpu_timeline": [n for n in names if not any(n in d for d in device_kernels)],
        "as_cpu_ranges": [n for n in names if n in cpu_ranges],
        "device_kernels": device_kernels,
        "environment_changed": changed,
        "max_abs_error_vs_fp32_eager": err,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "device_kernels"}, indent=1))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "profile_names.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
