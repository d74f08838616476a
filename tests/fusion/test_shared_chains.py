"""A chain of shared bodies — a transformer's residual stream, each sum read by its layer's
norm and by the next sum — is realised link by link (`fusion.inline`), so a layer's norm reads
the residual once instead of every earlier layer's output; checked against an fp64 reference
on both backends, at sizes where links are realised and at sizes where short chains stay
inlined."""
import os

import pytest
import torch

import tilefuse
from backends_on_cpu import CPU_BACKENDS
from tilefuse.fusion import inline

DEVICE = os.environ.get("TILEFUSE_TEST_DEVICE", "cpu")
TARGETS = CPU_BACKENDS if DEVICE == "cpu" else ["auto"]


class RMSNorm(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(v + 1e-6)).to(x.dtype) * self.weight


class ResidualStream(torch.nn.Module):
    """Hugging Face Llama's layer shape: `h = h + attn(norm(h))`, `h = h + mlp(norm(h))`,
    reduced to one linear layer each; the stream starts at an embedding."""

    def __init__(self, d, layers, vocab=50):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.norms = torch.nn.ModuleList(RMSNorm(d) for _ in range(2 * layers))
        self.linears = torch.nn.ModuleList(torch.nn.Linear(d, d, bias=False) for _ in range(2 * layers))
        self.final = RMSNorm(d)

    def forward(self, ids):
        h = self.embed(ids)
        for norm, linear in zip(self.norms, self.linears):
            h = h + linear(norm(h))
        return self.final(h)


def _norm_reads(report) -> list:
    """How many buffers each norm kernel of the forward reads, in order."""
    return [len(k.tile.reads) for k in report.reports[0].kernels
            if k.kind == "reduction" and not isinstance(k.tile, str)]


def _check(model, ids, target):
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="tilefuse", options={"target": target})(ids)
        ref = model.double()(ids)
        eager = model.to(out.dtype)(ids)
    eager_err = (eager.double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * eager_err + 1e-5


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_norm_reads_the_residual_once_however_deep_the_model(target, dtype, monkeypatch):
    monkeypatch.setattr(inline, "MIN_CHAIN_LINK_NUMEL", 1)  # every link counts as large here
    torch.manual_seed(0)
    model = ResidualStream(32, layers=4).to(device=DEVICE, dtype=dtype)
    ids = torch.randint(0, 50, (2, 24), device=DEVICE)
    torch._dynamo.reset()
    with torch.no_grad():
        report = tilefuse.explain(model, ids, options={"target": target})
    reads = _norm_reads(report)
    assert len(reads) == 9 and max(reads) <= 4, (reads, str(report))  # not 2 more per layer
    decisions = "\n".join(report.reports[0].decisions)
    assert "a link of a chain of shared bodies" in decisions
    _check(model, ids, target)


@pytest.mark.parametrize("target", TARGETS)
def test_a_small_chain_stays_inlined_up_to_a_bound(target):
    """Below MIN_CHAIN_LINK_NUMEL elements a link is realised only once its body reads
    MAX_CHAIN_READS buffers: a two-layer model's norms read the sums, a deep one's stay
    bounded."""
    torch.manual_seed(0)
    model = ResidualStream(16, layers=6).to(DEVICE)
    ids = torch.randint(0, 50, (2, 8), device=DEVICE)
    torch._dynamo.reset()
    with torch.no_grad():
        report = tilefuse.explain(model, ids, options={"target": target})
    reads = _norm_reads(report)
    assert reads[2] > reads[1] > reads[0]  # short chains stay inlined: no extra kernels
    assert max(reads) <= inline.MAX_CHAIN_READS + 3, reads  # and long ones are cut
    _check(model, ids, target)


def shared_mask_layers(q, k, v, causal_buffer, documents):
    """Two attention layers over one mask bias built from data (a `tril` buffer and a
    per-sequence document mask), as Hugging Face shares one mask across its layers."""
    t = q.shape[-2]
    allowed = (causal_buffer[:t, :t] != 0)[None, None] & documents[:, None]
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, torch.finfo(q.dtype).min)
    h = q
    for _ in range(2):
        h = torch.softmax(h @ k.transpose(-1, -2) * 0.25 + bias, -1) @ v
    return h


@pytest.mark.parametrize("target", TARGETS)
def test_a_mask_shared_by_layers_is_no_chain(target, monkeypatch):
    """The bias every layer adds to its scores is read by several shared bodies, but it is no
    link of a chain (another shape, and it selects a mask's fill): it stays a formula, and each
    layer's attention keeps its block summary (review regression)."""
    monkeypatch.setattr(inline, "MIN_CHAIN_LINK_NUMEL", 1)
    b, h, t = 3, 2, 70
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, t, 16, device=DEVICE) for _ in range(3))
    causal = torch.tril(torch.ones(t, t, device=DEVICE))
    documents = torch.ones(b, t, t, dtype=torch.bool, device=DEVICE)
    documents[:, :, 50:] = False
    documents[:, :, 0] = True
    torch._dynamo.reset()
    report = tilefuse.explain(shared_mask_layers, q, k, v, causal, documents, options={"target": target})
    kinds = [str(k_.kind) for k_ in report.kernels]
    assert kinds.count("flash") == 2 and "pointwise" not in kinds, kinds
    assert kinds.count("block-summary") >= 2, kinds
    torch._dynamo.reset()
    out = torch.compile(shared_mask_layers, backend="tilefuse", options={"target": target})(q, k, v, causal, documents)
    ref = shared_mask_layers(q.double(), k.double(), v.double(), causal.double(), documents)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def alternating_norms(x, steps):
    """Steps that alternate a column sum and a row mean, each read back by the next step: every
    intermediate is read by a reduction and by the next step's body, a chain of shared bodies
    whose side reads are small (a row or a column)."""
    for i in range(steps):
        if i % 2 == 0:
            x = torch.relu(x - x.sum(0, keepdim=True) * 0.01)
        else:
            x = torch.tanh(x - x.mean(1, keepdim=True))
    return x


@pytest.mark.parametrize("target", TARGETS)
def test_a_chain_of_costly_shared_bodies_is_not_recomputed_by_every_later_kernel(target):
    """Inlined throughout, step k's kernel would recompute every earlier step's tanh (work
    quadratic in the chain's length: a 20-step chain of 64×64 took 3× Inductor's time on a
    CPU); a transcendental op weighs TRANSCENDENTAL_COST adds in the shared-body bound, so a
    link is realised every few tanh."""
    steps = 12
    torch.manual_seed(0)
    x = torch.randn(37, 45, device=DEVICE)
    torch._dynamo.reset()
    report = tilefuse.explain(alternating_norms, x, steps, options={"target": target})
    computed = sum(repr(statement).count("op='tanh'") for k in report.kernels for statement in k.tile.body)
    assert steps // 2 <= computed <= steps, (computed, [k.name for k in report.kernels])
    torch._dynamo.reset()
    out = torch.compile(alternating_norms, backend="tilefuse", options={"target": target})(x, steps)
    torch.testing.assert_close(out.double(), alternating_norms(x.double(), steps), atol=1e-5, rtol=1e-5)
