"""Review of split-and-merge attention, unmasked interior key tiles, row-level rebase guards,
single-row contractions, moment expansions and skipped intermediate rounding: adversarial
inputs (odd sizes, several row and key blocks, non-finite values, fully masked rows, dynamic
shapes, non-contiguous operands) compared against eager and an fp64 reference."""
import os

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.tile.flash import choose_splits

DEVICE = os.environ.get("TILEFUSE_TEST_DEVICE", "cpu")
INF, NAN = float("inf"), float("nan")


def _compile(fn, *args, dynamic=False, **cfg):
    torch._dynamo.reset()
    with tilefuse.config.patch(**cfg):
        return torch.compile(fn, backend="tilefuse", dynamic=dynamic)(*args)


def _assert_matches(out, fn, args, rel=0.0):
    """Non-finite results exactly where eager has them (same inf sign, NaN for NaN); elsewhere
    no further from the fp64 reference than eager is (with the dtype's tolerance, and `rel`
    of the largest result: another summation order of large sums)."""
    eager = fn(*args)
    ref = fn(*(a.double() if a.is_floating_point() else a for a in args))
    finite = torch.isfinite(eager)
    same = (torch.isnan(out) & torch.isnan(eager)) | (out == eager)
    assert bool(same[~finite].all()), (out[~finite], eager[~finite])
    assert bool(torch.isfinite(out[finite]).all())
    err = (out.double() - ref)[finite].abs().max().item() if finite.any() else 0.0
    eager_err = (eager.double() - ref)[finite].abs().max().item() if finite.any() else 0.0
    tol = 1e-5 if eager.dtype == torch.float32 else 1e-2
    if finite.any():
        tol += rel * ref[finite].abs().max().item()
    assert err <= 2 * eager_err + tol, (err, eager_err)


def _masked(cond, scale=0.25):
    def fn(q, k, v):
        s = q @ k.transpose(-1, -2) * scale
        i = torch.arange(s.shape[-2], device=q.device)[:, None]
        j = torch.arange(s.shape[-1], device=q.device)[None, :]
        return torch.softmax(torch.where(cond(i, j), float("-inf"), s), -1) @ v
    return fn


MASKS = {
    "bottom_right_causal": lambda i, j: j > i + 30,
    "window_below_only": lambda i, j: i - j > 20,
    "causal_and_window": lambda i, j: (j > i + 7) | (i - j > 40),
    "reversed_ge": lambda i, j: i + 3 <= j,
    "rows_fully_masked": lambda i, j: j > i - 10,  # rows 0..9 see no key: NaN, as eager
}


@pytest.mark.parametrize("mask,config,splits", [
    ("bottom_right_causal", "16,64,4,1", 5), ("window_below_only", "64,16,4,1", 3),
    ("causal_and_window", "16,64,4,1", 3), ("reversed_ge", "64,16,4,1", 5), ("rows_fully_masked", "16,16,4,1", 4),
], ids=lambda x: str(x))
def test_interior_tiles_and_splits_with_unaligned_blocks(mask, config, splits):
    # several row and key blocks whose boundaries the mask diagonals cross at odd offsets:
    # the masked prologue/epilogue loops, the unmasked interior loop and each split's range
    # must cover every live key exactly once
    q = torch.randn(1, 2, 77, 16, device=DEVICE)
    k, v = (torch.randn(1, 2, 131, 16, device=DEVICE) for _ in range(2))
    fn = _masked(MASKS[mask])
    _assert_matches(_compile(fn, q, k, v, flash_split=splits, flash_config=config), fn, (q, k, v))


@pytest.mark.parametrize("splits", [1, 4])
def test_non_finite_scores_and_fully_masked_rows(splits):
    """Rows masked throughout, masked only in their first or last tiles, a single live key,
    a +inf or NaN score: the row guards (unchanged base, producer leaving -inf, factor 0) and
    the merge of empty splits give what eager gives."""
    M, N = 40, 110
    q = torch.randn(1, 2, M, 16, device=DEVICE)
    k, v = (torch.randn(1, 2, N, 16, device=DEVICE) for _ in range(2))
    bias = torch.zeros(M, N, device=DEVICE)
    bias[0] = -INF
    bias[1, :40] = -INF
    bias[2, 40:] = -INF
    bias[3, 70] = INF
    bias[4, 5] = NAN
    bias[5] = -INF
    bias[5, 100] = 0.0
    bias[6] = -INF
    bias[6, 0] = 0.0
    bias[7, [33, 90]] = INF
    bias[8] = -1e30
    bias[8, 50] = 0.0

    def fn(q, k, v, bias):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25 + bias, -1) @ v

    _assert_matches(_compile(fn, q, k, v, bias, flash_split=splits), fn, (q, k, v, bias))


def test_non_finite_keys_under_a_window_with_splits():
    q = torch.randn(1, 2, 40, 16, device=DEVICE)
    k, v = (torch.randn(1, 2, 110, 16, device=DEVICE) for _ in range(2))
    k[0, 0, 10, 3] = NAN
    k[0, 1, 20] = INF
    k[0, 0, 35] = -INF
    fn = _masked(lambda i, j: (j > i + 60) | (i - j > 5))
    _assert_matches(_compile(fn, q, k, v, flash_split=3), fn, (q, k, v))


def test_sdpa_keep_mask_with_empty_rows_split_bf16():
    keep = torch.rand(37, 90, device=DEVICE) > 0.5
    keep[3] = False
    keep[5] = False
    keep[5, 89] = True
    q = torch.randn(1, 2, 37, 16, dtype=torch.bfloat16, device=DEVICE)
    k, v = (torch.randn(1, 2, 90, 16, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))

    def fn(q, k, v, keep):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    out = _compile(fn, q, k, v, keep, flash_split=3)
    _assert_matches(out, fn, (q, k, v, keep))
    if DEVICE == "cpu":  # the math path's rule: a row masked throughout gives 0 (safe softmax); on CUDA,
        assert out[:, :, 3].eq(0).all()  # SDPA's fused kernels average v there, and tilefuse follows eager


def test_dynamic_lengths_with_causal_split():
    fn = _masked(lambda i, j: (j > i) | (i - j > 20))
    torch._dynamo.reset()
    with tilefuse.config.patch(flash_split=3):
        compiled = torch.compile(fn, backend="tilefuse", dynamic=True)
        for b, h, n in [(2, 2, 50), (3, 2, 23)]:
            q, k, v = (torch.randn(b, h, n, 16, device=DEVICE) for _ in range(3))
            _assert_matches(compiled(q, k, v), fn, (q, k, v))


def test_decode_with_one_head_and_batch_of_one():
    q = torch.randn(1, 1, 1, 16, device=DEVICE)
    k = torch.randn(1, 1, 70, 16, device=DEVICE)
    v = torch.randn(1, 1, 70, 24, device=DEVICE)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    _assert_matches(_compile(fn, q, k, v, flash_split=4), fn, (q, k, v))


K, N = 37, 45
SINGLE_ROW = {
    "mm_one_row": (lambda x, y: x @ y, (1, K), (K, N)),
    "mm_one_column": (lambda x, y: x @ y, (N, K), (K, 1)),
    "one_by_one": (lambda x, y: x @ y, (1, K), (K, 1)),
    "linear_1x1_row": (lambda x, w: F.relu(F.linear(x, w)), (1, 1, K), (N, K)),
    "bmm_one_row_one_column": (torch.bmm, (3, 1, K), (3, K, 1)),
    "bmm_batch_one_row_one": (torch.bmm, (1, 1, K), (1, K, N)),
    "vector_times_batch": (lambda x, y: x @ y, (K,), (3, K, N)),
    "broadcast_product_sum": (lambda x, y: (x[:, None, :, None] * y[None, :, :, None]).sum(2), (1, K), (N, K)),
    "transposed_one_row": (lambda x, y: x.t() @ y.t(), (K, 1), (N, K)),
    "einsum_batch_one_row": (lambda x, y: torch.einsum("bhk,bkn->bhn", x, y), (2, 1, K), (2, K, N)),
}


@pytest.mark.parametrize("name", list(SINGLE_ROW), ids=str)
def test_single_row_contractions(name):
    fn, sa, sb = SINGLE_ROW[name]
    a, b = torch.randn(*sa, device=DEVICE), torch.randn(*sb, device=DEVICE)
    _assert_matches(_compile(fn, a, b), fn, (a, b))


def test_looped_softmax_family_with_non_finite_rows():
    x = torch.randn(10, 150, device=DEVICE)
    x[0] = -INF
    x[1, :70] = -INF
    x[2, 70:] = -INF
    x[3, 100] = INF
    x[4, 5] = NAN
    x[5, [3, 140]] = INF
    x[6] = INF
    x[7] = -INF
    x[7, 149] = 3.0
    x[8, 64] = NAN
    x[8, :64] = -INF
    x[9] = 1e38
    for fn in (lambda x: torch.softmax(x, -1), lambda x: torch.logsumexp(x, -1),
               lambda x: F.softmin(x, -1)):
        _assert_matches(_compile(fn, x, persistent_reduction_limit=32), fn, (x,))


def test_moment_expansion_keeps_infinite_sums_of_eager():
    """Σ (x − max)² over data with -inf: eager gives +inf. When the first-tile shift already is
    the row's max, the expansion's higher terms are 0·inf — they must vanish, not give NaN."""
    x = torch.randn(4, 300, device=DEVICE)
    x[0, 0] = 10.0
    x[0, 200] = -INF   # the max in the first tile, a -inf later
    x[1, 250] = 10.0
    x[1, 20] = -INF    # the max in a later tile
    x[2, 5] = INF      # eager: NaN
    for fn in (lambda x: ((x - x.amax(-1, keepdim=True)) ** 2).sum(-1),
               lambda x: ((x - x.amax(-1, keepdim=True)) ** 3).sum(-1),
               lambda x: ((x - x.amin(-1, keepdim=True)) ** 2).sum(-1)):
        for data in (x, -x):
            out = _compile(fn, data, persistent_reduction_limit=32)
            _assert_matches(out, fn, (data,), rel=4 * torch.finfo(torch.float32).eps)


def test_explicit_narrowing_conversions_keep_their_rounding():
    """`x.to(bfloat16)` written by the user rounds, as in eager (fake quantisation, overflow
    checks); only the rounding an op applies to its own result is skipped between fused ops."""
    x = torch.randn(8, 33, device=DEVICE) * 1000
    cases = [
        lambda x: x.to(torch.bfloat16).float() - x,
        lambda x: torch.isinf((x * 100).half().float()).float(),
        lambda x: x.to(torch.bfloat16).float().sum(-1),
        lambda x: torch.where(x > 0, x.to(torch.bfloat16), torch.zeros((), dtype=torch.bfloat16,
                                                                       device=x.device)).float(),
    ]
    for fn in cases:
        torch.testing.assert_close(_compile(fn, x), fn(x), rtol=1e-6, atol=1e-3)


def test_split_choice_with_no_programs():
    assert choose_splits(programs=0, key_tiles=10, sm_count=132) == 1
