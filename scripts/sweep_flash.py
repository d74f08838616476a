"""Sweep the attention kernel's block configuration on the GPU (until the autotuner exists).

    PYTHONPATH=src python scripts/sweep_flash.py
"""
import torch
from bench_attention import naive

import tilefuse
from tilefuse.bench.timing import measure

plain, causal = naive("plain"), naive("causal")


CONFIGS = ["128,64,8,2", "128,64,8,3", "128,128,8,2", "64,64,4,3", "128,32,8,3", "64,128,4,2", "128,64,4,3"]
for name, fn in (("plain", plain), ("causal", causal)):
    for shape in ((4, 32, 4096, 128), (8, 16, 4096, 64)):
        q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * shape[0] * shape[1] * shape[2] ** 2 * shape[3] / (2 if name == "causal" else 1)
        for cfg in CONFIGS:
            torch._dynamo.reset()
            try:
                f = tilefuse.compile(fn, flash_config=cfg)
                f(q, k, v)
                ms = measure(f, (q, k, v), "cuda", budget_s=0.2)["p50_ms"]
                print(f"{name} {shape} {cfg}: {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{name} {shape} {cfg}: failed {type(e).__name__}: {str(e)[:120]}", flush=True)
