"""Semantic repair: the rolling update is derived (not looked up), checked, refused when it
does not exist, and fuses dependent reductions into one pass over the axis."""
import pytest
import sympy
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import tilefuse
from tilefuse.config import config
from tilefuse.fusion.repair import NoRepair, derive_rolling_update
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import Index, Load, binary, const, unary, where
from tilefuse.ir.monoid import MAX, SUM

I0, R0 = sympy.Symbol("i0", integer=True, nonnegative=True), sympy.Symbol("r0", integer=True, nonnegative=True)
X = Load("x", (Index(I0), Index(R0)), dt.float32)
M = Load("m", (Index(I0),), dt.float32)


@pytest.mark.parametrize("body,factor", [
    (unary("exp", X - M), "exp(r_old - r_new)"),
    (unary("exp", unary("tanh", X / 30.0) * 30.0 - M), "exp(r_old - r_new)"),          # soft-capping
    (unary("exp", X + Index(R0) * 0.25 - M), "exp(r_old - r_new)"),                   # ALiBi-style bias
    (unary("exp", (X - M) / 0.5), "exp(2*r_old - 2*r_new)"),                          # temperature
    (unary("exp", X - M) * Load("v", (Index(R0),), dt.float32), "exp(r_old - r_new)"),  # P·V
    (unary("exp", X - where(unary("isinf", M), const(0.0), M)), "exp(r_old - r_new)"),  # guarded max
])
def test_rolling_update_is_derived_for_variants(body, factor):
    repair = derive_rolling_update(body, SUM, "m")
    assert sympy.simplify(repair.factor - sympy.sympify(factor, locals={
        "r_old": sympy.Symbol("r_old", real=True), "r_new": sympy.Symbol("r_new", real=True)})) == 0
    assert "h(t, r, r')" in repair.describe()


def test_a_layer_like_another_reuses_its_derivation():
    """Every layer of a model asks for the same derivation under other buffer names: the sympy
    work runs once, and each layer gets a repair over its own buffers; a refusal is remembered
    too."""
    from tilefuse.fusion import repair as repair_mod

    def layer(n):
        x = Load(f"x{n}", (Index(I0), Index(R0)), dt.float32)
        m = Load(f"m{n}", (Index(I0),), dt.float32)
        return unary("exp", unary("tanh", x / 17.0) * 17.0 - m) * Load(f"v{n}", (Index(R0),), dt.float32), f"m{n}"

    repair_mod._rebasing.cache_clear()
    repairs = [derive_rolling_update(layer(n)[0], SUM, layer(n)[1]) for n in range(4)]
    info = repair_mod._rebasing.cache_info()
    assert info.misses == 1 and info.hits == 3
    assert all(sympy.simplify(r.factor - repairs[0].factor) == 0 for r in repairs)
    assert [r.producers for r in repairs] == [(f"m{n}",) for n in range(4)]
    assert {e.buffer for e in repairs[3].pivots} == {"m3"}
    for n in range(2):
        x = Load(f"x{n}", (Index(I0), Index(R0)), dt.float32)
        with pytest.raises(NoRepair, match="depends on the data"):
            derive_rolling_update(unary("exp", x * Load(f"m{n}", (Index(I0),), dt.float32)), SUM, f"m{n}")
    assert repair_mod._rebasing.cache_info().hits == 4


@pytest.mark.parametrize("body,why", [
    (binary("mul", X - M, X - M), "depends on the data"),      # variance: moment expansion, not h
    (unary("exp", X * M), "depends on the data"),
])
def test_bodies_without_rolling_update_are_refused(body, why):
    with pytest.raises(NoRepair, match=why):
        derive_rolling_update(body, SUM, "m")
    with pytest.raises(NoRepair, match="only sums"):
        derive_rolling_update(unary("exp", X - M), MAX, "m")


def _loops(fn, x):
    with config.patch(persistent_reduction_limit=16):
        report = tilefuse.explain(fn, x)
    (kernel,) = report.kernels
    return kernel.tile_ir.count("for roffset"), kernel.notes


@pytest.mark.parametrize("fn,loops", [
    (lambda x: torch.logsumexp(x, -1), 1),
    (lambda x: torch.logsumexp(torch.tanh(x / 4) * 4, -1), 1),
    (lambda x: torch.softmax(x, -1), 2),      # max and normaliser in one pass, then the output
    (lambda x: F.log_softmax(x * 0.7, -1), 2),
])
def test_dependent_reductions_share_a_pass(fn, loops):
    x = torch.randn(6, 77) * 3
    n, notes = _loops(fn, x)
    assert n == loops, notes
    assert any("rolling update" in note and "exp(r - r')" in note for note in notes)
    with config.patch(persistent_reduction_limit=16):
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(fn, backend="tilefuse")(x), fn(x), atol=1e-5, rtol=1e-5)


def test_masked_rows_follow_eager():
    x = torch.randn(5, 77) * 3
    x[0, :40] = float("-inf")
    x[1] = float("-inf")
    x[2, ::3] = float("-inf")
    for fn in (lambda x: torch.softmax(x, -1), lambda x: torch.logsumexp(x, -1), lambda x: F.log_softmax(x, -1)):
        with config.patch(persistent_reduction_limit=16):
            torch._dynamo.reset()
            out = torch.compile(fn, backend="tilefuse")(x)
        torch.testing.assert_close(out, fn(x), equal_nan=True, atol=1e-5, rtol=1e-5)


_TERMS = {
    "exp": lambda c, m, k: torch.exp((c - m) * k),
    "exp_bias": lambda c, m, k: torch.exp(c + k - m),
    "softcap": lambda c, m, k: torch.exp(torch.tanh(c / 3) * 3 * k - m * k),
    "square": lambda c, m, k: (c - m) ** 2 * k,          # no rolling update: two passes
    "exp2": lambda c, m, k: torch.exp2((c - m) * k),
}


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(sorted(_TERMS)), st.sampled_from(["amax", "amin", "sum"]),
       st.floats(0.25, 2.0), st.integers(20, 70), st.booleans())
def test_random_reduction_chains_fused_match_unfused(term, first, k, n, then_output):
    """r = first(x); t = Σ g(r, x): the fused (one-pass where derivable) kernel matches eager."""

    def fn(x):
        r = getattr(torch, first)(x, -1, keepdim=True) if first != "sum" else x.sum(-1, keepdim=True) / x.shape[-1]
        t = _TERMS[term](x, r, k).sum(-1, keepdim=True)
        return _TERMS[term](x, r, k) / t if then_output else t

    x = torch.randn(3, n)
    with config.patch(persistent_reduction_limit=16):
        torch._dynamo.reset()
        out = torch.compile(fn, backend="tilefuse")(x)
    ref = fn(x.double())
    assert (out.double() - ref).abs().max() <= 2 * (fn(x).double() - ref).abs().max() + 1e-4 * (1 + ref.abs().max())


def test_review_regressions_chained_row_indexed_and_sign_changing_repairs():
    chained = lambda x: (x / torch.exp(x - x.amax(-1, keepdim=True)).sum(-1, keepdim=True)).sum(-1)
    row_term = lambda x: torch.exp(x - (x.amax(-1, keepdim=True) + torch.arange(x.shape[0])[:, None] * 0.1)).sum(-1)
    crosses_zero = lambda x: (x * x.amax(-1, keepdim=True)).sum(-1)   # h = t·r'/r: refused
    x = torch.randn(3, 1000)
    z = torch.cat([-torch.rand(3, 512), torch.rand(3, 512) + 0.5], 1)
    z[:, 0] = 0
    for fn, arg in ((chained, x), (row_term, x), (crosses_zero, z)):
        with config.patch(persistent_reduction_limit=16):
            torch._dynamo.reset()
            out = torch.compile(fn, backend="tilefuse")(arg)
        ref = fn(arg.double())
        assert (out.double() - ref).abs().max() <= 2 * (fn(arg).double() - ref).abs().max() + 1e-4 * (1 + ref.abs().max())
    with pytest.raises(NoRepair, match="positive and finite"):
        derive_rolling_update(X * M, SUM, "m")


def test_cross_entropy_with_integer_targets_is_one_pass():
    """Per-row loss: max, normaliser (rolling update) and the target's logit in one kernel and,
    when the row loops over tiles, one pass; the batch mean is a separate small reduction."""
    x, t = torch.randn(37, 300) * 2, torch.randint(0, 300, (37,))
    fn = lambda x, t: F.cross_entropy(x, t, reduction="none")  # noqa: E731
    with config.patch(persistent_reduction_limit=64):
        report = tilefuse.explain(fn, x, t)
        assert [k.kind for k in report.kernels] == ["reduction"] and not report.externs
        assert report.kernels[0].tile_ir.count("for roffset") == 1
        torch._dynamo.reset()
        out = torch.compile(fn, backend="tilefuse")(x, t)
    ref = fn(x.double(), t)
    assert (out.double() - ref).abs().max() <= 2 * (fn(x, t).double() - ref).abs().max() + 1e-5


def _rebasing_by_simplify(g, r, old, new, cs):
    """The derivation's verdict by `simplify` alone (what `_rebasing` did before its cheaper
    first steps): the oracle for them."""
    T = sympy.Symbol("T")
    g_new, g_old = g.subs(r, new), g.subs(r, old)
    factor = sympy.simplify(sympy.powsimp(g_new / g_old, force=True))
    if factor.free_symbols & cs or not (factor.is_positive and factor.is_finite):
        return False, None
    h = T * factor
    a, b = sympy.symbols("a b", real=True)
    ok = sympy.simplify(sympy.powsimp(sympy.expand(h.subs(T, g_old) - g_new), force=True)) == 0 and \
        sympy.simplify(h.subs(T, a + b) - h.subs(T, a) - h.subs(T, b)) == 0
    return ok, factor if ok else None


_R, _OLD, _NEW = (sympy.Symbol(n, real=True) for n in ("r", "r_old", "r_new"))
_C0, _C1 = (sympy.Symbol(n, real=True) for n in ("c0", "c1"))


@pytest.mark.parametrize("g", [
    sympy.exp(_C0 - _R), sympy.exp(2 * _C0 - 2 * _R), _C1 * sympy.exp(_C0 - _R), (_C0 - _R) ** 2,
    sympy.exp(_C0 * _R), _C0 / sympy.exp(_R), sympy.exp(_C0) * sympy.exp(-_R) * _C1 ** 2,
    sympy.exp(sympy.tanh(_C0) - _R / 3), _C0 - _R, sympy.exp(_C0 - _R) + _C1, (_C0 - _R) * sympy.exp(-_R),
    sympy.exp(-(_C0 - _R) ** 2), sympy.exp(_C0 - _R) / (1 + sympy.exp(-_R)), _R * sympy.exp(_C0),
])
def test_the_cheap_proofs_agree_with_simplify(g):
    """`_rebasing` proves a data-dependent factor by evaluating it and an identity by expanding
    before it calls `simplify`: each verdict and factor is the one `simplify` alone gives."""
    from tilefuse.fusion import repair as repair_mod

    cs = frozenset({_C0, _C1})
    why, factor = repair_mod._rebasing.__wrapped__(g, (_R,), (_OLD,), (_NEW,), cs)
    ok, expected = _rebasing_by_simplify(g, _R, _OLD, _NEW, cs)
    assert (why == "") == ok, (why, g)
    if ok:
        assert sympy.simplify(factor - expected) == 0


def test_a_factor_that_varies_with_the_data_is_shown_by_evaluation():
    from tilefuse.fusion.repair import _varies_with_data

    cs = frozenset({_C0})
    assert _varies_with_data(((_C0 - _NEW) / (_C0 - _OLD)) ** 2, cs)
    assert not _varies_with_data(sympy.exp(_C0 - _NEW) / sympy.exp(_C0 - _OLD), cs)  # exp(r_old - r_new)
    assert not _varies_with_data(sympy.exp(_NEW - _OLD), cs)  # no data at all
    assert not _varies_with_data(_C0 / (_C0 - _C0), cs)  # not a finite number: no proof
