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


def test_a_product_holding_a_mod_keeps_its_value():
    """sympy rewrites `Mod(2*Mod(a, 4), 4)` as `2*Mod(a, 4)` and `Mod(128*Mod(a, 3), 356)` into a
    square (sympy issues 28744, 29757); a Swin transformer's patch merging read the wrong rows
    through the first. tilefuse's `Mod` keeps their values."""
    cases = [(lambda a: mod(2 * mod(a, 4), 4), lambda v: (2 * (v % 4)) % 4),
             (lambda a: mod(128 * mod(a, 3), 356), lambda v: (128 * (v % 3)) % 356),
             (lambda a: mod(8 * mod(floordiv(a, 64), 4) + floordiv(mod(a, 64), 8), 64),
              lambda v: (8 * ((v // 64) % 4) + (v % 64) // 8) % 64)]
    for build, value in cases:
        e = build(X)
        for v in range(400):
            assert evaluate(e, {X: v}) == value(v), (e, v)
            assert evaluate(simplify_index(e, {X: 400}), {X: v}) == value(v), (e, v)


def _tree(draw, symbols, depth):
    """A random index expression over `symbols` as (sympy expression, Python function of the
    symbols' values), built with tilefuse's `mod` and `floordiv`."""
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        if draw(st.booleans()):
            k = draw(st.integers(0, len(symbols) - 1))
            return symbols[k], (lambda env, k=k: env[k])
        c = draw(st.integers(0, 9))
        return sympy.Integer(c), (lambda env, c=c: c)
    op = draw(st.sampled_from(["add", "mul", "div", "mod"]))
    a, fa = _tree(draw, symbols, depth - 1)
    if op == "add":
        b, fb = _tree(draw, symbols, depth - 1)
        return a + b, (lambda env: fa(env) + fb(env))
    c = draw(st.integers(2, 12))
    if op == "mul":
        return c * a, (lambda env: c * fa(env))
    if op == "div":
        return floordiv(a, c), (lambda env: fa(env) // c)
    return mod(a, c), (lambda env: fa(env) % c)


@st.composite
def _composed(draw):
    """An expression in z with z replaced by an expression in y (as a fused kernel composes a
    consumer's index with its producer's): sympy evaluates the Mods again on the way."""
    z = sympy.Symbol("z", integer=True, nonnegative=True)
    outer, f_outer = _tree(draw, [z], 3)
    inner, f_inner = _tree(draw, [Y], 3)
    return outer.subs(z, inner), (lambda env: f_outer([f_inner(env)]))


@settings(max_examples=300, deadline=None)
@given(_composed(), st.integers(2, 40))
def test_composed_indices_keep_their_values(composed, extent):
    e, value = composed
    simplified = simplify_index(e, {Y: extent})
    for y in range(extent):
        assert evaluate(e, {Y: y}) == value([y]), (e, y)
        assert evaluate(simplified, {Y: y}) == value([y]), (e, simplified, y)
