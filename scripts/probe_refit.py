"""Shared memory of the refit test's kernel per tile and stage count (a diagnostic)."""
import torch
import triton
from test_launch_refit_gpu import _product

m, n, k = 300, 260, 1000
a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
b = torch.randn(k, n, device="cuda").to(torch.bfloat16)
c = torch.empty(m, n, device="cuda")
for bm, bn, bk in ((128, 256, 128), (256, 256, 128), (256, 256, 64), (128, 128, 128)):
    for st in (1, 2, 3, 4, 5):
        try:
            ck = _product[(1, 1)](a, b, c, m, n, k, BM=bm, BN=bn, BK=bk, num_warps=8, num_stages=st)
            print(bm, bn, bk, st, "shared", ck.metadata.shared, flush=True)
        except Exception as e:
            print(bm, bn, bk, st, type(e).__name__, str(e)[:100], flush=True)
