"""On a GPU: a kernel whose software pipeline needs more shared memory than the device has
(Triton raises `OutOfResources` at its first launch) runs with fewer stages, with the right
result, and one that needs too much even at one stage raises after trying
(`backends.triton.direct_launch`). Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from tilefuse.backends.triton.direct_launch import DirectLaunch  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@triton.jit
def _product(a_ptr, b_ptr, c_ptr, M, N, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """c = a @ b for M, N multiples of the tiles and K of BK: unmasked loads, which Triton
    pipelines through shared memory (one buffer per stage)."""
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc)


def _operands(m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(7)
    a = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    b = torch.randn(k, n, device="cuda", generator=gen).to(torch.bfloat16)
    return a, b, torch.empty(m, n, device="cuda", dtype=torch.float32)


def _shared(tiles, stages, args) -> int | None:
    try:
        return _product[(1, 1)](*args, **tiles, num_warps=8, num_stages=stages).metadata.shared
    except Exception as err:  # noqa: BLE001
        if type(err).__name__ == "OutOfResources":
            return None
        raise


def test_a_pipeline_too_deep_for_shared_memory_runs_shallower():
    m, n, k = 256, 512, 1024
    a, b, c = _operands(m, n, k)
    tiles = {"BM": 128, "BN": 256, "BK": 128}  # 96 KiB of operands per stage
    one, five = _shared(tiles, 1, (a, b, c, m, n, k)), _shared(tiles, 5, (a, b, c, m, n, k))
    if one is None or five is not None:
        pytest.skip(f"this Triton does not buffer the loads per stage (1 stage: {one} bytes, 5: {five})")
    launch = DirectLaunch(_product, dict(tiles, num_warps=8, num_stages=5), tiles)
    launch((m // 128, n // 256), [a, b, c, m, n, k])
    torch.cuda.synchronize()
    assert launch.retries >= 1 and launch.options["num_stages"] < 5
    torch.testing.assert_close(c.double(), a.double() @ b.double(), rtol=1e-2, atol=1e-2 * k ** 0.5)


def test_too_much_shared_memory_at_one_stage_raises_after_trying():
    m, n, k = 256, 256, 512
    a, b, c = _operands(m, n, k)
    tiles = {"BM": 256, "BN": 256, "BK": 256}  # 256 KiB of operands at one stage
    launch = DirectLaunch(_product, dict(tiles, K=k, num_warps=8, num_stages=3), {**tiles, "K": k})
    with pytest.raises(Exception, match="shared memory") as err:
        launch((1, 1), [a, b, c, m, n])
    assert type(err.value).__name__ == "OutOfResources"
    assert launch.options["num_stages"] == 1 and launch.retries == 2
