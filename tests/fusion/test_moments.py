"""Moment expansion: a reduction whose body is polynomial in earlier results over the same axis
(variance, skew, covariance ...) is carried as independent moments in its producers' pass,
expanded around a per-row shift so that a large mean does not cancel; other bodies are refused."""
import random
from unittest import mock

import pytest
import sympy
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.config import config
from tilefuse.fusion.moments import derive_moments
from tilefuse.fusion.planner import Planner
from tilefuse.fusion.repair import NoRepair
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import Index, Load, Var, binary, const, unary
from tilefuse.ir.interpret import Evaluator
from tilefuse.ir.monoid import MAX, SUM

I0, R0 = sympy.Symbol("i0", integer=True, nonnegative=True), sympy.Symbol("r0", integer=True, nonnegative=True)
F64 = dt.float64
X = Load("x", (Index(I0), Index(R0)), F64)
Y = Load("y", (Index(I0), Index(R0)), F64)
W = Load("w", (Index(R0),), F64)
M = Load("m", (Index(I0),), F64)
V = Load("v", (Index(I0),), F64)


# ---------------------------------------------------------------- the derivation itself
def _check_expansion(body, producers, rows=3, n=29, seed=0):
    """Σ_j body evaluated directly == the expansion combined from its moments, with shifts
    anywhere (the expansion is exact for every expansion point)."""
    rep = derive_moments(body, SUM, producers, "t")
    g = torch.Generator().manual_seed(seed)
    buffers = {"x": torch.randn(rows, n, generator=g, dtype=torch.float64) + 2,
               "y": torch.randn(rows, n, generator=g, dtype=torch.float64),
               "w": torch.rand(n, generator=g, dtype=torch.float64) + 0.5,
               "m": torch.randn(rows, generator=g, dtype=torch.float64) * 3,
               "v": torch.rand(rows, generator=g, dtype=torch.float64) + 0.5}
    env = {I0: torch.arange(rows).view(-1, 1), R0: torch.arange(n).view(1, -1)}
    shifts = {s.name: torch.randn(rows, 1, generator=g, dtype=torch.float64) for s in rep.shifts if s is not None}
    ev = Evaluator(buffers, env, shifts)
    direct = ev(body).expand(rows, n).sum(-1)
    moments = {f"M{k}": ev(q).expand(rows, n).sum(-1, keepdim=True) for k, (_, q) in enumerate(rep.terms)}
    combined = rep.combine(rep.pivots, [Var(name, F64) for name in moments])
    expanded = Evaluator(buffers, env, dict(shifts, **moments))(combined)
    torch.testing.assert_close(expanded.reshape(rows), direct, rtol=1e-9, atol=1e-9)
    return rep


def _random_body(rng: random.Random):
    """A random polynomial in the pivots m, v/2 (and m/7) with data x, y, w as coefficients."""
    data = [X, Y, W, X * W, unary("exp", Y), const(1.5, F64)]
    pivots = [M, V / 2.0, M / 7.0]
    degree_left = 4
    body = None
    for _ in range(rng.randint(1, 3)):
        term = rng.choice(data)
        for _ in range(rng.randint(1 if body is None else 0, 2)):
            if degree_left == 0:
                break
            factor = rng.choice([rng.choice(data) - rng.choice(pivots), rng.choice(pivots) * rng.choice(data),
                                 rng.choice(pivots) + rng.choice(data) * 0.5])
            if rng.random() < 0.3 and degree_left >= 2:
                factor, degree_left = binary("pow", factor, const(2.0, F64)), degree_left - 2
            else:
                degree_left -= 1
            term = term * factor
        body = term if body is None else (body + term if rng.random() < 0.7 else body - term)
    return body


@pytest.mark.parametrize("seed", range(16))
def test_random_polynomial_bodies_expand_exactly(seed):
    rng = random.Random(seed)
    rep = _check_expansion(_random_body(rng), ("m", "v"), seed=seed)
    assert rep.describe().startswith("moment expansion over")


@pytest.mark.parametrize("body,text", [
    ((X - M / 300.0) * (X - M / 300.0), "t = M0 + M1*d + d**2*n"),                 # variance
    (binary("pow", X - M, const(3.0, F64)), "t = M0 + M1*d + M2*d**2 - d**3*n"),    # skew
    ((X - M) * W, "t = M0 + M1*d"),                                              # (x − μ)·w
    ((X * 2.0 + M) * (X * 2.0 + M), "t = M0 + M1*d + d**2*n"),                     # (a·x + r)²
    ((X - M) * (Y - V), "t = M0 + M1*d_1 + M2*d_0 + d_0*d_1*n"),                  # two producers
    (binary("pow", (X - M) * unary("rsqrt", V), const(3.0, F64)), "r_1**3*("),    # a pure scale
])
def test_known_bodies_expand(body, text):
    rep = _check_expansion(body, ("m", "v"))
    assert text in rep.describe(), rep.describe()
    if "rsqrt" in str(body):
        assert rep.shifts[1] is None and len(rep.terms) == 4  # rstd³ scales, needs no moments


@pytest.mark.parametrize("body,why", [
    (unary("abs", X - M), "not polynomial"),
    (unary("exp", X - M) * (X - M), "not polynomial"),
    (X / M, "not polynomial"),
    (binary("pow", X - M, const(5.0, F64)), "degree 5"),
])
def test_non_polynomial_bodies_are_refused(body, why):
    with pytest.raises(NoRepair, match=why):
        derive_moments(body, SUM, "m")
    with pytest.raises(NoRepair, match="only sums"):
        derive_moments((X - M) * (X - M), MAX, "m")


# ---------------------------------------------------------------- compiled kernels
def _compile(fn, *args, limit=16):
    with config.patch(persistent_reduction_limit=limit):
        torch._dynamo.reset()
        report = tilefuse.explain(fn, *args)
        torch._dynamo.reset()
        out = torch.compile(fn, backend="tilefuse")(*args)
    return out, report


def _error(out, fn, args):
    """Max error of `out` and of eager fp32 against an fp64 reference."""
    ref = fn(*(a.double() for a in args))
    eager = fn(*args)
    if not isinstance(ref, tuple):
        out, ref, eager = (out,), (ref,), (eager,)
    err = max((o.double() - r).abs().max().item() for o, r in zip(out, ref))
    eager_err = max((e.double() - r).abs().max().item() for e, r in zip(eager, ref))
    scale = max(r.abs().max().item() for r in ref)
    return err, eager_err, scale


def _assert_accurate(out, fn, args, rel=1e-6):
    """Not much worse against fp64 than eager, or than the same kernel in two passes (eager may
    accumulate in higher precision; the looped mean both kernels share is not the expansion's)."""
    err, eager_err, scale = _error(out, fn, args)
    slack = rel * (1 + scale)
    if err > 2 * eager_err + slack:
        with mock.patch.object(Planner, "try_moments", return_value=None):
            two_pass, _ = _compile(fn, *args)
        two_pass_err = _error(two_pass, fn, args)[0]
        assert err <= 2 * max(eager_err, two_pass_err) + slack, (err, eager_err, two_pass_err)
    return err, eager_err


def _moment_var(x):
    m = x.mean(-1, keepdim=True)
    return ((x - m) ** 2).mean(-1)


def _skew(x):
    return ((x - x.mean(-1, keepdim=True)) ** 3).mean(-1)


def _affine_square(x):
    return ((0.5 * x - x.amax(-1, keepdim=True)) ** 2).sum(-1)


def _cov(x, y):
    return ((x - x.mean(-1, keepdim=True)) * (y - y.mean(-1, keepdim=True))).sum(-1)


def _normalised_skew(x):
    m = x.mean(-1, keepdim=True)
    rstd = torch.rsqrt(((x - m) ** 2).mean(-1, keepdim=True))
    return (((x - m) * rstd) ** 3).mean(-1)


@pytest.mark.parametrize("name,fn,n,loops,expansions", [
    # (var, var_mean and layer_norm carry the deviations' sum beside their squares: the
    # corrected two-pass variance, two expansions)
    ("var", lambda x: torch.var(x, -1), 37, 1, 2),
    ("var", lambda x: torch.var(x, -1), 1337, 1, 2),
    ("var_mean", lambda x: torch.var_mean(x, -1), 300, 1, 2),        # reads the mean as a row
    ("manual", _moment_var, 1024, 1, 1),                               # the axis fills whole tiles
    ("layer_norm", lambda x: F.layer_norm(x, (x.shape[-1],)), 300, 2, 2),  # stats, then the output
    ("skew", _skew, 1337, 1, 1),
    ("affine_square", _affine_square, 700, 1, 1),                      # over a max
    ("normalised_skew", _normalised_skew, 700, 1, 2),                  # chained: reads rsqrt(var)
    ("cov", _cov, 700, 1, 1),                                          # two producers
])
def test_polynomial_bodies_share_their_producers_pass(name, fn, n, loops, expansions):
    torch.manual_seed(0)
    args = (torch.randn(5, n) * 2 + 3,) if name != "cov" else (torch.randn(5, n) + 3, torch.randn(5, n) - 1)
    out, report = _compile(fn, *args)
    (kernel,) = report.kernels
    carried = [note for note in kernel.notes if "carried in pass 0 with moment expansion over" in note]
    assert len(carried) == expansions, kernel.notes
    assert kernel.tile_ir.count("for roffset") == loops, kernel.source
    _assert_accurate(out, fn, args)


@pytest.mark.parametrize("fn", [lambda x: torch.var(x, -1), lambda x: F.layer_norm(x, (x.shape[-1],)), _skew])
@pytest.mark.parametrize("trend", [0.0, 40.0])
def test_large_mean_does_not_cancel(fn, trend):
    """mean 1000, std 1 in fp32 (and a trend that makes the first tile a poor estimate): the
    error against fp64 stays at eager's level, where Σx² − n·μ² would lose everything."""
    torch.manual_seed(1)
    n = 1500
    x = torch.randn(8, n) + 1000 + torch.linspace(-trend, trend, n)
    out, report = _compile(fn, x)
    assert any("moment expansion" in note for note in report.kernels[0].notes)
    err, _ = _assert_accurate(out, fn, (x,), rel=2 * torch.finfo(torch.float32).eps)
    naive = ((x * x).mean(-1) - x.mean(-1) ** 2).double()
    if fn is not _skew and trend == 0:
        naive_err = (naive - torch.var(x.double(), -1, correction=0)).abs().max().item()
        assert err < 1e-3 * naive_err  # the shift is what makes the difference


@pytest.mark.parametrize("fn,refused", [
    (lambda x: (x - x.mean(-1, keepdim=True)).abs().sum(-1), "not polynomial"),
    (lambda x: (torch.exp(x - x.mean(-1, keepdim=True)) * (x - x.mean(-1, keepdim=True))).sum(-1), "not polynomial"),
])
def test_non_polynomial_bodies_take_a_second_pass(fn, refused):
    x = torch.randn(4, 900)
    out, report = _compile(fn, x)
    (kernel,) = report.kernels
    assert any("no moment expansion" in n and refused in n for n in kernel.notes), kernel.notes
    assert kernel.tile_ir.count("for roffset") == 2
    _assert_accurate(out, fn, (x,))


def test_rolling_update_comes_first_and_persistent_rows_need_no_repair():
    x = torch.randn(4, 900)
    lse = lambda x: torch.exp(x - x.mean(-1, keepdim=True)).sum(-1)  # noqa: E731
    _, report = _compile(lse, x)
    notes = report.kernels[0].notes
    assert any("rolling update" in n for n in notes) and not any("moment" in n for n in notes)
    out, report = _compile(lambda x: torch.var(x, -1), x, limit=4096)  # the row fits one tile
    (kernel,) = report.kernels
    assert "for roffset" not in kernel.tile_ir and not any("moment" in n for n in kernel.notes)
    torch.testing.assert_close(out, torch.var(x, -1))


def test_non_finite_rows_follow_eager():
    x = torch.randn(4, 700)
    x[0] = float("-inf")          # the max, and so the first-tile shift, is -inf
    x[1, :600] = float("-inf")
    x[2, 5] = float("nan")
    for fn in (_affine_square, lambda x: torch.var(x, -1)):
        out, _ = _compile(fn, x)
        torch.testing.assert_close(out, fn(x), equal_nan=True, rtol=1e-4, atol=1e-4)


def test_dynamic_row_length():
    fn = lambda x: torch.var(x, -1)  # noqa: E731
    with config.patch(persistent_reduction_limit=16):
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="tilefuse", dynamic=True)
        for n in (300, 777):
            x = torch.randn(3, n) + 50
            torch.testing.assert_close(compiled(x), fn(x), rtol=1e-5, atol=1e-5)
