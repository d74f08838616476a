"""Index simplification keeps values; evaluation matches Python integer arithmetic."""
import sympy
from hypothesis import given, settings, strategies as st

from tilefuse.ir.symbolic import bounds, evaluate, floordiv, mod, simplify_index

X = sympy.Symbol("x", integer=True, nonnegative=True)
Y = sympy.Symbol("y", integer=True, nonnegative=True)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9), st.integers(1, 9), st.integers(0, 80), st.integers(0, 8), st.integers(0, 5))
def test_simplify_preserves_value(a, d, xv, yv, c):
    yv = yv % a
    exprs = [floordiv(X * d + Y, d), mod(X * d + Y, d), d * floordiv(X, d) + mod(X, d),
             floordiv(c * X * a + Y, a), mod(X * a * c + Y + c, a)]
    for e in exprs:
        s = simplify_index(e, {Y: min(a, d) if e is exprs[0] or e is exprs[1] else a})
        env = {X: xv, Y: yv % (min(a, d) if e is exprs[0] or e is exprs[1] else a)}
        assert evaluate(e, env) == evaluate(s, env), (e, s, env)


def test_simplify_drops_redundant_division():
    assert simplify_index(floordiv(X * 8 + Y, 8), {Y: 8}) == X
    assert simplify_index(mod(X * 8 + Y, 8), {Y: 8}) == Y
    assert simplify_index(100 * floordiv(X, 100) + mod(X, 100), {}) == X
    s = sympy.Symbol("s1", integer=True, positive=True)
    assert simplify_index(floordiv(X * s + Y, s), {Y: s}) == X


def test_bounds():
    assert bounds(3 * X + Y + 2, {X: 4, Y: 5}) == (2, 15)
    assert bounds(mod(X, 7), {}) == (0, 6)
