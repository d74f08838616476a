"""Training: an attention chain becomes one autograd function — the forward is one flash
kernel that also stores the logsumexp, the backward recomputes the probabilities from it —
for score functions the compiler was never told about. Gradients are checked against an
fp64 eager reference; what the forward saves is read from the backward graph's inputs."""
import math
import os
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tilefuse
from tilefuse.frontend.attention_chains import find_chain

T, C, H = 37, 48, 3
DEVICE = os.environ.get("TILEFUSE_TEST_DEVICE", "cpu")


class NanoAttention(nn.Module):
    """nanoGPT's manual attention: a `tril` buffer, masked_fill, softmax, dropout."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.c_attn = nn.Linear(C, 3 * C)
        self.register_buffer("bias", torch.tril(torch.ones(T, T)).view(1, 1, T, T))
        self.drop = nn.Dropout(dropout)

    def heads(self, x):
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        return [z.view(b, t, H, C // H).transpose(1, 2) for z in (q, k, v)]

    def forward(self, x):
        q, k, v = self.heads(x)
        t = x.shape[1]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = self.drop(F.softmax(att, dim=-1))
        return att @ v


class SoftCapped(NanoAttention):
    """Gemma-2's soft-capping and a learnable per-head bias on the distance (ALiBi-like): the
    bias's gradient comes out of the chain too."""

    def __init__(self):
        super().__init__()
        self.slopes = nn.Parameter(torch.rand(H, 1, 1))

    def forward(self, x):
        q, k, v = self.heads(x)
        t = x.shape[1]
        att = torch.matmul(q, k.transpose(2, 3)) * 0.2
        att = torch.tanh(att / 5.0) * 5.0
        i, j = torch.arange(t, device=x.device)[:, None], torch.arange(t, device=x.device)[None, :]
        att = att - self.slopes * (i - j).abs()
        return torch.matmul(F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype), v)


class SoftCapOnly(NanoAttention):
    """Soft-capping (tanh) and a fixed distance bias: no parameter inside the score function."""

    def forward(self, x):
        q, k, v = self.heads(x)
        t = x.shape[1]
        att = torch.tanh(torch.matmul(q, k.transpose(2, 3)) * 0.04) * 5.0
        i, j = torch.arange(t, device=x.device)[:, None], torch.arange(t, device=x.device)[None, :]
        return torch.matmul(F.softmax(att - 0.1 * (i - j).abs(), dim=-1), v)


class HFStyle(NanoAttention):
    """Hugging Face's eager attention: an additive mask of finfo.min from a padding mask."""

    def forward(self, x, keep):
        q, k, v = self.heads(x)
        att = torch.matmul(q, k.transpose(2, 3)) * C ** -0.5
        mask = torch.zeros(keep.shape, dtype=att.dtype, device=x.device).masked_fill(~keep, torch.finfo(att.dtype).min)
        att = att + mask[:, None, None, :]
        return torch.matmul(nn.functional.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _inputs(model):
    x = torch.randn(2, T, C, device=DEVICE)
    if isinstance(model, HFStyle):
        keep = torch.ones(2, T, dtype=torch.bool, device=DEVICE)
        keep[1, :5] = False  # left padding
        return (x, keep)
    return (x,)


def _grads(model, inputs, autocast=False):
    model.zero_grad()
    with torch.autocast(DEVICE, torch.bfloat16, enabled=autocast):
        out = model(*inputs)
    weight = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)  # not a plain sum: every row differs
    (out.float() * weight).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def _saved_square(report, t) -> list:
    """The backward graph's inputs whose last two dims are t × t, other than the model's own
    inputs and buffers (`primals_*`: the `tril` buffer): saved probabilities or scores."""
    sig = report.graph_ir.splitlines()[0]
    return [a for a in re.findall(rf"\w+: \w+\[[^\]]*\b{t}, {t}\]", sig) if not a.startswith("primals_")]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
@pytest.mark.parametrize("cls", [NanoAttention, SoftCapOnly, SoftCapped, HFStyle], ids=lambda c: c.__name__)
def test_chain_trains_through_one_flash_kernel(cls, autocast):
    """The forward is one flash kernel that saves no T×T tensor; the backward's products
    (dV = Pᵀ·dO, dQ = dS·K, dKᵀ = Qᵀ·dS) recompute the probabilities tile by tile from Q·Kᵀ
    and dO·Vᵀ — two flash kernels (dKᵀ and dV share their score tiles; dKᵀ is stored
    transposed), nothing T×T in memory — except where a parameter inside the score function
    needs a sum over the whole T×T gradient (`SoftCapped`'s slopes)."""
    torch.manual_seed(0)
    model = cls().to(DEVICE)
    inputs = _inputs(model)
    ref = _grads(model.double(), [t.double() if t.is_floating_point() else t for t in inputs])
    model.float()
    eager = _grads(model, inputs, autocast)
    torch._dynamo.reset()
    with torch.autocast(DEVICE, torch.bfloat16, enabled=autocast):
        report = tilefuse.explain(model, *inputs)
    forward, backward = report.reports
    assert "flash" in [k.kind for k in forward.kernels], str(report)
    assert _saved_square(backward, T) == [], backward.graph_ir.splitlines()[0]
    recomputed = [k for k in backward.kernels if k.kind == "flash"]
    assert len(recomputed) == (0 if cls is SoftCapped else 2), str(report)
    for k in recomputed:
        assert any("weights recomputed per tile" in n for n in k.notes)
    assert sorted(sum("weights recomputed per tile" in n for n in k.notes) for k in recomputed) == \
        ([] if cls is SoftCapped else [1, 2])
    torch._dynamo.reset()
    got = _grads(torch.compile(model, backend="tilefuse"), inputs, autocast)
    tol = 1e-4 if not autocast else 2e-2
    for r, e, g in zip(ref, eager, got):
        eager_err = (e.double() - r).abs().max().item()
        assert (g.double() - r).abs().max().item() <= 2 * eager_err + tol * r.abs().max().item()


def test_without_the_knob_the_probabilities_are_saved():
    torch.manual_seed(0)
    model = NanoAttention()
    torch._dynamo.reset()
    report = tilefuse.explain(model, torch.randn(2, T, C), options={"attention_backward": False})
    assert _saved_square(report.reports[1], T), report.reports[1].graph_ir.splitlines()[0]


def _chain_of(fn, *inputs):
    """find_chain's answer for the softmax of `fn`'s Dynamo graph."""
    found = []

    def backend(gm, example_inputs):
        found.extend(find_chain(n) for n in gm.graph.nodes
                     if n.op in ("call_function", "call_method") and "softmax" in str(n.target))
        return gm

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*inputs)
    (answer,) = found
    return answer


def test_chains_that_a_recomputation_or_the_row_term_would_break_are_left_alone():
    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    # dropout inside the score function differs when recomputed
    why = _chain_of(lambda q, k, v: F.softmax(F.dropout(q @ k.transpose(-1, -2), 0.5), -1) @ v, q, k, v)
    assert "differ when recomputed" in why
    # dropout of the probabilities is regenerated, not refused; an in-place one is refused
    chain = _chain_of(lambda q, k, v: F.dropout(F.softmax(q @ k.transpose(-1, -2), -1), 0.5) @ v, q, k, v)
    assert chain.dropout == 0.5
    why = _chain_of(lambda q, k, v: F.dropout(F.softmax(q @ k.transpose(-1, -2), -1), 0.5, inplace=True) @ v, q, k, v)
    assert "dropout" in why
    # two dropouts: D = rowsum(dO ∘ o) holds for one mask, the second is not regenerated
    why = _chain_of(lambda q, k, v: F.dropout(F.dropout(F.softmax(q @ k.transpose(-1, -2), -1), 0.5), 0.2) @ v, q, k, v)
    assert "dropout" in why
    # the probabilities are also returned
    why = _chain_of(lambda q, k, v: (lambda p: (p @ v, p))(F.softmax(q @ k.transpose(-1, -2), -1)), q, k, v)
    assert "outside the chain" in why
    # a softmax over the rows
    why = _chain_of(lambda q, k, v: F.softmax(q @ k.transpose(-1, -2), -2) @ v, q, k, v)
    assert "last dim" in why


class _PhiloxDropout(nn.Module):
    """Dropout with the mask a compiled chain draws for `seed`: kept where the counter-based
    uniform at the element's index is at least p (`random_ops.philox_uniform`)."""

    def __init__(self, p, seed):
        super().__init__()
        self.p, self.seed = p, seed

    def forward(self, x):
        keep = torch.ops.tilefuse.philox_uniform(self.seed, list(x.shape)) >= self.p
        return x * keep.to(x.dtype) / (1 - self.p)


def _seed_of_next_call(generator_seed: int) -> torch.Tensor:
    """The seed a compiled graph with one random op draws right after `manual_seed`."""
    from tilefuse.frontend.lowerings.random import draw_seeds

    torch.manual_seed(generator_seed)
    (seed,) = draw_seeds(1, torch.device(DEVICE))
    return seed


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
def test_dropout_on_the_probabilities_is_regenerated_in_the_backward(autocast):
    """nanoGPT with attention dropout in training: the chain stays one autograd function that
    saves a seed, not a mask — the forward's flash kernel computes the mask per tile, the
    backward's kernels compute it again — and the gradients are those of eager with the same
    mask, against fp64."""
    torch.manual_seed(0)
    model = NanoAttention(dropout=0.3).to(DEVICE)
    x = torch.randn(2, T, C, device=DEVICE)
    torch._dynamo.reset()
    with torch.autocast(DEVICE, torch.bfloat16, enabled=autocast):
        report = tilefuse.explain(model, x)
    forward, backward = report.reports
    assert "flash" in [k.kind for k in forward.kernels], str(report)
    assert _saved_square(backward, T) == [], backward.graph_ir.splitlines()[0]
    assert len([k for k in backward.kernels if k.kind == "flash"]) == 2, str(report)  # (dKᵀ with dV)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tilefuse")
    _grads(compiled, (x,), autocast)  # compiles (tuning may draw random numbers)
    seed = _seed_of_next_call(1234)
    torch.manual_seed(1234)
    got = _grads(compiled, (x,), autocast)
    model.drop = _PhiloxDropout(0.3, seed)
    ref = _grads(model.double(), (x.double(),))
    eager = _grads(model.float(), (x,), autocast)
    tol = 1e-4 if not autocast else 2e-2
    for r, e, g in zip(ref, eager, got):
        eager_err = (e.double() - r).abs().max().item()
        assert (g.double() - r).abs().max().item() <= 2 * eager_err + tol * r.abs().max().item()
    # a new call draws a new mask: different gradients
    again = _grads(compiled, (x,), autocast)
    assert not torch.equal(again[0], got[0])


def test_dropout_that_drops_everything():
    """p = 1 is eager's special case (no scale of 1 / 0): the output and every gradient that
    flows through it are zero, as in eager."""
    torch.manual_seed(0)
    model = NanoAttention(dropout=1.0)
    x = torch.randn(2, T, C)
    torch._dynamo.reset()
    got = _grads(torch.compile(model, backend="tilefuse"), (x,))
    want = _grads(model, (x,))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def _input_grads(fn, *inputs):
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*inputs)
    weight = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape).to(out.dtype)
    (out * weight).sum().backward()
    return [out] + [x.grad for x in inputs]


def _like_eager_against_fp64(fn, *inputs):
    torch._dynamo.reset()
    ref = _input_grads(fn, *(x.double() for x in inputs))
    eager = _input_grads(fn, *inputs)
    torch._dynamo.reset()
    got = _input_grads(torch.compile(fn, backend="tilefuse"), *inputs)
    for r, e, g in zip(ref, eager, got):
        eager_err = (e.double() - r).abs().max().item()
        assert (g.double() - r).abs().max().item() <= 2 * eager_err + 1e-5


def test_rows_masked_throughout_by_a_finite_fill_average_every_key():
    """A query that sees no key under a finfo.min mask (left padding with a causal mask)
    averages every value in eager; the backward must recompute that uniform row, which
    `exp(s − (m + log l))` cannot (m + log l rounds to m at -3.4e38)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 8, device=DEVICE) for _ in range(3))
    keep = torch.ones(9, 9, dtype=torch.bool, device=DEVICE).tril()
    keep[:3] = False

    def attn(q, k, v):
        bias = torch.zeros(9, 9, dtype=q.dtype, device=q.device).masked_fill(~keep, torch.finfo(q.dtype).min)
        return F.softmax(q @ k.transpose(-1, -2) * 0.3 + bias, -1) @ v

    _like_eager_against_fp64(attn, q, k, v)


def test_rows_masked_throughout_by_a_finite_fill_in_a_data_mask_reach_dk_and_dv():
    """The same rows from a mask tensor over several tiles: in the dKᵀ and dV kernels the
    query rows lie along the loop, and a tile of them masked throughout still weighs every key
    1/T — it must not be skipped as dead (dV was off by 0.14 when it was)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 150, 16, device=DEVICE) for _ in range(3))
    keep = torch.rand(150, 150, device=DEVICE) > 0.5
    keep[:64] = False

    def attn(q, k, v, keep):
        s = (q @ k.transpose(-1, -2) * 0.25).masked_fill(~keep, torch.finfo(q.dtype).min)
        return F.softmax(s, -1) @ v

    torch._dynamo.reset()
    ref = _input_grads(lambda *x: attn(*x, keep), *(x.double() for x in (q, k, v)))
    eager = _input_grads(lambda *x: attn(*x, keep), q, k, v)
    torch._dynamo.reset()
    compiled = torch.compile(attn, backend="tilefuse")
    got = _input_grads(lambda *x: compiled(*x, keep), q, k, v)
    for r, e, g in zip(ref, eager, got):
        eager_err = (e.double() - r).abs().max().item()
        assert (g.double() - r).abs().max().item() <= 2 * eager_err + 1e-5


def test_casts_that_read_another_tensor_for_its_dtype():
    """Meta's Llama: `softmax(scores.float()).type_as(xq) @ values`."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 13, 8, device=DEVICE) for _ in range(3))
    _like_eager_against_fp64(
        lambda q, k, v: torch.matmul(F.softmax((q @ k.transpose(2, 3) / 8 ** 0.5).float(), -1).type_as(q), v), q, k, v)
