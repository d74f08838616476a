"""Reductions over an axis flattened across several dims, walked run by run on the CPU
(`tile.reduction_runs`): the offset rewrite is exact, the run found is the layout's, and every
kernel that walks so matches an fp64 reference at odd sizes, strided inputs and symbolic
shapes."""
import random

import pytest
import sympy
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.ir.symbolic import evaluate
from tilefuse.tile.reduction import run_tile
from tilefuse.tile.reduction_runs import run_offset

R, X, RBASE = (sympy.Symbol(n, integer=True, nonnegative=True) for n in ("r", "x", "rbase"))


def _nchw_channel_offset(h: int, w: int, c: int):
    """The offset a per-channel reduction over NCHW reads at flat position r of (N, H, W)."""
    from tilefuse.ir.symbolic import floordiv, mod

    n_, hw = floordiv(R, h * w), mod(R, h * w)
    return (c * h * w) * floordiv(floordiv(R, w), h) + h * w * X + w * mod(floordiv(R, w), h) + mod(R, w), n_, hw


@pytest.mark.parametrize("h,w", [(28, 28), (7, 7), (5, 3), (8, 8)])
def test_the_rewritten_offset_is_the_same_address_and_contiguous_in_the_run(h, w):
    offset, *_ = _nchw_channel_offset(h, w, c=6)
    run = h * w
    rewritten = run_offset(offset, R, RBASE, run, 4 * run)
    assert rewritten != offset
    assert sympy.expand(rewritten).coeff(R) == 1, rewritten  # (the lane's address: contiguous)
    rng = random.Random(0)
    for _ in range(200):
        base, t, x = rng.randrange(4) * run, rng.randrange(run), rng.randrange(6)
        env = {R: base + t, RBASE: base, X: x}
        assert evaluate(rewritten, env) == evaluate(offset, env)


def test_an_offset_with_no_run_form_is_left_as_it_was():
    offset, *_ = _nchw_channel_offset(28, 28, c=3)
    assert run_offset(offset, R, RBASE, 100, 3136) == offset  # (100 is no run of 28×28 planes)
    assert run_offset(R + 5 * X, R, RBASE, 16, 64) == R + 5 * X  # (already contiguous)


@pytest.mark.parametrize("run,tile", [(3136, 256), (784, 64), (49, 64), (512, 512), (196, 16), (16, 16)])
def test_a_run_is_walked_in_tiles_that_mask_little(run, tile):
    assert run_tile(run) == tile


def _bn_train(x, w, b):
    return F.relu(F.batch_norm(x, None, None, w, b, training=True))


def _var_mean_channels(x):
    return torch.var_mean(x, dim=(0, 2, 3), correction=1)


def _kl(a, b):
    return F.kl_div(F.log_softmax(a, -1), F.log_softmax(b, -1), log_target=True, reduction="batchmean")


def _amax_argmax_channels(x):
    flat = x.transpose(0, 1).reshape(x.shape[1], -1)
    return flat.amax(-1), flat.argmax(-1)


def _tiles(report) -> list:
    return [str(k.tile) for k in report.kernels if k.kind == "reduction"]


CASES = [
    ("bn-28x28", _bn_train, lambda: (torch.randn(6, 5, 28, 28) * 3 + 40, torch.randn(5), torch.randn(5)), 784),
    ("bn-7x7", _bn_train, lambda: (torch.randn(3, 11, 7, 7) + 2, torch.randn(11), torch.randn(11)), 49),
    ("var-mean-13x9", _var_mean_channels, lambda: (torch.randn(5, 4, 13, 9),), 117),
    ("var-mean-strided", _var_mean_channels, lambda: (torch.randn(4, 17, 12, 6).transpose(2, 3),), None),
    ("kl-split", _kl, lambda: (torch.randn(256, 512), torch.randn(256, 512)), 512),
    ("argmax-channels", _amax_argmax_channels, lambda: (torch.randn(7, 3, 10, 10),), 100),
]


@pytest.mark.parametrize("name,fn,make,run", CASES, ids=[c[0] for c in CASES])
def test_cpu_reductions_over_flattened_dims_walk_runs_and_match(name, fn, make, run):
    torch.manual_seed(0)
    args = make()
    torch._dynamo.reset()
    report = tilefuse.explain(fn, *args, options={"target": "cpu"})
    tiles = _tiles(report)
    if run is not None:
        assert any(f"RUN={run}" in t for t in tiles), tiles
    torch._dynamo.reset()
    got = tilefuse.compile(fn, target="cpu")(*args)
    ref = fn(*(a.double() for a in args))
    eager = fn(*args)
    got, ref, eager = (v if isinstance(v, tuple) else (v,) for v in (got, ref, eager))
    for g, r, e in zip(got, ref, eager):
        if not g.is_floating_point():
            torch.testing.assert_close(g, r)  # (argmax: the first of equal values, as eager)
            continue
        eager_err = (e.double() - r).abs().max().item()
        scale = max(1.0, r.abs().max().item())
        assert (g.double() - r).abs().max().item() <= 4 * eager_err + 1e-5 * scale


def test_symbolic_sizes_keep_the_flat_walk_and_match():
    """No run is chosen for a symbolic axis (its length is not known to divide): the flat walk
    still matches at two sizes."""
    torch._dynamo.reset()
    report = tilefuse.explain(_var_mean_channels, torch.randn(3, 4, 9, 9), dynamic=True, options={"target": "cpu"})
    assert _tiles(report) and not any("RUN=" in t for t in _tiles(report)), _tiles(report)
    torch._dynamo.reset()
    compiled = tilefuse.compile(_var_mean_channels, target="cpu", dynamic=True)
    for shape in ((3, 4, 9, 9), (5, 4, 6, 11)):
        x = torch.randn(shape)
        for g, r in zip(compiled(x), _var_mean_channels(x.double())):
            torch.testing.assert_close(g.double(), r, atol=1e-5, rtol=1e-5)


def test_a_short_run_divided_once_keeps_the_flat_walk():
    """A value per row of 17 summed over the whole tensor is read at `floor(r / 17)`, one
    division the flat walk does in 32 bits: no run (walked run by run, 1.8× slower); rows of
    7×7 planes, divided twice, are walked run by run."""
    torch._dynamo.reset()
    short = tilefuse.explain(lambda x: (x - x.amax(-1, keepdim=True)).exp().sum(), torch.randn(3000, 17),
                             options={"target": "cpu"})
    assert not any("RUN=" in t for t in _tiles(short)), _tiles(short)
    torch._dynamo.reset()
    plane = tilefuse.explain(_var_mean_channels, torch.randn(4, 6, 7, 7), options={"target": "cpu"})
    assert any("RUN=49" in t for t in _tiles(plane)), _tiles(plane)
