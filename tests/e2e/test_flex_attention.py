"""FlexAttention programs through tilefuse (`frontend.flex_attention`): the op is replaced by
its definition before AOTAutograd traces, and the fusion planner derives one flash kernel from
it. Checked against eager's own FlexAttention in fp64 (its reference implementation), with
eager fp32's error as the yardstick; sizes not multiples of any block, masks from indices and
from captured tensors, rows masked throughout, grouped-query attention, the log-sum-exp."""
import pytest
import torch

import tilefuse

fa = pytest.importorskip("torch.nn.attention.flex_attention")
flex_attention, create_block_mask = fa.flex_attention, fa.create_block_mask

B, H, L, S, D = 2, 4, 72, 200, 16


def _inputs(hq=H, hkv=H, q_len=L, kv_len=S, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, hq, q_len, D, generator=g)
    k = torch.randn(B, hkv, kv_len, D, generator=g)
    v = torch.randn(B, hkv, kv_len, D, generator=g)
    return q, k, v


def _variant(name, q_len=L, kv_len=S):
    """(score_mod, mask_mod) of a named variant; their tensors are drawn fresh."""
    g = torch.Generator().manual_seed(1)
    slopes = torch.rand(H, generator=g)
    doc = torch.randint(0, 3, (max(q_len, kv_len),), generator=g).sort().values
    lens = torch.tensor([kv_len, kv_len // 2 + 3])
    if name == "causal":
        return None, lambda b, h, i, j: i >= j
    if name == "alibi":
        return (lambda s, b, h, i, j: s - slopes[h] * (i - j).abs()), (lambda b, h, i, j: i >= j)
    if name == "softcap":
        return (lambda s, b, h, i, j: 20 * torch.tanh(s / 20)), None
    if name == "window":
        return None, lambda b, h, i, j: (i - j).abs() <= 24
    if name == "document":
        return None, lambda b, h, i, j: doc[i] == doc[j]
    if name == "padding":  # query rows past a sequence's length are masked throughout
        return None, lambda b, h, i, j: (i < lens[b] - 40) & (j < lens[b])
    raise ValueError(name)


def _program(score_mod, mask_mod, q_len=L, kv_len=S, **kw):
    block_mask = create_block_mask(mask_mod, B=B, H=None, Q_LEN=q_len, KV_LEN=kv_len, device="cpu") \
        if mask_mod is not None else None

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, **kw)

    return fn


def _check(fn, args, options=None, tol=1e-5):
    torch._dynamo.reset()
    got = tilefuse.compile(fn, options=options)(*args)
    ref = fn(*(a.double() for a in args))
    eager = fn(*args)
    outs = (got, ref, eager) if isinstance(got, tuple) else ((got,), (ref,), (eager,))
    for g, r, e in zip(*outs):
        live = torch.isfinite(r)
        assert torch.equal(live, torch.isfinite(g)), "masked entries differ"
        err = (g.double() - r)[live].abs().max().item()
        eager_err = (e.double() - r)[live].abs().max().item()
        assert err <= 4 * eager_err + tol * r[live].abs().max().item(), (err, eager_err)
    return got


@pytest.mark.parametrize("name", ["causal", "alibi", "softcap", "window", "document", "padding"])
def test_variants_are_one_flash_kernel(name):
    score_mod, mask_mod = _variant(name)
    fn = _program(score_mod, mask_mod)
    args = _inputs()
    got = _check(fn, args)
    torch._dynamo.reset()
    report = tilefuse.explain(fn, *args)
    assert not report.externs, "flex_attention stayed an extern"
    assert [k.kind for k in report.kernels if k.kind != "block-summary"] == ["flash"], report
    if name == "padding":  # rows masked throughout give 0, not NaN
        dead = torch.arange(L)[None, :] >= torch.tensor([S, S // 2 + 3])[:, None] - 40
        assert got[dead[:, None, :, None].expand_as(got)].abs().max() == 0


def test_grouped_query_attention_with_log_sum_exp_on_the_interpreter():
    score_mod, mask_mod = _variant("alibi")
    fn = _program(score_mod, mask_mod, enable_gqa=True, return_lse=True)
    q, k, v = _inputs(hq=H, hkv=2)
    out, lse = _check(fn, (q, k, v), options={"target": "interpret"})
    assert out.shape == (B, H, L, D) and lse.shape == (B, H, L)


def test_strided_inputs_and_broadcast_batch():
    score_mod, mask_mod = _variant("window")
    fn = _program(score_mod, mask_mod)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, L, H, D, generator=g).transpose(1, 2)  # (B, H, L, D) with heads inner
    k = torch.randn(1, H, S, D, generator=g)  # one batch row, broadcast over the query's
    v = torch.randn(1, S, H, D, generator=g).transpose(1, 2)
    _check(fn, (q, k, v))


def test_score_function_that_reduces_stays_an_extern():
    table = torch.randn(H, 5)
    fn = _program(lambda s, b, h, i, j: s + table[h].sum(), None)  # a sum per score: not broadcast-safe
    args = _inputs()
    _check(fn, args)
    torch._dynamo.reset()
    report = tilefuse.explain(fn, *args)
    assert report.externs, "a reducing score function was rewritten"


@pytest.mark.parametrize("name", ["causal", "padding"])
def test_training_gradients(name, monkeypatch):
    # eager FlexAttention refuses a backward on a CPU in its front function only; its definition
    # (the fp64 reference here) and tilefuse's compiled backward run there
    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)
    slopes = torch.rand(H, generator=torch.Generator().manual_seed(5), requires_grad=True)
    _, mask_mod = _variant(name)
    fn = _program(lambda s, b, h, i, j: s - slopes[h] * (i - j).abs(), mask_mod)
    q, k, v = (t.requires_grad_() for t in _inputs())
    grad = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(6))
    torch._dynamo.reset()
    out = tilefuse.compile(fn)(q, k, v)
    got = torch.autograd.grad(out, (q, k, v, slopes), grad)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    slopes64 = slopes.detach().double().requires_grad_()
    fn64 = _program(lambda s, b, h, i, j: s - slopes64[h] * (i - j).abs(), mask_mod)
    ref = torch.autograd.grad(fn64(*leaves64), (*leaves64, slopes64), grad.double())
    eager = torch.autograd.grad(fn(q, k, v), (q, k, v, slopes), grad)
    assert (out.double() - fn64(*leaves64)).abs().max() < 1e-5
    for g, r, e in zip(got, ref, eager):
        assert torch.isfinite(g).all()
        err, eager_err = (g.double() - r).abs().max().item(), (e.double() - r).abs().max().item()
        assert err <= 4 * eager_err + 1e-5 * r.abs().max().item(), (err, eager_err)


def test_symbolic_sizes():
    # dynamic=True: the sequence length is a symbol (the scale Dynamo passes may be one too);
    # one compiled program serves three lengths, none a multiple of a block
    score_mod, mask_mod = _variant("causal")
    compiled = tilefuse.compile(
        lambda q, k, v, bm: flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s * 0.5, block_mask=bm),
        dynamic=True)
    torch._dynamo.reset()
    for n in (40, 72, 130):
        q, k, v = _inputs(q_len=n, kv_len=n, seed=n)
        bm = create_block_mask(mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=n, device="cpu")
        ref = flex_attention(q.double(), k.double(), v.double(), score_mod=lambda s, b, h, i, j: s * 0.5, block_mask=bm)
        assert (compiled(q, k, v, bm).double() - ref).abs().max() < 1e-5
    torch._dynamo.reset()
    report = tilefuse.explain(lambda q, k, v: flex_attention(q, k, v, block_mask=bm), q, k, v, dynamic=True)
    assert not report.externs, report


def test_half_precision_training_products_stay_half_precision(monkeypatch):
    # the backward's products (dV, dP, dQ, dKᵀ) read bf16 operands, as FlexAttention's and
    # FlashAttention's backward kernels do: dS is rounded to the inputs' dtype before dQ and dKᵀ
    # (eager's fp32 definition would make those two fp32 products, off the tensor cores)
    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)
    _, mask_mod = _variant("padding")
    fn = _program(lambda s, b, h, i, j: 20 * torch.tanh(s / 20), mask_mod)
    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in _inputs())
    torch._dynamo.reset()
    report = tilefuse.explain(fn, q, k, v)
    backward = report.reports[1].graph_ir
    products = [line for line in backward.splitlines() if line.rstrip().split("# ")[-1].startswith("bmm")
                and "sum[" in line and ": bfloat16[" in line]
    assert len(products) == 4, backward  # dV, dP, dQ, dKᵀ (the recomputed scores stay fp32)
    for line in products:
        body = line.split("sum[", 1)[1]
        assert body.count("float32(") == 2, line  # both factors upcast from bf16
    kinds = [k.kind for k in report.reports[1].kernels]
    assert kinds.count("flash") >= 2 and "contraction" not in kinds, kinds  # no product materialises scores


def test_autocast():
    # under autocast the op converts q, k and v to autocast's dtype (where this PyTorch's op
    # has that rule) and computes the rest as without it
    import importlib

    hop = importlib.import_module("torch._higher_order_ops.flex_attention")
    score_mod, mask_mod = _variant("alibi")
    fn = _program(score_mod, mask_mod)
    args = _inputs()
    rounded = hasattr(hop, "_flex_attention_autocast_impl")
    ref = fn(*((a.to(torch.bfloat16) if rounded else a).double() for a in args))
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = tilefuse.compile(fn)(*args)
        eager = fn(*args)
    assert got.dtype == eager.dtype
    err, eager_err = (got.double() - ref).abs().max().item(), (eager.double() - ref).abs().max().item()
    assert err <= 4 * eager_err + 1e-5, (err, eager_err)


def test_training_log_sum_exp_gradient(monkeypatch):
    # with return_lse the log-sum-exp carries its own gradient into dQ and dK
    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)
    fn = _program(None, _variant("causal")[1], return_lse=True)
    q, k, v = (t.double().requires_grad_() for t in _inputs())
    weights = torch.randn(L, dtype=torch.float64, generator=torch.Generator().manual_seed(7))

    def loss(out, lse):
        return out.sum() + (lse * weights).sum()

    ref = torch.autograd.grad(loss(*fn(q, k, v)), (q, k, v))
    torch._dynamo.reset()
    got = torch.autograd.grad(loss(*tilefuse.compile(fn)(q, k, v)), (q, k, v))
    for g, r in zip(got, ref):
        assert (g - r).abs().max() < 1e-10


def test_score_function_not_finite_under_the_mask(monkeypatch):
    # log1p(i - j) is NaN above the diagonal, where the mask drops the score: its gradient there
    # is 0 (eager zeroes the scores' gradient under the mask), not 0 · NaN
    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)
    fn = _program(lambda s, b, h, i, j: s * torch.log1p((i - j).to(s.dtype)), _variant("causal")[1])
    q, k, v = (t.double().requires_grad_() for t in _inputs())
    ref = torch.autograd.grad(fn(q, k, v).sum(), (q, k, v))
    torch._dynamo.reset()
    got = torch.autograd.grad(tilefuse.compile(fn)(q, k, v).sum(), (q, k, v))
    for g, r in zip(got, ref):
        assert torch.isfinite(g).all() and (g - r).abs().max() < 1e-10


def test_tensor_fill_value_stays_an_extern():
    # masked_fill with a value per head is one value per score under eager's vmap, a 4-D tensor
    # on whole index tensors (which masked_fill refuses): the op is left to eager
    fill = torch.randn(H)
    fn = _program(lambda s, b, h, i, j: s.masked_fill(j > i, fill[h]), None)
    args = _inputs()
    _check(fn, args)
    torch._dynamo.reset()
    assert tilefuse.explain(fn, *args).externs


def test_double_inputs_under_autocast_are_not_converted():
    fn = _program(*_variant("alibi"))
    args = tuple(a.double() for a in _inputs())
    ref = fn(*args)
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = tilefuse.compile(fn)(*args)
    assert got.dtype == torch.float64 and (got - ref).abs().max() < 1e-10
