"""Masks read from tensor data (a tril buffer, a padding mask, a causal mask gathered by
positions) get a block summary computed at run time: the attention kernel visits only the key
tiles the summary lists, and the result matches eager against an fp64 reference."""
import os

import pytest
import torch

import tilefuse
from backends_on_cpu import CPU_BACKENDS

DEVICE = os.environ.get("TILEFUSE_TEST_DEVICE", "cpu")
#: the kernels of a block summary: tile classes, then the key ranges of each block of rows
SUMMARY = ["block-summary", "block-summary"]
TARGETS = CPU_BACKENDS if DEVICE == "cpu" else ["auto"]


def _compiled(fn, target, **knobs):
    torch._dynamo.reset()
    return torch.compile(fn, backend="tilefuse", options={"target": target, **knobs})


def nanogpt_attention(q, k, v, bias):
    """nanoGPT's attention: a `tril` buffer sliced to the length, `masked_fill` with -inf."""
    t = q.shape[-2]
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(bias[:, :, :t, :t] == 0, float("-inf"))
    return torch.softmax(s, -1) @ v


def hf_padded_attention(q, k, v, keep):
    """Hugging Face's eager attention: causal AND a padding mask per batch row, as a bias of
    0 and `finfo.min` added to the scores."""
    s = q @ k.transpose(-1, -2) * 0.25
    t = s.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    allowed = causal[None, None] & keep[:, None, None, :].bool()
    bias = torch.zeros(allowed.shape, dtype=s.dtype, device=q.device).masked_fill(~allowed, torch.finfo(s.dtype).min)
    return torch.softmax(s + bias, -1) @ v


def gathered_causal(q, k, v, causal_mask, input_pos):
    """gpt-fast's prefill: the cache's causal mask gathered by the input positions; the keys
    are the whole cache."""
    mask = causal_mask[None, None, input_pos]
    s = q @ k.transpose(-1, -2) * 0.25
    s = torch.where(mask, s, float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("target", TARGETS)
def test_a_tril_buffer_skips_the_tiles_above_the_diagonal(target):
    """Key tiles masked for a whole block of rows are never read: a NaN in the last value row
    reaches only the rows whose blocks visit its tile (eager's 0 · NaN reaches all of them)."""
    t = 150
    bias = torch.tril(torch.ones(t, t, device=DEVICE)).view(1, 1, t, t)
    q, k, v = (torch.randn(2, 3, t, 16, device=DEVICE) for _ in range(3))
    torch._dynamo.reset()
    report = tilefuse.explain(nanogpt_attention, q, k, v, bias, options={"target": target})
    assert [k_.kind for k_ in report.kernels] == SUMMARY + ["flash"], str(report)
    header = report.kernels[0].tile_ir.splitlines()[0]
    assert header.split(" BLOCK_M=")[0].endswith(", '1')")  # one mask for every batch row and head
    out = _compiled(nanogpt_attention, target)(q, k, v, bias)
    ref = nanogpt_attention(q.double(), k.double(), v.double(), bias.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)

    poisoned = v.clone()
    poisoned[..., -1, :] = float("nan")
    out = _compiled(nanogpt_attention, target)(q, k, poisoned, bias)
    assert torch.isnan(nanogpt_attention(q, k, poisoned, bias)[..., :32, :]).all()  # eager reads it
    assert torch.isfinite(out[..., :32, :]).all()  # the first block of rows skips the last tile
    torch.testing.assert_close(out[..., :32, :].double(), ref[..., :32, :], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_padding_masks_per_batch_row_and_wholly_masked_rows_follow_eager(target, dtype):
    """A padding mask differs per batch row: the summary has one per row. Left padding masks
    whole query rows under a `finfo.min` fill; eager averages every key there, and so does a
    block holding such a row (it walks every key)."""
    if dtype == torch.bfloat16 and target == "interpret":
        pytest.skip("bf16 attention through the interpreter is covered by the C++ backend and the GPU")
    b, t = 3, 97
    q, k, v = (torch.randn(b, 2, t, 16, device=DEVICE, dtype=dtype) for _ in range(3))
    keep = torch.ones(b, t, dtype=torch.long, device=DEVICE)
    keep[0, :41] = 0  # left padding: rows 0..40 of sequence 0 see no key
    keep[1, 70:] = 0  # right padding
    torch._dynamo.reset()
    report = tilefuse.explain(hf_padded_attention, q, k, v, keep, options={"target": target})
    assert [k_.kind for k_ in report.kernels] == SUMMARY + ["flash"], str(report)
    assert "every" in report.kernels[1].tile_ir  # a finite fill: blocks with a masked row walk every key
    out = _compiled(hf_padded_attention, target)(q, k, v, keep)
    ref = hf_padded_attention(q.double(), k.double(), v.double(), keep)
    eager_err = (hf_padded_attention(q, k, v, keep).double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * eager_err + 1e-5


def flat_heads_padded_attention(q, k, v, keep):
    """Hugging Face's padding mask over attention whose batch and heads are one dim (as after
    `repeat_kv` and a reshape): the mask reads its batch row as `i // heads`."""
    b, h, t, d = q.shape
    s = q.reshape(b * h, t, d) @ k.reshape(b * h, t, d).transpose(-1, -2) * 0.25
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    allowed = (causal[None, None] & keep[:, None, None, :].bool()).expand(b, h, t, t).reshape(b * h, t, t)
    bias = torch.zeros(allowed.shape, dtype=s.dtype, device=q.device).masked_fill(~allowed, torch.finfo(s.dtype).min)
    return (torch.softmax(s + bias, -1) @ v.reshape(b * h, t, d)).view(b, h, t, d)


@pytest.mark.parametrize("target", TARGETS)
def test_a_mask_broadcast_over_flattened_heads_is_summarised_per_batch_row(target):
    """The summary of a mask that reads the (batch · heads) coordinate only as `i // heads`
    has one row per batch element, not one per head, and each head reads its element's."""
    b, h, t = 3, 4, 70
    q, k, v = (torch.randn(b, h, t, 16, device=DEVICE) for _ in range(3))
    keep = torch.ones(b, t, dtype=torch.long, device=DEVICE)
    keep[0, 50:] = 0  # right padding, different per batch row
    keep[2, 20:] = 0
    torch._dynamo.reset()
    report = tilefuse.explain(flat_heads_padded_attention, q, k, v, keep, options={"target": target})
    assert [k_.kind for k_ in report.kernels] == SUMMARY + ["flash"], str(report)
    header = report.kernels[0].tile_ir.splitlines()[0]
    assert header.split(" BLOCK_M=")[0].endswith(f", '{b}')"), header  # not b * h rows
    fn = _compiled(flat_heads_padded_attention, target)
    for call in range(3):  # (the third runs the generated call)
        keep[1, 60 - 15 * call:] = 0
        out = fn(q, k, v, keep)
        ref = flat_heads_padded_attention(q.double(), k.double(), v.double(), keep)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_the_batch_divisor_needs_every_read_to_be_the_quotient():
    import sympy

    from tilefuse.ir import dtypes as dt
    from tilefuse.ir.expr import Index, Load, binary
    from tilefuse.tile.block_summary import batch_divisor

    i0, i1 = sympy.symbols("i0 i1", integer=True, nonnegative=True)
    quotient = Load("keep", (Index(sympy.floor(i0 / 4)), Index(i1)), dt.bool_)
    assert batch_divisor(quotient, i0, 12) == 4
    assert batch_divisor(quotient, i0, 10) == 1  # 4 does not divide the extent
    assert batch_divisor(quotient, i0, sympy.Symbol("s0", positive=True, integer=True)) == 1
    both = binary("logical_and", quotient, Load("m", (Index(sympy.Mod(i0, 4)), Index(i1)), dt.bool_))
    assert batch_divisor(both, i0, 12) == 1  # the head is read too
    plain = Load("keep", (Index(i0), Index(i1)), dt.bool_)
    assert batch_divisor(plain, i0, 12) == 1
    for other in (sympy.floor((i0 + 1) / 4), sympy.floor(3 * i0 / 4), i0 + sympy.floor(i0 / 4)):
        mixed = binary("logical_and", quotient, Load("m", (Index(other), Index(i1)), dt.bool_))
        assert batch_divisor(mixed, i0, 12) == 1, other  # read some other way too


def test_summary_rows_round_trip_with_some_positions_divided():
    """The classify program of each summary row evaluates the mask at batch coordinates that
    the flash programs of that row map back to it: every combination of divided and undivided
    positions, exhaustively over small extents."""
    import itertools

    import sympy

    from tilefuse.tile.block_summary import BlockSummary

    for positions, extents, divisors in (((0, 1), (3, 8), (1, 4)), ((1,), (8,), (4,)),
                                         ((0, 2), (3, 2), (3, 1)), ((0, 1, 2), (2, 3, 8), (2, 1, 4))):
        own = tuple(e // c for e, c in zip(extents, divisors))
        summary = BlockSummary(None, False, positions, own, 16, 16, 16, 16, "p", divisors=divisors)
        rank = max(positions) + 1
        full = [1] * rank
        for p, e in zip(positions, extents):
            full[p] = e
        flat = sympy.Symbol("flat", integer=True, nonnegative=True)
        rows = set()
        for row in range(int(sympy.Mul(*own))):
            vals = [int(v.subs(flat, row)) for v in summary.mask_batch_values(flat, rank)]
            assert int(summary.batch_index(vals)) == row  # the classify program's own row
            rows.add(row)
        for coords in itertools.product(*(range(e) for e in full)):  # every flash program
            row = int(summary.batch_index(coords))
            assert row in rows
            # its row's classify program saw the mask where this program reads it: the mask
            # reads each divided coordinate only as x // c, an undivided one as x
            seen = [int(v.subs(flat, row)) for v in summary.mask_batch_values(flat, rank)]
            for p, c in zip(positions, divisors):
                assert seen[p] // c == coords[p] // c, (positions, divisors, coords, seen)


@pytest.mark.parametrize("target", TARGETS)
def test_a_causal_mask_gathered_by_positions(target):
    """gpt-fast's prefill into a longer cache: keys past the prompt are masked for every row
    and never visited; the summary is recomputed when the positions change."""
    max_len, t = 160, 70
    causal_mask = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool, device=DEVICE))
    q = torch.randn(1, 2, t, 16, device=DEVICE)
    k, v = (torch.randn(1, 2, max_len, 16, device=DEVICE) for _ in range(2))
    fn = _compiled(gathered_causal, target)
    for start in (0, 45):  # a second chunk of the prompt: other positions, other tiles
        input_pos = torch.arange(start, start + t, device=DEVICE)
        out = fn(q, k, v, causal_mask, input_pos)
        ref = gathered_causal(q.double(), k.double(), v.double(), causal_mask, input_pos)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    poisoned = v.clone()
    poisoned[..., -1, :] = float("nan")  # a cache row no position reaches
    assert torch.isfinite(fn(q, k, poisoned, causal_mask, input_pos)).all()


@pytest.mark.parametrize("target", TARGETS)
def test_the_mask_may_change_between_calls(target):
    """The summary is computed from the mask on every call: never a stale one."""
    t = 90
    q, k, v = (torch.randn(1, 2, t, 16, device=DEVICE) for _ in range(3))
    fn = _compiled(nanogpt_attention, target)
    for diagonal in (0, -40, 30):
        bias = torch.ones(t, t, device=DEVICE).tril(diagonal).view(1, 1, t, t)
        bias[..., :, 0] = 1  # every row keeps a key
        out = fn(q, k, v, bias)
        ref = nanogpt_attention(q.double(), k.double(), v.double(), bias.double())
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_the_knob_turns_the_summary_off():
    t = 70
    bias = torch.tril(torch.ones(t, t, device=DEVICE)).view(1, 1, t, t)
    q, k, v = (torch.randn(1, 2, t, 16, device=DEVICE) for _ in range(3))
    torch._dynamo.reset()
    report = tilefuse.explain(nanogpt_attention, q, k, v, bias, options={"block_summary": False})
    assert [k_.kind for k_ in report.kernels] == ["flash"], str(report)
    out = _compiled(nanogpt_attention, "auto", block_summary=False)(q, k, v, bias)
    torch.testing.assert_close(out.double(), nanogpt_attention(q.double(), k.double(), v.double(), bias.double()),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("target", TARGETS)
def test_a_padded_mask_bias_is_still_a_mask(target):
    """PyTorch's CUDA attention turns a bool mask into a bias of 0 and -inf padded to a
    multiple of 16 keys and sliced back: `where(j < n, bias, 0)` still masks where the bias
    does."""
    import torch.nn.functional as F

    t = 100
    keep = torch.rand(t, t, device=DEVICE) > 0.3
    keep[:, :40] = True
    keep[:50, 60:] = False  # whole tiles masked for the first rows

    def fn(q, k, v):
        bias = torch.where(keep, 0.0, float("-inf"))
        bias = F.pad(bias, (0, 12))[:, :t]
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25 + bias, -1) @ v

    q, k, v = (torch.randn(1, 2, t, 16, device=DEVICE) for _ in range(3))
    torch._dynamo.reset()
    report = tilefuse.explain(fn, q, k, v, options={"target": target})
    assert [k_.kind for k_ in report.kernels] == SUMMARY + ["flash"], str(report)
    out = _compiled(fn, target)(q, k, v)
    torch.testing.assert_close(out.double(), fn(q.double(), k.double(), v.double()), atol=1e-5, rtol=1e-5)


def two_layers_one_mask(x, keep, w1, w2):
    a = hf_padded_attention(x @ w1, x @ w2, x, keep)
    return hf_padded_attention(a @ w1, a @ w2, a, keep)


@pytest.mark.parametrize("target", TARGETS)
def test_layers_sharing_a_mask_share_its_summary(target):
    """Two attention layers over one padding mask: the second layer's summary is not computed
    again; its kernel reads the first layer's lists (on every call, not only the first)."""
    b, t = 2, 75
    x = torch.randn(b, 2, t, 16, device=DEVICE)
    w1, w2 = (torch.randn(16, 16, device=DEVICE) * 0.3 for _ in range(2))
    keep = torch.ones(b, t, dtype=torch.long, device=DEVICE)
    keep[0, :20] = 0
    keep[1, 60:] = 0
    torch._dynamo.reset()
    report = tilefuse.explain(two_layers_one_mask, x, keep, w1, w2, options={"target": target})
    assert [str(k_.kind) for k_ in report.kernels].count("block-summary") == 4, str(report)
    assert sum("not run — the same mask" in n for k_ in report.kernels for n in k_.notes) == 2
    fn = _compiled(two_layers_one_mask, target)
    for call in range(3):  # (the third runs the generated call)
        keep[1, 60 - 10 * call:] = 0
        out = fn(x, keep, w1, w2)
        ref = two_layers_one_mask(x.double(), keep, w1.double(), w2.double())
        eager_err = (two_layers_one_mask(x, keep, w1, w2).double() - ref).abs().max().item()
        assert (out.double() - ref).abs().max().item() <= 2 * eager_err + 1e-5


@pytest.mark.parametrize("target", TARGETS)
def test_a_nan_in_a_float_mask_keeps_its_key_masked(target):
    """`where(x > 0, s, -inf)` masks where x is NaN (the comparison is false): the summary
    negates it as `not`, never as `x <= 0` (review regression)."""
    t = 128
    q, k, v = (torch.randn(1, 2, t, 16, device=DEVICE) for _ in range(3))
    x = torch.rand(t, t, device=DEVICE) + 0.1
    x[:, 64:] = float("nan")

    def fn(q, k, v, x):
        s = q @ k.transpose(-1, -2) * 0.25
        return torch.softmax(torch.where(x > 0, s, float("-inf")), -1) @ v

    out = _compiled(fn, target)(q, k, v, x)
    torch.testing.assert_close(out.double(), fn(q.double(), k.double(), v.double(), x.double()), atol=1e-5, rtol=1e-5)


def test_pytorchs_boolean_mask_bias_is_not_a_mask_for_extreme_scores():
    """A bias of -65504 is not far enough below every score: with scores of ±1e5 eager weights
    masked keys, and so must the compiled program (review regression). The scores' bound fails
    at run time and every key is visited."""
    t = 128
    q = torch.randn(1, 2, t, 16, device=DEVICE) * 3e4
    k, v = (torch.randn(1, 2, t, 16, device=DEVICE) for _ in range(2))
    keep = torch.ones(t, t, dtype=torch.bool, device=DEVICE)
    keep[:, 64:] = False

    def fn(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) + torch.where(keep, 0.0, -65504.0), -1) @ v

    torch._dynamo.reset()
    report = tilefuse.explain(fn, q, k, v)
    assert [k_.kind for k_ in report.kernels] == SUMMARY + GUARD + ["flash"], str(report)
    out = _compiled(fn, "auto")(q, k, v)
    ref = fn(q.double(), k.double(), v.double())
    eager_err = (fn(q, k, v).double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * eager_err + 1e-3


#: the kernels that bound the scores under a finite fill: query norms, key norms
GUARD = ["block-summary", "block-summary"]


def cudnn_bias_attention(q, k, v, keep):
    """What PyTorch's CUDA attention makes of a boolean mask: a bias of 0 and -65504."""
    return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + torch.where(keep, 0.0, -65504.0), -1) @ v


@pytest.mark.parametrize("target", TARGETS)
def test_a_finite_fill_skips_where_the_scores_are_bounded(target):
    """Under a fill of -65504 the flash program skips dead tiles where its scores provably lie
    within |fill|/4 (random q, k): a NaN in the last value row stays out of the first block of
    rows. Where one batch element's scores are extreme, only its programs visit every key —
    and then read the NaN, as eager does."""
    t = 150
    keep = torch.tril(torch.ones(t, t, dtype=torch.bool, device=DEVICE))
    q, k, v = (torch.randn(2, 3, t, 16, device=DEVICE) for _ in range(3))
    torch._dynamo.reset()
    report = tilefuse.explain(cudnn_bias_attention, q, k, v, keep, options={"target": target})
    assert [k_.kind for k_ in report.kernels] == SUMMARY + GUARD + ["flash"], str(report)
    fn = _compiled(cudnn_bias_attention, target)
    ref = cudnn_bias_attention(q.double(), k.double(), v.double(), keep)
    torch.testing.assert_close(fn(q, k, v, keep).double(), ref, atol=1e-5, rtol=1e-5)

    poisoned = v.clone()
    poisoned[..., -1, :] = float("nan")
    extreme = q.clone()
    extreme[0] *= 2e4  # scores of ±1e5 in batch element 0 only
    out = fn(extreme, k, poisoned, keep)
    eager = cudnn_bias_attention(extreme, k, poisoned, keep)
    assert torch.isnan(eager[:, :, :32]).all()  # eager reads the masked row (0 · NaN)
    assert torch.isfinite(out[1, :, :32]).all()  # bounded: the last tile is skipped
    assert torch.isnan(out[0, :, :32]).all()  # unbounded: every key visited, as eager does
    ref = cudnn_bias_attention(extreme.double(), k.double(), v.double(), keep)
    out = fn(extreme, k, v, keep)
    eager_err = (cudnn_bias_attention(extreme, k, v, keep).double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * eager_err + 1e-5


def cuda_sdpa_with_a_boolean_mask(q, k, v, keep):
    """What `F.scaled_dot_product_attention(q, k, v, attn_mask=keep)` traces to on CUDA: the
    mask made a -65504 bias, handed to the memory-efficient kernel (whose lowering adds
    PyTorch's safe-softmax test, `any(s != -inf)`, per row)."""
    bias = torch.where(keep.logical_not(), -65504.0, 0.0).to(q.dtype)
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, False)[0]


@pytest.mark.parametrize("target", TARGETS)
def test_pytorchs_cuda_attention_op_with_a_boolean_mask_skips(target):
    """The fused op's safe-softmax test is true at a masked key as at a live one under a
    finite fill: skipping is still exact. Left-padded rows (no live key) weight every key."""
    b, t = 2, (150 if target == "cpu" else 96)  # (the interpreter's time grows with t²)
    pad = torch.ones(b, t, dtype=torch.bool, device=DEVICE)
    pad[1, :40] = False
    keep = (torch.tril(torch.ones(t, t, dtype=torch.bool, device=DEVICE))[None] & pad[:, None, :])[:, None]
    q, k, v = (torch.randn(b, 3, t, 16, device=DEVICE) for _ in range(3))
    torch._dynamo.reset()
    report = tilefuse.explain(cuda_sdpa_with_a_boolean_mask, q, k, v, keep, options={"target": target})
    assert [k_.kind for k_ in report.kernels] == SUMMARY + GUARD + ["flash"], str(report)
    poisoned = v.clone()
    poisoned[0, :, -1, :] = float("nan")  # the last key of sequence 0: masked for its first rows
    out = _compiled(cuda_sdpa_with_a_boolean_mask, target)(q, k, poisoned, keep)
    assert torch.isfinite(out[0, :, :32]).all()
    ref = cudnn_bias_attention(q.double(), k.double(), v.double(), keep)  # the op's math
    torch.testing.assert_close(out[0, :, :32].double(), ref[0, :, :32], atol=1e-5, rtol=1e-5)
    out = _compiled(cuda_sdpa_with_a_boolean_mask, target)(q, k, v, keep)
    eager_err = (cudnn_bias_attention(q, k, v, keep).double() - ref).abs().max().item()  # (s - 65504 in fp32)
    assert (out.double() - ref).abs().max().item() <= 2 * eager_err + 1e-5


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("spelling", ["masked_fill_1e9", "scaled_after_1e4"])
def test_other_finite_fills_skip_too(target, spelling):
    """Older code's fills: `masked_fill(~keep, -1e9)` (the masked score is the fill itself) and
    a -1e4 bias added before the scale (the fill is scaled with the scores)."""
    t, d = 97, 16
    keep = torch.rand(t, t, device=DEVICE) > 0.5
    keep[:, 48:] = False
    keep[:, 0] = True

    def fn(q, k, v, keep):
        if spelling == "masked_fill_1e9":
            s = (q @ k.transpose(-1, -2) * 0.25).masked_fill(~keep, -1e9)
        else:
            s = (q @ k.transpose(-1, -2) + torch.where(keep, 0.0, -1e4)) * 0.25
        return torch.softmax(s, -1) @ v

    q, k, v = (torch.randn(1, 2, t, d, device=DEVICE) for _ in range(3))
    torch._dynamo.reset()
    report = tilefuse.explain(fn, q, k, v, keep, options={"target": target})
    assert [k_.kind for k_ in report.kernels] == SUMMARY + GUARD + ["flash"], str(report)
    poisoned = v.clone()
    poisoned[..., -1, :] = float("nan")  # masked for every row: only the unbounded path reads it
    out = _compiled(fn, target)(q, k, poisoned, keep)
    assert torch.isfinite(out).all()
    ref = fn(q.double(), k.double(), v.double(), keep)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("target", TARGETS)
def test_bf16_operands_under_a_finite_fill(target):
    """bf16 q, k, v and a bf16 bias of -65504 (-65536 once rounded): the norms are taken of
    the operands as the product sees them."""
    if target == "interpret":
        pytest.skip("bf16 attention through the interpreter is covered by the C++ backend and the GPU")
    t = 133
    keep = torch.tril(torch.ones(t, t, dtype=torch.bool, device=DEVICE))

    def fn(q, k, v, keep):
        s = q @ k.transpose(-1, -2) * 0.25
        return torch.softmax(s + torch.where(keep, 0.0, -65504.0).to(s.dtype), -1) @ v

    q, k, v = (torch.randn(2, 2, t, 32, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    torch._dynamo.reset()
    report = tilefuse.explain(fn, q, k, v, keep, options={"target": target})
    assert [k_.kind for k_ in report.kernels] == SUMMARY + GUARD + ["flash"], str(report)
    out = _compiled(fn, target)(q, k, v, keep)
    ref = fn(q.double(), k.double(), v.double(), keep)
    eager_err = (fn(q, k, v, keep).double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * eager_err + 1e-5


@pytest.mark.parametrize("target", TARGETS)
def test_rows_without_a_live_key_under_a_finite_fill_follow_eager(target):
    """Left padding under a -65504 fill: a query row with no live key weights every key by
    its score (eager), and so does the compiled program (its block walks every key)."""
    b, t = 2, 83
    q, k, v = (torch.randn(b, 2, t, 16, device=DEVICE) for _ in range(3))
    pad = torch.ones(b, t, dtype=torch.bool, device=DEVICE)
    pad[0, :37] = False
    keep = (torch.tril(torch.ones(t, t, dtype=torch.bool, device=DEVICE))[None] & pad[:, None, :])[:, None]
    out = _compiled(cudnn_bias_attention, target)(q, k, v, keep)
    ref = cudnn_bias_attention(q.double(), k.double(), v.double(), keep)
    eager_err = (cudnn_bias_attention(q, k, v, keep).double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * eager_err + 1e-5
    assert (ref[0, :, :37] - ref[0, :, :37].mean(-2, keepdim=True)).abs().max() > 1e-3  # not uniform weights


def test_a_finite_fill_around_soft_capped_scores_gets_no_bound():
    """Only scores that are c·q·kᵀ have a bound from the operands' norms: behind `tanh` the
    mask is read per tile and nothing is skipped (still exact)."""
    t = 70
    keep = torch.tril(torch.ones(t, t, dtype=torch.bool, device=DEVICE))

    def fn(q, k, v, keep):
        s = torch.tanh(q @ k.transpose(-1, -2) / 30) * 30
        return torch.softmax(s + torch.where(keep, 0.0, -65504.0), -1) @ v

    q, k, v = (torch.randn(1, 2, t, 16, device=DEVICE) for _ in range(3))
    torch._dynamo.reset()
    report = tilefuse.explain(fn, q, k, v, keep)
    assert [k_.kind for k_ in report.kernels] == ["flash"], str(report)
    out = _compiled(fn, "auto")(q, k, v, keep)
    torch.testing.assert_close(out.double(), fn(q.double(), k.double(), v.double(), keep), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("rows,keys", [(17, 17), (100, 30), (5, 2)])
def test_masks_over_a_single_key_tile(target, rows, keys):
    """All keys in one tile: the ranges kernel still folds a row of classes (review
    regression: a one-lane row folded away to a 0-d value)."""
    q = torch.randn(1, 2, rows, 16, device=DEVICE)
    k, v = (torch.randn(1, 2, keys, 16, device=DEVICE) for _ in range(2))
    keep = torch.rand(rows, keys, device=DEVICE) > 0.4
    keep[:, 0] = True

    def fn(q, k, v, keep):
        s = q @ k.transpose(-1, -2) * 0.25
        return torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v

    out = _compiled(fn, target)(q, k, v, keep)
    torch.testing.assert_close(out.double(), fn(q.double(), k.double(), v.double(), keep), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("target", TARGETS)
def test_a_mask_computed_from_the_scores_reads_them_per_tile(target):
    """`s.masked_fill(s < t, -inf)` masks by the scores themselves, which never reach memory:
    no summary can read them (review regression)."""
    q, k, v = (torch.randn(1, 2, 70, 16, device=DEVICE) for _ in range(3))

    def fn(q, k, v):
        s = q @ k.transpose(-1, -2) * 0.25
        return torch.softmax(s.masked_fill(s < -0.5, float("-inf")), -1) @ v

    torch._dynamo.reset()
    report = tilefuse.explain(fn, q, k, v, options={"target": target})
    assert [k_.kind for k_ in report.kernels] == ["flash"], str(report)
    out = _compiled(fn, target)(q, k, v)
    torch.testing.assert_close(out.double(), fn(q.double(), k.double(), v.double()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("target", TARGETS)
def test_a_minus_inf_mask_and_a_finite_fill_mask_classify_together(target):
    """A `tril` buffer added as -inf and a random keep-mask added as -1e4: the tiles the
    summary finds wholly live drop both masks, so both decide the classes (review regression:
    the -1e4 mask was dropped on tiles classified by the -inf mask alone)."""
    t = 128
    keep = torch.tril(torch.ones(t, t, dtype=torch.bool, device=DEVICE))
    pad = torch.rand(t, t, device=DEVICE) > 0.5

    def fn(q, k, v, keep, pad):
        s = q @ k.transpose(-1, -2) * 0.25
        s = s + torch.where(keep, 0.0, float("-inf")) + torch.where(pad, 0.0, -1e4)
        return torch.softmax(s, -1) @ v

    q, k, v = (torch.randn(1, 2, t, 16, device=DEVICE) for _ in range(3))
    torch._dynamo.reset()
    report = tilefuse.explain(fn, q, k, v, keep, pad, options={"target": target})
    assert [k_.kind for k_ in report.kernels] == SUMMARY + GUARD + ["flash"], str(report)
    out = _compiled(fn, target)(q, k, v, keep, pad)
    ref = fn(q.double(), k.double(), v.double(), keep, pad)
    eager_err = (fn(q, k, v, keep, pad).double() - ref).abs().max().item()  # (s - 1e4 rounds in fp32)
    assert (out.double() - ref).abs().max().item() <= 2 * eager_err + 1e-5


def test_fp64_attention_keeps_only_fills_its_exp_underflows_under():
    """In fp64 exp(-543) is not 0: a fill of -1024 gets no bound there (its bound would leave
    a gap of 512), and a masked key weighted 1e-236 times a value of 1e230 still counts."""
    t, d = 256, 16
    keep = torch.zeros(t, t, dtype=torch.bool, device=DEVICE)
    keep[:, :128] = True

    def fn(q, k, v, keep):
        return torch.softmax(q @ k.transpose(-1, -2) + torch.where(keep, 0.0, -1024.0), -1) @ v

    q = torch.zeros(1, 1, t, d, dtype=torch.float64, device=DEVICE)
    q[..., 0] = 15.5
    k = torch.zeros(1, 1, t, d, dtype=torch.float64, device=DEVICE)
    k[..., :128, 0], k[..., 128:, 0] = -15.5, 15.5
    v = torch.zeros(1, 1, t, d, dtype=torch.float64, device=DEVICE)
    v[..., 128:, :] = 1e230
    torch._dynamo.reset()
    assert [k_.kind for k_ in tilefuse.explain(fn, q, k, v, keep).kernels] == ["flash"]
    out = _compiled(fn, "auto")(q, k, v, keep)
    torch.testing.assert_close(out, fn(q, k, v, keep), rtol=1e-9, atol=0)
    assert out[0, 0, 0, 0].item() > 0  # the masked keys' weight survives


@pytest.mark.parametrize("target", TARGETS)
def test_the_key_norms_cover_every_chunk_of_keys(target):
    """Keys past the first chunk count in the bound: one extreme key there (masked)
    makes the programs of its batch element visit every key, and read a NaN value row as eager
    does; without it the dead tiles are skipped."""
    rows, keys = 40, 1100
    keep = torch.zeros(rows, keys, dtype=torch.bool, device=DEVICE)
    keep[:, :500] = True
    q, k, v = torch.randn(2, 1, rows, 16, device=DEVICE), torch.randn(2, 1, keys, 16, device=DEVICE), \
        torch.randn(2, 1, keys, 16, device=DEVICE)
    v[:, :, 1080] = float("nan")
    fn = _compiled(cudnn_bias_attention, target)
    assert torch.isfinite(fn(q, k, v, keep)).all()  # bounded: the tiles past key 500 are skipped
    k[1, :, 1050] *= 3e4
    out = fn(q, k, v, keep)
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all()
