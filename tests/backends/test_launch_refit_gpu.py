"""On a GPU: a kernel whose software pipeline needs more shared memory than the device has
(Triton raises `OutOfResources` at its first launch) runs with fewer stages, with the right
result (`backends.triton.direct_launch`). Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from tilefuse.backends.triton.direct_launch import DirectLaunch  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@triton.jit
def _product(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :], mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def test_a_pipeline_too_deep_for_shared_memory_runs_shallower():
    m, n, k = 300, 260, 1000
    gen = torch.Generator(device="cuda").manual_seed(7)
    a = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    b = torch.randn(k, n, device="cuda", generator=gen).to(torch.bfloat16)
    c = torch.empty(m, n, device="cuda", dtype=torch.float32)
    tiles = {"BM": 128, "BN": 256, "BK": 128}  # 96 KiB of operands per stage: 5 stages need 480 KiB
    launch = DirectLaunch(_product, dict(tiles, num_warps=8, num_stages=5), tiles)
    launch(((m + 127) // 128, (n + 255) // 256), [a, b, c, m, n, k])
    torch.cuda.synchronize()
    assert launch.retries >= 1 and launch.options["num_stages"] < 5
    want = a.double() @ b.double()
    torch.testing.assert_close(c.double(), want, rtol=1e-2, atol=1e-2 * k ** 0.5)
