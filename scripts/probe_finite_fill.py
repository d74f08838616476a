"""Per-kernel device time of SDPA with a boolean causal mask (a -65504 bias on CUDA) through
tilefuse: the block summary, the score bound's norm kernels and the flash kernel.

    PYTHONPATH=src python scripts/probe_finite_fill.py
"""
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import tilefuse  # noqa: F401  (registers the backend)

b, h, t, d = 4, 32, 4096, 128
keep = torch.tril(torch.ones(t, t, dtype=torch.bool, device="cuda"))
q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=keep), backend="tilefuse")
for _ in range(3):
    fn(q, k, v)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(10):
        fn(q, k, v)
    torch.cuda.synchronize()
for evt in sorted(prof.key_averages(), key=lambda e: -getattr(e, "self_device_time_total", 0))[:8]:
    print(f"{getattr(evt, 'self_device_time_total', 0) / 10:9.1f} us/call  {evt.key[:110]}")
