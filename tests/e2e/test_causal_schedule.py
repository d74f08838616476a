"""The causal flash kernels' schedule, forward and backward: interior key tiles evaluate no
condition at all (the backward's `where(mask, 0, dS)` included, not only the masked scores),
and kernels whose later row blocks visit more keys launch those first. Gradients are checked
against an fp64 reference with blocks small enough that every loop runs."""
import math

import pytest
import torch

import tilefuse
from lowered_plans import recorded_lowerings
from tilefuse.ir.expr import Binary, Const, Index, walk
from tilefuse.tile.ir import For, ProgramId, TileKernel, statements, stmt_exprs

MASKS = {
    "causal": lambda i, j: j > i,
    "causal_offset": lambda i, j: j > i + 5,
    "window": lambda i, j: (j > i) | (i - j > 24),
}


def _attention(mask):
    def fn(q, k, v):
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        i = torch.arange(s.shape[-2])[:, None]
        j = torch.arange(s.shape[-1])[None, :]
        return torch.softmax(torch.where(mask(i, j), float("-inf"), s), dim=-1) @ v
    return fn


def _compares_positions(loop: For) -> bool:
    """Whether a loop's body evaluates a comparison between positions (a mask)."""
    for s in statements(loop.body):
        for e in stmt_exprs(s):
            for n in walk(e):
                if isinstance(n, Binary) and n.op in ("gt", "ge", "lt", "le") and not any(
                        isinstance(x, Const) or isinstance(x, Index) and not x.expr.free_symbols for x in (n.a, n.b)):
                    return True  # (a bound check compares a position with a size: not a mask)
    return False


def _train(fn, args, d_out, **cfg):
    """The compiled output and gradients, and the flash kernels the compile lowered."""
    torch._dynamo.reset()
    lowered: list = []
    with recorded_lowerings(lowered), tilefuse.config.patch(flash_config="16,16,4,1", graph_cache=False, **cfg):
        out = torch.compile(fn, backend="tilefuse")(*args)
        grads = torch.autograd.grad(out, args, d_out)
    return out, grads, [k for k in lowered if isinstance(k, TileKernel) and "flash" in k.name
                        and "summary" not in k.name]


def _assert_matches_fp64(fn, args, d_out, out, grads):
    ref_args = [t.detach().double().requires_grad_() for t in args]
    ref_out = fn(*ref_args)
    refs = torch.autograd.grad(ref_out, ref_args, d_out.double())
    torch.testing.assert_close(out.double(), ref_out, atol=1e-4, rtol=1e-4)
    for g, r in zip(grads, refs):
        torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mask,groups,l2_share", [(m, False, None) for m in MASKS] + [
    ("causal", True, None), ("causal", True, 4 * 77 * 32 * 2)], ids=lambda x: str(x))
def test_causal_training_gradients_and_interior_loops(mask, groups, l2_share, monkeypatch):
    """(With `groups` the batch elements launch in groups, with `l2_share` the six batch
    elements of the forward and dQ kernels in groups of 4 and 2.)"""
    if l2_share is not None:
        monkeypatch.setattr("tilefuse.tile.flash.L2_SHARE", l2_share)
    torch.manual_seed(0)
    fn = _attention(MASKS[mask])
    q, k, v = (torch.randn(2, 3, 77, 16, requires_grad=True) for _ in range(3))
    d_out = torch.randn(2, 3, 77, 16)
    out, grads, kernels = _train(fn, (q, k, v), d_out, flash_launch_groups=groups)
    _assert_matches_fp64(fn, (q, k, v), d_out, out, grads)
    assert len(kernels) >= 3  # the forward, dK/dV and dQ
    for kern in kernels:
        loops = [s for s in statements(kern.body) if isinstance(s, For)]
        if mask != "window":  # (a window's rows have a masked prologue and epilogue around the interior)
            assert len(loops) == 2, kern.name
        assert any(not _compares_positions(lp) for lp in loops), f"{kern.name}: every loop evaluates the mask"
        assert any(_compares_positions(lp) for lp in loops), kern.name
    if mask == "causal":
        reversed_ = {k.name: next(s for s in k.body if isinstance(s, ProgramId) and s.name == "pid").reverse
                     for k in kernels}
        # the forward and dQ (rows visit keys up to their own position: later blocks do more)
        # run last block first; dK/dV (keys visited by later rows) keeps the natural order
        assert sorted(reversed_.values()) == [False, True, True], reversed_
        sizes = {s.group for k in kernels for s in k.body if isinstance(s, ProgramId)}
        # (the dK/dV kernel streams three operands, the others two: their groups differ)
        if not groups:
            assert sizes == {0}, sizes
        else:
            assert sizes == {6} if l2_share is None else 4 in sizes and max(sizes) < 6, sizes


def _spelled(kind):
    """Masks spelt as models spell them, each with interior tiles once its blocks are small."""
    def fn(q, k, v):
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        i = torch.arange(s.shape[-2])[:, None]
        j = torch.arange(s.shape[-1])[None, :]
        if kind == "keep_mask":  # SDPA's boolean keep-mask as a selection
            s = torch.where(j <= i, s, float("-inf"))
        elif kind == "additive_finfo_min":  # Hugging Face's additive causal mask
            s = s + torch.where(j > i, torch.finfo(torch.float32).min, 0.0)
        elif kind == "masked_fill_window":
            s = s.masked_fill((j > i) | (j < i - 30), float("-inf"))
        elif kind == "prefix_lm":  # a prefix every row sees: a disjunct with no unit bound
            s = s.masked_fill((j > i) & (j >= 9), float("-inf"))
        elif kind == "bottom_right":  # more keys than rows: causal aligned to the last key
            s = s.masked_fill(j > i + (s.shape[-1] - s.shape[-2]), float("-inf"))
        elif kind == "finite_fill_more_rows":  # rows past the keys see none: eager weighs them uniformly
            s = s.masked_fill(j < i - 4, torch.finfo(torch.float32).min)
        return torch.softmax(s, dim=-1) @ v
    return fn


@pytest.mark.parametrize("kind", ["keep_mask", "additive_finfo_min", "masked_fill_window", "prefix_lm",
                                  "bottom_right", "finite_fill_more_rows"])
def test_mask_spellings_train_like_eager(kind):
    """Gradients of the spellings against fp64, with 16×16 tiles: every interior, diagonal
    and skipped range of each kernel is exercised."""
    torch.manual_seed(1)
    fn = _spelled(kind)
    keys = {"bottom_right": 93, "finite_fill_more_rows": 29}.get(kind, 77)
    q = torch.randn(1, 2, 77, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, keys, 16, requires_grad=True) for _ in range(2))
    d_out = torch.randn(1, 2, 77, 16)
    out, grads, kernels = _train(fn, (q, k, v), d_out, fallback="error")
    _assert_matches_fp64(fn, (q, k, v), d_out, out, grads)
    assert len(kernels) >= 3
    if kind == "finite_fill_more_rows":
        return  # (the dK/dV kernel walks the query rows: with a finite fill it may skip none of them)
    for kern in kernels:
        loops = [s for s in statements(kern.body) if isinstance(s, For)]
        unmasked = [lp for lp in loops if not _compares_positions(lp)]
        # a prefix-LM mask (a conjunction) has no interior range: every tile evaluates it
        assert (not unmasked) if kind == "prefix_lm" else unmasked, kern.name
