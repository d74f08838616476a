"""Decode (one query row against a long key/value cache) and split-and-merge: the flash
kernel walks each split's range of keys and a merge kernel combines the partial states with
the same derived rolling updates; results match eager for every variant and split count."""
import math
import os

import pytest
import torch

import tilefuse
from tilefuse.tile.flash import choose_splits

from test_attention import alibi, causal_index, gqa_expand, plain, sliding_window, softcap

DEVICE = os.environ.get("TILEFUSE_TEST_DEVICE", "cpu")


def cache_length_mask(q, k, v):
    """Decode against a cache whose tail is not filled yet: keys past `valid` are masked."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    j = torch.arange(s.shape[-1], device=q.device)
    return torch.softmax(s.masked_fill(j >= 29, float("-inf")), -1) @ v


def _check(fn, q, k, v, report, dtype):
    torch._dynamo.reset()
    out = torch.compile(fn, backend="tilefuse")(q, k, v)
    ref = fn(q.double(), k.double(), v.double())
    eager_err = (fn(q, k, v).double() - ref).abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    err = (out.double() - ref).abs().max().item()
    assert err <= 2 * eager_err + tol, f"{err} vs eager {eager_err}\n{report}"


@pytest.mark.parametrize("fn", [plain, cache_length_mask, softcap, gqa_expand], ids=lambda f: f.__name__)
def test_decode_is_one_flash_kernel(fn):
    q = torch.randn(2, 3, 1, 16, device=DEVICE)
    k, v = (torch.randn(2, 3, 70, 16, device=DEVICE) for _ in range(2))
    torch._dynamo.reset()
    with tilefuse.config.patch(flash_split=1):
        report = tilefuse.explain(fn, q, k, v)
        assert [k_.kind for k_ in report.kernels] == ["flash"], str(report)
        assert not report.externs
        _check(fn, q, k, v, report, torch.float32)


@pytest.mark.parametrize("rows,splits", [(1, 2), (37, 3), (37, 8)])
@pytest.mark.parametrize("fn", [plain, causal_index, sliding_window, softcap, alibi, cache_length_mask],
                         ids=lambda f: f.__name__)
def test_split_and_merge_matches_eager(fn, rows, splits):
    # 45 keys in tiles of 32 (interpreter): with 8 splits most ranges are empty, and causal or
    # windowed rows leave whole splits outside their live keys — their partial state is the
    # identity, which the merge must discard
    dtype = torch.bfloat16 if splits == 3 else torch.float32
    q = torch.randn(1, 2, rows, 16, dtype=dtype, device=DEVICE)
    k, v = (torch.randn(1, 2, 45, 16, dtype=dtype, device=DEVICE) for _ in range(2))
    torch._dynamo.reset()
    with tilefuse.config.patch(flash_split=splits):
        report = tilefuse.explain(fn, q, k, v)
        assert [k_.kind for k_ in report.kernels] == ["flash", "flash-merge"], str(report)
        notes = "\n".join(report.kernels[0].notes)
        assert f"split into {splits} ranges" in notes
        _check(fn, q, k, v, report, dtype)


def test_split_keeps_eager_semantics_of_fully_masked_rows():
    q = torch.randn(1, 1, 9, 16, device=DEVICE)
    k, v = (torch.randn(1, 1, 80, 16, device=DEVICE) for _ in range(2))

    def fn(q, k, v):
        s = q @ k.transpose(-1, -2) * 0.25
        j = torch.arange(80, device=q.device)[None, :]
        i = torch.arange(9, device=q.device)[:, None]
        return torch.softmax(torch.where((j < 70) & (i < 3), float("-inf"), s), -1) @ v

    torch._dynamo.reset()
    with tilefuse.config.patch(flash_split=3):
        out = torch.compile(fn, backend="tilefuse")(q, k, v)
    torch.testing.assert_close(out, fn(q, k, v), equal_nan=True, atol=1e-5, rtol=1e-5)


def test_sdpa_decode_with_split():
    q = torch.randn(2, 4, 1, 16, device=DEVICE)
    k, v = (torch.randn(2, 4, 53, 16, device=DEVICE) for _ in range(2))

    def fn(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    torch._dynamo.reset()
    with tilefuse.config.patch(flash_split=2):
        report = tilefuse.explain(fn, q, k, v)
        assert [k_.kind for k_ in report.kernels] == ["flash", "flash-merge"], str(report)
        _check(fn, q, k, v, report, torch.float32)


def test_split_choice_fills_the_device_only_when_rows_cannot():
    assert choose_splits(programs=32 * 32, key_tiles=128, sm_count=132) == 1  # many heads: no split
    assert choose_splits(programs=8, key_tiles=128, sm_count=132) == 32  # 8 heads: 264 programs
    assert choose_splits(programs=8, key_tiles=16, sm_count=132) == 4  # short cache: ≥ 4 tiles a split
    assert choose_splits(programs=1, key_tiles=4096, sm_count=132) == 64  # capped
