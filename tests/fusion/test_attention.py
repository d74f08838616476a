"""Naive attention written in plain PyTorch compiles to one flash kernel — the scores never
reach memory — for variants the compiler was never told about; results match eager."""
import math
import os

import pytest
import torch

import tilefuse

DEVICE = os.environ.get("TILEFUSE_TEST_DEVICE", "cpu")
#: the kernels of a block summary: tile classes, then the key ranges of each block of rows
SUMMARY = ["block-summary", "block-summary"]


def plain(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v


def causal_triu(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.triu(torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=q.device), 1)
    return torch.softmax(s.masked_fill(mask, float("-inf")), -1) @ v


def causal_index(q, k, v):
    s = q @ k.transpose(-1, -2) * 0.25
    i = torch.arange(s.shape[-2], device=q.device)[:, None]
    j = torch.arange(s.shape[-1], device=q.device)[None, :]
    return torch.softmax(torch.where(j > i, float("-inf"), s), -1) @ v


def sliding_window(q, k, v):
    s = q @ k.transpose(-1, -2) * 0.25
    i = torch.arange(s.shape[-2], device=q.device)[:, None]
    j = torch.arange(s.shape[-1], device=q.device)[None, :]
    return torch.softmax(torch.where((j > i) | (i - j > 8), float("-inf"), s), -1) @ v


def softcap(q, k, v):
    s = q @ k.transpose(-1, -2) * 0.25
    return torch.softmax(torch.tanh(s / 20) * 20, -1) @ v


def alibi(q, k, v):
    s = q @ k.transpose(-1, -2) * 0.25
    i = torch.arange(s.shape[-2], device=q.device)[:, None]
    j = torch.arange(s.shape[-1], device=q.device)[None, :]
    slopes = (2.0 ** (-torch.arange(1, q.shape[1] + 1, device=q.device)))[:, None, None].to(q.dtype)
    return torch.softmax(s + slopes * (j - i), -1) @ v


def gqa_expand(q, k, v):
    k, v = (t[:, :1].expand(-1, q.shape[1], -1, -1) for t in (k, v))
    return torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v


def gqa_repeat_interleave(q, k, v):
    k, v = (t[:, :1].repeat_interleave(q.shape[1], dim=1) for t in (k, v))
    return torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v


def normalised_after_the_product(q, k, v):
    s = q @ k.transpose(-1, -2) * 0.25
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e @ v) / e.sum(-1, keepdim=True)


def normalised_after_without_keepdim(q, k, v):
    s = q @ k.transpose(-1, -2) * 0.25
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e @ v) / e.sum(-1)[..., None]


def explicit_exp_and_division(q, k, v):
    s = q @ k.transpose(-1, -2) * 0.25
    e = torch.exp(s - s.max(-1, keepdim=True).values)
    return (e / e.sum(-1, keepdim=True)) @ v


def scale_before_the_product(q, k, v):
    return torch.softmax((q * 0.5) @ (k.transpose(-1, -2) * 0.5), -1) @ v


def log_softmax_exp(q, k, v):
    return torch.log_softmax(q @ k.transpose(-1, -2) * 0.25, -1).exp() @ v


def bmm_with_reshapes(q, k, v):
    b, h, t, d = q.shape
    s = torch.bmm(q.reshape(b * h, t, d), k.reshape(b * h, -1, d).transpose(1, 2)) * 0.25
    return torch.bmm(torch.softmax(s, -1), v.reshape(b * h, -1, d)).reshape(b, h, t, d)


def einsum_products(q, k, v):
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * 0.25
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1), v)


def mask_before_the_scale(q, k, v):
    s = q @ k.transpose(-1, -2)
    i = torch.arange(s.shape[-2], device=q.device)[:, None]
    j = torch.arange(s.shape[-1], device=q.device)[None, :]
    return torch.softmax(s.masked_fill(j > i, float("-inf")) * 0.25, -1) @ v


def causal_bias_table(q, k, v):  # an additive mask made in the function
    s = q @ k.transpose(-1, -2) * 0.25
    i = torch.arange(s.shape[-2], device=q.device)[:, None]
    j = torch.arange(s.shape[-1], device=q.device)[None, :]
    bias = torch.zeros(s.shape[-2], s.shape[-1], device=q.device, dtype=s.dtype).masked_fill(j > i, float("-inf"))
    return torch.softmax(s + bias, -1) @ v


def baddbmm_with_a_zero_bias(q, k, v):  # the scale as baddbmm's alpha
    b, h, t, d = q.shape
    bias = torch.zeros(b * h, t, k.shape[2], dtype=q.dtype, device=q.device)
    s = torch.baddbmm(bias, q.reshape(b * h, t, d), k.reshape(b * h, -1, d).transpose(1, 2), alpha=0.25)
    return torch.bmm(s.softmax(-1), v.reshape(b * h, -1, d)).reshape(b, h, t, d)


def normalised_by_logsumexp(q, k, v):
    s = q @ k.transpose(-1, -2) * 0.25
    return torch.exp(s - torch.logsumexp(s, -1, keepdim=True)) @ v


def exp2_by_hand(q, k, v):
    s = q @ k.transpose(-1, -2) * 0.25
    e = torch.exp2((s - s.amax(-1, keepdim=True)) * 1.4426950408889634)
    return (e @ v) / e.sum(-1, keepdim=True)


def times_the_reciprocal(q, k, v):
    s = torch.matmul(q, k.mT) / 4.0
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e * e.sum(-1, keepdim=True).reciprocal()).matmul(v)


SPELLINGS = [normalised_after_the_product, normalised_after_without_keepdim, explicit_exp_and_division,
             scale_before_the_product, log_softmax_exp, bmm_with_reshapes, einsum_products, mask_before_the_scale,
             causal_bias_table, baddbmm_with_a_zero_bias, normalised_by_logsumexp, exp2_by_hand,
             times_the_reciprocal]


# equivalent spellings (normalised after the product, exp and max by hand, the scale split over the
# operands, through bmm) must reach the same single kernel
VARIANTS = [plain, causal_triu, causal_index, sliding_window, softcap, alibi, gqa_expand, gqa_repeat_interleave,
            *SPELLINGS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fn", VARIANTS, ids=lambda f: f.__name__)
def test_attention_variant_is_one_flash_kernel(fn, dtype):
    q = torch.randn(1, 2, 37, 16, dtype=dtype, device=DEVICE)
    k, v = (torch.randn(1, 2, 45, 16, dtype=dtype, device=DEVICE) for _ in range(2))
    torch._dynamo.reset()
    report = tilefuse.explain(fn, q, k, v)
    assert [k_.kind for k_ in report.kernels] == ["flash"], str(report)
    assert not report.externs
    notes = "\n".join(report.kernels[0].notes)
    assert "attention fusion" in notes and "h(t," in notes
    torch._dynamo.reset()
    out = torch.compile(fn, backend="tilefuse")(q, k, v)
    ref = fn(q.double(), k.double(), v.double())
    eager_err = (fn(q, k, v).double() - ref).abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (out.double() - ref).abs().max().item() <= 2 * eager_err + tol


def test_fully_masked_rows_follow_eager():
    q = torch.randn(1, 1, 9, 16, device=DEVICE)
    k, v = (torch.randn(1, 1, 40, 16, device=DEVICE) for _ in range(2))

    def fn(q, k, v):
        s = q @ k.transpose(-1, -2) * 0.25
        j = torch.arange(40, device=q.device)[None, :]
        i = torch.arange(9, device=q.device)[:, None]
        return torch.softmax(torch.where((j < 35) & (i < 3), float("-inf"), s), -1) @ v

    torch._dynamo.reset()
    out = torch.compile(fn, backend="tilefuse")(q, k, v)
    torch.testing.assert_close(out, fn(q, k, v), equal_nan=True, atol=1e-5, rtol=1e-5)


def test_attention_whose_scores_are_also_returned_keeps_three_kernels():
    """Scores needed outside the chain must reach memory: no flash fusion, still correct."""
    q, k, v = (torch.randn(1, 2, 20, 16, device=DEVICE) for _ in range(3))

    def fn(q, k, v):
        p = torch.softmax(q @ k.transpose(-1, -2), -1)
        return p @ v, p

    torch._dynamo.reset()
    report = tilefuse.explain(fn, q, k, v)
    assert "flash" not in [k_.kind for k_ in report.kernels]
    torch._dynamo.reset()
    out, p = torch.compile(fn, backend="tilefuse")(q, k, v)
    ref_out, ref_p = fn(q, k, v)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(p, ref_p, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fn,bounds", [(causal_triu, "upper"), (causal_index, "upper"), (sliding_window, "both"),
                                       (plain, None), (alibi, None)], ids=lambda x: getattr(x, "__name__", str(x)))
def test_fully_masked_key_tiles_are_skipped(fn, bounds):
    """Block skipping is derived from the program's own mask (causal, sliding window); the
    result over several row and key blocks still matches eager."""
    q, k, v = (torch.randn(1, 2, 100, 16, device=DEVICE) for _ in range(3))
    torch._dynamo.reset()
    report = tilefuse.explain(fn, q, k, v)
    notes = [n for n in report.kernels[0].notes if "skipped" in n]
    source = report.kernels[0].tile_ir  # backend-neutral: the loop bounds of the tile IR
    if bounds is None:
        assert not notes and "for joffset in range(0, 100," in source
    else:
        assert notes and "Min(100" in source
        if bounds == "both":
            assert "Max(0" in source
    torch._dynamo.reset()
    out = torch.compile(fn, backend="tilefuse")(q, k, v)
    torch.testing.assert_close(out, fn(q, k, v), atol=1e-5, rtol=1e-5)


def _rows_and_keys(s):
    """The query row and key position of each score, as broadcastable index tensors."""
    return (torch.arange(s.shape[-2], device=s.device)[:, None], torch.arange(s.shape[-1], device=s.device)[None, :])


def _hf_style(fill, window, keys_keep=None):
    """Hugging Face's eager attention: a keep-mask (causal, a window, `ids[i] == ids[j]` of
    packed sequences, or a padding mask over keys) turned into a bias of 0 and `fill`, added
    to the scores."""
    def fn(q, k, v, ids):
        s = q @ k.transpose(-1, -2) * 0.25
        i, j = _rows_and_keys(s)
        keep = (j <= i) & (j > i - window)
        keep = keep & (ids[:, None] == ids[None, :]) if keys_keep is None else keep & keys_keep[None, :]
        bias = torch.where(keep, torch.zeros((), dtype=s.dtype, device=q.device), fill)
        return torch.softmax(s + bias, -1) @ v
    return fn


@pytest.mark.parametrize("fill", [float("-inf"), torch.finfo(torch.float32).min, torch.finfo(torch.bfloat16).min])
def test_masks_with_a_data_part_and_finite_fills_skip_by_their_index_part(fill):
    """A mask that is an index formula AND a condition on data (packed sequences' ids) gets a
    block summary computed at run time, whose pre-kernel visits only the tiles the index part
    leaves; a fill of fp32's or bf16's `finfo.min` skips too, because every row keeps its
    diagonal (`ids[i] == ids[i]`) whatever the data: no block walks every key."""
    q, k, v = (torch.randn(1, 2, 100, 16, device=DEVICE) for _ in range(3))
    ids = torch.randint(0, 3, (100,), device=DEVICE).sort().values
    fn = _hf_style(fill, window=30)
    torch._dynamo.reset()
    report = tilefuse.explain(fn, q, k, v, ids)
    assert [k_.kind for k_ in report.kernels] == SUMMARY + ["flash"], str(report)
    assert any("the rest are skipped" in n for n in report.kernels[1].notes)
    classify, ranges = report.kernels[0].tile_ir, report.kernels[1].tile_ir
    assert "Max(0" in classify and "Min(100" in classify and "every" not in ranges
    torch._dynamo.reset()
    out = torch.compile(fn, backend="tilefuse")(q, k, v, ids)
    ref = fn(q.double(), k.double(), v.double(), ids)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fill", [torch.finfo(torch.float32).min, -1e4])
def test_finite_fills_that_may_mask_a_whole_row_skip_nothing(fill):
    """Left padding masks whole rows: eager then averages every key (a finite fill is not
    -inf), so a block of rows with such a row walks every key (the summary says which blocks);
    a fill that is not far below every score (-1e4) also needs a run-time bound on the scores
    before it skips. Both match eager, the fully masked rows included."""
    q, k, v = (torch.randn(1, 2, 100, 16, device=DEVICE) for _ in range(3))
    keys_keep = torch.ones(100, dtype=torch.bool, device=DEVICE)
    keys_keep[:7] = False  # rows 0..6 see only padding
    fn = _hf_style(fill, window=30, keys_keep=keys_keep)
    ids = torch.zeros(100, dtype=torch.long, device=DEVICE)
    torch._dynamo.reset()
    report = tilefuse.explain(fn, q, k, v, ids)
    guard = ["block-summary"] * 2 if fill == -1e4 else []  # query and key norms: the scores' bound
    assert [k_.kind for k_ in report.kernels] == SUMMARY + guard + ["flash"], str(report)
    assert "every" in report.kernels[1].tile_ir
    torch._dynamo.reset()
    out = torch.compile(fn, backend="tilefuse")(q, k, v, ids)
    ref = fn(q.double(), k.double(), v.double(), ids)
    eager_err = (fn(q, k, v, ids).double() - ref).abs().max().item()  # (s + fill rounds in fp32)
    assert (out.double() - ref).abs().max().item() <= 2 * eager_err + 1e-5


@pytest.mark.parametrize("fill", [-1e5, torch.finfo(torch.float16).min])
def test_a_fill_that_live_scores_may_lie_below_skips_nothing(fill):
    """A fill is skipped like -inf only when no live score can lie below it: here every live
    score is about -1.6e5, so eager's weights sit on the masked keys. (Seeded: at scores this
    large fp32 rounds them by up to 0.008, and a rare draw puts two keys near a tie, where
    either rounding may land further from fp64 than eager's by chance.)"""
    gen = torch.Generator().manual_seed(0)
    q = torch.full((1, 1, 100, 16), 100.0, device=DEVICE)
    k = (torch.full((1, 1, 100, 16), -100.0) + torch.randn(1, 1, 100, 16, generator=gen)).to(DEVICE)
    v = torch.randn(1, 1, 100, 16, generator=gen).to(DEVICE)

    def fn(q, k, v):
        s = q @ k.transpose(-1, -2)
        i, j = _rows_and_keys(s)
        return torch.softmax(torch.where(j > i, fill, s), -1) @ v

    torch._dynamo.reset()
    report = tilefuse.explain(fn, q, k, v)
    assert not any("skipped" in n for n in report.kernels[0].notes)
    torch._dynamo.reset()
    out = torch.compile(fn, backend="tilefuse")(q, k, v)
    ref = fn(q.double(), k.double(), v.double())
    eager_err = (fn(q, k, v).double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * eager_err + 1e-5


def test_finite_fills_with_more_queries_than_keys_skip_nothing():
    """Row i's diagonal key exists only while i < the key count."""
    q = torch.randn(1, 2, 90, 16, device=DEVICE)
    k, v = (torch.randn(1, 2, 60, 16, device=DEVICE) for _ in range(2))

    def fn(q, k, v):
        s = q @ k.transpose(-1, -2) * 0.25
        i, j = _rows_and_keys(s)
        return torch.softmax(s.masked_fill(j > i, torch.finfo(s.dtype).min), -1) @ v

    torch._dynamo.reset()
    report = tilefuse.explain(fn, q, k, v)
    assert not any("skipped" in n for n in report.kernels[0].notes)
    torch._dynamo.reset()
    out = torch.compile(fn, backend="tilefuse")(q, k, v)
    torch.testing.assert_close(out.double(), fn(q.double(), k.double(), v.double()), atol=1e-5, rtol=1e-5)


def _normalised_after(epilogue):
    def fn(q, k, v):
        s = q @ k.transpose(-1, -2) * 0.25
        m = s.amax(-1, keepdim=True)
        e = torch.exp(s - m)
        return epilogue(e @ v, e.sum(-1, keepdim=True), s, m, e)
    return fn


OTHER_ROWS = {
    "sum_flipped": lambda o, l, s, m, e: o / l.flip(-2),
    "sum_of_row_0": lambda o, l, s, m, e: o / l[..., :1, :],
    "sum_rolled": lambda o, l, s, m, e: o / torch.roll(l, 1, -2),
    "max_flipped": lambda o, l, s, m, e: o / l + m.flip(-2),
    "weights_read": lambda o, l, s, m, e: o / l + e[..., :16],
    "scores_read": lambda o, l, s, m, e: o / l + s[..., :16],
}


@pytest.mark.parametrize("name", sorted(OTHER_ROWS))
def test_epilogues_reading_other_rows_or_the_scores_stay_exact(name):
    """A flash kernel holds each row's own reductions and never stores the scores or weights:
    an epilogue reading a reduction at another row, or reading the scores, keeps its kernels
    apart, and compiles (no eager fallback)."""
    fn = _normalised_after(OTHER_ROWS[name])
    q = torch.randn(1, 2, 37, 16, device=DEVICE)
    k, v = (torch.randn(1, 2, 45, 16, device=DEVICE) for _ in range(2))
    torch._dynamo.reset()
    with tilefuse.config.patch(fallback="error"):
        out = torch.compile(fn, backend="tilefuse")(q, k, v)
    torch.testing.assert_close(out.double(), fn(q.double(), k.double(), v.double()), atol=1e-5, rtol=1e-5)


def test_scaled_dot_product_attention_calls_get_the_same_kernel():
    """F.scaled_dot_product_attention reaches tilefuse through PyTorch's math definition (on
    CPU) or its fused attention ops (CUDA), lowered through the same math; it becomes one flash
    kernel — with block skipping for is_causal, a block summary for a mask tensor, and
    PyTorch's rule that rows masked entirely give 0."""
    import torch.nn.functional as F

    q, k, v = (torch.randn(1, 2, 100, 16, device=DEVICE) for _ in range(3))
    keep = torch.ones(100, 100, dtype=torch.bool, device=DEVICE)
    keep[:5] = False
    cases = [(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), False),
             (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), True),
             (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=keep), None)]
    for fn, skips in cases:
        torch._dynamo.reset()
        report = tilefuse.explain(fn, q, k, v)
        kinds = ["flash"] if skips is not None else SUMMARY + ["flash"]  # (a mask from data)
        assert [k_.kind for k_ in report.kernels] == kinds and not report.externs, str(report)
        assert any("skipped" in n for n in report.kernels[-1].notes) == (skips is not False)
        torch._dynamo.reset()
        out = torch.compile(fn, backend="tilefuse")(q, k, v)
        torch.testing.assert_close(out, fn(q, k, v), atol=1e-5, rtol=1e-5)


def test_review_regressions_block_skipping_and_merging():
    """Skipping must not drop keys another reduction still reads; reductions that need a
    finished reduction must not be merged into one loop."""
    q = torch.randn(1, 2, 70, 16, device=DEVICE)
    k, v = (torch.randn(1, 2, 100, 16, device=DEVICE) for _ in range(2))

    def partly_masked(q, k, v):
        s = q @ k.transpose(-1, -2) * 0.25
        i = torch.arange(70, device=q.device)[:, None]
        j = torch.arange(100, device=q.device)[None, :]
        sm = torch.where(j > i, float("-inf"), s)
        m = sm.amax(-1, keepdim=True)
        return (torch.exp(sm - m) / torch.exp(s - m).sum(-1, keepdim=True)) @ v

    def centred(q, k, v):
        s = q @ k.transpose(-1, -2) * 0.25
        return torch.softmax(s - s.mean(-1, keepdim=True), -1) @ v

    for fn in (partly_masked, centred):
        torch._dynamo.reset()
        out = torch.compile(fn, backend="tilefuse")(q, k, v)
        torch.testing.assert_close(out, fn(q, k, v), atol=1e-5, rtol=1e-5)


def test_sdpa_with_symbolic_sizes_serves_several_lengths():
    import torch.nn.functional as F

    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="tilefuse", dynamic=True)
    for n in (40, 23):
        q, k, v = (torch.randn(1, 2, n, 16, device=DEVICE) for _ in range(3))
        torch.testing.assert_close(compiled(q, k, v), fn(q, k, v), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- row statistics (a logsumexp)


def with_logsumexp_by_hand(q, k, v):
    """The output and the logsumexp of the scores per row (what a training step's backward
    reads), both from the same max and sum."""
    s = q @ k.transpose(-1, -2) * 0.25
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    return (e / total) @ v, (m + torch.log(total)).squeeze(-1)


def with_logsumexp_causal(q, k, v):
    s = q @ k.transpose(-1, -2) * 0.25
    i, j = _rows_and_keys(s)
    s = s.masked_fill(j > i, float("-inf"))
    m = s.amax(-1)
    e = torch.exp(s - m[..., None])
    total = e.sum(-1)
    return (e @ v) / total[..., None], m + torch.log(total)


def with_logsumexp_of_a_tril_buffer(q, k, v):
    """The mask read from data (nanoGPT's buffer): the block summary path."""
    s = q @ k.transpose(-1, -2) * 0.25
    tril = torch.tril(torch.ones(s.shape[-2], s.shape[-1], device=q.device))
    s = s.masked_fill(tril == 0, float("-inf"))
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    return (e / total) @ v, (m + torch.log(total))[..., 0] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fn", [with_logsumexp_by_hand, with_logsumexp_causal, with_logsumexp_of_a_tril_buffer],
                         ids=lambda f: f.__name__)
def test_row_statistics_are_stored_by_the_flash_kernel(fn, dtype):
    """A value computed from the row reductions alone (the logsumexp) does not stop the
    fusion: the flash kernel stores it once per query row, after its loop over the keys."""
    q = torch.randn(2, 3, 70, 16, dtype=dtype, device=DEVICE)
    k, v = (torch.randn(2, 3, 70, 16, dtype=dtype, device=DEVICE) for _ in range(2))
    torch._dynamo.reset()
    report = tilefuse.explain(fn, q, k, v)
    assert [k_.kind for k_ in report.kernels if k_.kind != "block-summary"] == ["flash"], str(report)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="tilefuse")(q, k, v)
    ref = fn(q.double(), k.double(), v.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for g, r, e in zip(got, ref, fn(q, k, v)):
        assert g.shape == r.shape and g.dtype == e.dtype
        eager_err = (e.double() - r).abs().max().item()
        assert (g.double() - r).abs().max().item() <= 2 * eager_err + tol


def test_a_reduction_read_at_another_row_is_stored_whole():
    """A value of the reductions at a neighbouring row is not the flash kernel's to compute:
    the reductions it reads are stored (every row, after the loop) and a later kernel reads
    them from memory."""
    q, k, v = (torch.randn(1, 2, 20, 16, device=DEVICE) for _ in range(3))

    def fn(q, k, v):
        s = q @ k.transpose(-1, -2) * 0.25
        m = s.amax(-1, keepdim=True)
        e = torch.exp(s - m)
        total = e.sum(-1, keepdim=True)
        return (e / total) @ v, m.flip(-2) + total

    torch._dynamo.reset()
    report = tilefuse.explain(fn, q, k, v)
    assert [k_.kind for k_ in report.kernels] == ["flash", "pointwise"], str(report)
    torch._dynamo.reset()
    for g, r in zip(torch.compile(fn, backend="tilefuse")(q, k, v), fn(q, k, v)):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
