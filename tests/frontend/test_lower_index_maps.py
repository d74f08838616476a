"""Index maps of views checked element by element against torch.reshape (numeric and
symbolic shapes), including the pairing of dims with floor-divided symbolic sizes."""
import itertools

import pytest
import sympy
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tilefuse.frontend.lowerings.views import reshape_groups, reshape_map
from tilefuse.ir.expr import Index
from tilefuse.ir.symbolic import evaluate, floordiv, mod


def _check_map(old, new, env=None):
    """Evaluate the map on every index of `new` and compare with torch.reshape."""
    env = dict(env or {})
    o = [int(evaluate(sympy.sympify(d), env)) for d in old]
    n = [int(evaluate(sympy.sympify(d), env)) for d in new]
    x = torch.arange(max(1, int(torch.tensor(o).prod()))).reshape(o)
    expected = x.reshape(n)
    syms = [sympy.Symbol(f"i{k}", integer=True, nonnegative=True) for k in range(len(n))]
    index = reshape_map(old, new)(tuple(Index(s) for s in syms))
    grids = torch.meshgrid(*[torch.arange(k) for k in n], indexing="ij") if n else ()
    local = dict(env)
    local.update(dict(zip(syms, grids)))
    comps = [torch.as_tensor(evaluate(c.expr, local)).expand(tuple(n)) for c in index]
    got = x[tuple(comps)] if comps else x
    assert torch.equal(got, expected), (old, new, index)
    return index


def _factorizations(n, parts):
    if parts == 1:
        return [(n,)]
    out = []
    for d in range(1, n + 1):
        if n % d == 0:
            out += [(d,) + rest for rest in _factorizations(n // d, parts - 1)]
    return out


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([12, 30, 36, 7, 1]), st.integers(1, 4), st.integers(1, 4), st.data())
def test_reshape_matches_torch(numel, r_old, r_new, data):
    old = data.draw(st.sampled_from(_factorizations(numel, r_old)))
    new = data.draw(st.sampled_from(_factorizations(numel, r_new)))
    _check_map(old, new)


def test_split_and_merge_forms():
    i0, i1, i2 = (sympy.Symbol(f"i{k}", integer=True, nonnegative=True) for k in range(3))
    split = _check_map((35, 13), (5, 7, 13))
    assert [c.expr for c in split] == [7 * i0 + i1, i2]
    merge = _check_map((5, 7, 13), (35, 13))
    assert [c.expr for c in merge] == [floordiv(i0, 7), mod(i0, 7), i1]
    ones = _check_map((5, 1, 7), (35, 1))
    assert ones[1].expr == 0


S, T = sympy.symbols("s0 s1", integer=True, positive=True)


@pytest.mark.parametrize("s,t", [(8, 3), (12, 5), (4, 1)])
def test_symbolic_split_is_affine(s, t):
    new = (floordiv(S, 4), 4, T)
    assert reshape_groups((S, T), new) == [([0], [0, 1]), ([1], [2])]
    idx = _check_map((S, T), new, {S: s, T: t})
    assert all(not c.expr.has(sympy.floor, sympy.Mod) for c in idx)


@pytest.mark.parametrize("s,t", [(5, 4), (8, 3), (6, 2)])
def test_floor_sizes_in_two_groups_are_merged(s, t):
    # view(s//4, 4, -1) of an (s, t) tensor: valid for s=5, t=4 as (1, 4, 5), where pairing
    # (s) with (s//4, 4) would be wrong
    new = (floordiv(S, 4), 4, floordiv(S * T, 4 * floordiv(S, 4)))
    if (s * t) % (4 * (s // 4)):
        pytest.skip("not a valid view for these sizes")
    assert len(reshape_groups((S, T), new)) == 1
    _check_map((S, T), new, {S: s, T: t})


def test_symbolic_merge_split_roundtrip():
    for s, t in itertools.product([2, 3], [1, 4]):
        _check_map((S, T, 3), (S * T * 3,), {S: s, T: t})
        _check_map((S * T, 3), (S, T, 3), {S: s, T: t})
        _check_map((S, 2 * T), (2 * S, T), {S: s, T: t})
