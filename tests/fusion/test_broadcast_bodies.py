"""A costly body (a transcendental, a gather) that its consumers broadcast — T5's relative-position
bias, `table[bucket(log |i - j|)]`, added to every layer's scores of every batch element — is
realised once instead of being recomputed per batch element and layer inside each attention
kernel (`fusion.inline`, `_realise_broadcast_costly_bodies`). Checked against an fp64 reference
on both CPU backends, and for what must stay inlined: cheap bodies, the selection of a mask's
fill (the attention kernel skips what it masks), costly bodies read without broadcast."""
import math
import os

import pytest
import torch

import tilefuse
from backends_on_cpu import CPU_BACKENDS
from tilefuse.fusion import inline

DEVICE = os.environ.get("TILEFUSE_TEST_DEVICE", "cpu")
TARGETS = CPU_BACKENDS if DEVICE == "cpu" else ["auto"]
REASON = "a costly body its consumers broadcast"


def _buckets(t: int, buckets: int, device) -> torch.Tensor:
    """T5's bucketing of relative positions: exact below 4, logarithmic above (int64)."""
    pos = torch.arange(t, device=device)
    rel = (pos[None, :] - pos[:, None]).abs()
    far = 4 + (torch.log(rel.float().clamp(min=1) / 4) / math.log(t / 4) * (buckets - 4)).long()
    return torch.where(rel < 4, rel, far.clamp(max=buckets - 1))


def _layers(bias_fn, layers=3):
    def fn(q, k, v, table):
        bias = bias_fn(q.shape[-2], table)
        h = q
        for _ in range(layers):
            h = torch.softmax(h @ k.transpose(-1, -2) * 0.25 + bias, -1) @ v
        return h
    return fn


def _gathered(t, table):
    return table[_buckets(t, table.shape[0], table.device)].permute(2, 0, 1)  # (heads, query, key)


def _cheap(t, table):
    pos = torch.arange(t, device=table.device)
    return ((pos[None, :] - pos[:, None]) * 0.01)[None] * table[0][:, None, None]


def _masked_fill(t, table):
    pos = torch.arange(t, device=table.device)
    rel = (pos[None, :] - pos[:, None]).float()
    return torch.where(rel > 0, float("-inf"), torch.log1p(rel.abs()) * table[0][:, None, None])


def _inputs(b=2, h=3, t=37, d=16, buckets=12):
    q, k, v = (torch.randn(b, h, t, d, device=DEVICE) for _ in range(3))
    return q, k, v, torch.randn(buckets, h, device=DEVICE)


def _compile(fn, args, target):
    torch._dynamo.reset()
    with tilefuse.config.patch(target=target, fallback="error"):
        ex = tilefuse.explain(fn, *args)
        out = torch.compile(fn, backend="tilefuse", options={"target": target})(*args)
    decisions = [d for r in ex.reports for d in r.decisions]
    return out, decisions


def _assert_close(out, fn, args):
    ref = fn(*(a.double() if a.is_floating_point() else a for a in args))
    eager_err = (fn(*args).double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * eager_err + 1e-5


@pytest.mark.parametrize("target", TARGETS)
def test_a_gathered_bias_broadcast_over_batch_and_layers_is_realised_once(target, monkeypatch):
    monkeypatch.setattr(inline, "MIN_RECOMPUTED_EVALUATIONS", 1 << 12)  # CI-sized tensors
    fn, args = _layers(_gathered), _inputs()
    out, decisions = _compile(fn, args, target)
    assert any(REASON in d for d in decisions), decisions
    _assert_close(out, fn, args)


def test_a_cheap_body_stays_inlined(monkeypatch):
    monkeypatch.setattr(inline, "MIN_RECOMPUTED_EVALUATIONS", 1 << 12)
    fn, args = _layers(_cheap), _inputs()
    out, decisions = _compile(fn, args, TARGETS[0])
    assert not any(REASON in d for d in decisions), decisions
    _assert_close(out, fn, args)


@pytest.mark.parametrize("target", TARGETS)
def test_the_costly_part_of_a_masked_bias_is_realised_and_the_mask_still_skips(target, monkeypatch):
    """`where(j > i, -inf, log1p|i - j| · w)`: the logarithm is realised, the selection of the
    fill stays in the attention kernel, which still skips the tiles the causal mask kills."""
    monkeypatch.setattr(inline, "MIN_RECOMPUTED_EVALUATIONS", 1 << 12)
    fn, args = _layers(_masked_fill), _inputs()
    torch._dynamo.reset()
    with tilefuse.config.patch(target=target, fallback="error"):
        ex = tilefuse.explain(fn, *args)
    realised = [d for r in ex.reports for d in r.decisions if REASON in d]
    assert len(realised) == 1, realised
    notes = [n for r in ex.reports for k in r.kernels if "flash" in k.name for n in k.notes]
    assert any("fully masked for the row block and skipped" in n for n in notes), notes
    out, _ = _compile(fn, args, target)
    _assert_close(out, fn, args)


def test_small_recomputations_stay_inlined():
    """Under the default threshold a CI-sized model recomputes its bias: a launch and a buffer
    would cost more."""
    fn, args = _layers(_gathered), _inputs()
    _, decisions = _compile(fn, args, TARGETS[0])
    assert not any(REASON in d for d in decisions), decisions


def test_a_costly_body_read_without_broadcast_is_left_to_the_sharing_rule(monkeypatch):
    """Read element for element by several consumers, a costly body is recomputed by each
    (several consumers add evaluations, not broadcast): only the shared-body size rule
    realises such a node."""
    monkeypatch.setattr(inline, "MIN_RECOMPUTED_EVALUATIONS", 1 << 8)

    def fn(x):
        y = torch.log1p(x.abs())
        return y.sum(-1), (y * 2).amax(-1), torch.softmax(y, -1)

    x = torch.randn(16, 33, 65, device=DEVICE)
    out, decisions = _compile(fn, (x,), TARGETS[0])
    assert not any(REASON in d for d in decisions), decisions
    for o, r in zip(out, fn(x)):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
