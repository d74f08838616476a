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


S = sympy.Symbol("s0", integer=True, positive=True)


def _sized_tree(draw, depth):
    """Like `_tree`, over y and a size symbol s0 (as a dynamic-shape graph indexes), with
    negative coefficients and divisors and moduli that are multiples of s0."""
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        leaf = draw(st.sampled_from(["y", "s", "c"]))
        if leaf == "y":
            return Y, (lambda env: env["y"])
        if leaf == "s":
            return S, (lambda env: env["s"])
        c = draw(st.integers(-9, 9))
        return sympy.Integer(c), (lambda env: c)
    op = draw(st.sampled_from(["add", "sub", "mul", "mul_s", "mul_sum", "div", "mod", "mod_s", "mod_sum", "div_s",
                               "pad", "pad_s", "trim"]))
    a, fa = _sized_tree(draw, depth - 1)
    if op in ("add", "sub"):
        b, fb = _sized_tree(draw, depth - 1)
        sign = 1 if op == "add" else -1
        return a + sign * b, (lambda env: fa(env) + sign * fb(env))
    c = draw(st.integers(1, 12))
    if op == "mul":
        return -c * a, (lambda env: -c * fa(env))
    if op == "mul_s":
        return c * S * a, (lambda env: c * env["s"] * fa(env))
    if op == "mul_sum":  # a size that is a sum, as a padded or convolved extent is
        return c * (S + 1) * a, (lambda env: c * (env["s"] + 1) * fa(env))
    if op == "mod_sum":
        return mod(a, c * (S + 1)), (lambda env: fa(env) % (c * (env["s"] + 1)))
    if op == "div":
        return floordiv(a, c), (lambda env: fa(env) // c)
    if op == "div_s":
        return floordiv(a, c * S), (lambda env: fa(env) // (c * env["s"]))
    if op == "mod":
        return mod(a, c), (lambda env: fa(env) % c)
    if op == "pad":  # rounded up to a multiple, as a window partition pads a size
        return a + mod(-a, c), (lambda env: fa(env) + (-fa(env)) % c)
    if op == "pad_s":
        return a + mod(-a, c * S), (lambda env: fa(env) + (-fa(env)) % (c * env["s"]))
    if op == "trim":
        return 2 * a - 2 * mod(a, c), (lambda env: 2 * fa(env) - 2 * (fa(env) % c))
    return mod(a, c * S), (lambda env: fa(env) % (c * env["s"]))


@st.composite
def _sized(draw):
    return _sized_tree(draw, 4)


@settings(max_examples=300, deadline=None)
@given(_sized(), st.integers(1, 7), st.integers(2, 30))
def test_indices_over_sizes_keep_their_values(sized, s, extent):
    """Moduli that are multiples of a size symbol take tilefuse's quick rules, not sympy's
    polynomial gcd: their values stay Python's for every size and index."""
    e, value = sized
    simplified = simplify_index(e, {Y: extent})
    for y in range(extent):
        env = {"y": y, "s": s}
        assert evaluate(e, {Y: y, S: s}) == value(env), (e, s, y)
        assert evaluate(simplified, {Y: y, S: s}) == value(env), (e, simplified, s, y)


def test_quick_rules_match_sympy_on_index_shapes():
    """The quick path gives sympy's simplifications on the shapes index arithmetic makes."""
    from tilefuse.ir.symbolic import Mod

    assert Mod(S * X + Y, S) == Mod(Y, S)
    assert Mod(7 * S * X + 14 * Y, 7 * S) == 7 * Mod(2 * Y, S)
    assert Mod(S - 1, S) == S - 1
    assert Mod(9 * X, 8) == Mod(X, 8)
    assert Mod(X + Mod(Y, 16), 8) == Mod(X + Y, 8)
    assert Mod(Mod(X, 4), 8) == Mod(X, 4)
    assert Mod(S * X + S, S) == 0
    assert Mod(X - 9, 8) == Mod(X + 7, 8)
    assert Mod(S * S * X + S * Y, S * S) == S * Mod(S * X + Y, S)
    # a common factor that is a sum: sympy distributes an integer into it (3*(s0 + 1) is
    # 3*s0 + 3), so the modulus left is built from exponents, not by dividing
    s1 = sympy.Symbol("s1", integer=True, positive=True)
    for coeff in (3, 9):
        e = Mod(coeff * X * (S + 1), 6 * s1 * (S + 1))
        assert not any(a.is_Rational and not a.is_Integer for a in sympy.preorder_traversal(e)), e
        for s, t, x in [(1, 1, 2), (2, 3, 7), (4, 1, 5), (3, 2, 11)]:
            assert evaluate(e, {X: x, S: s, s1: t}) == (coeff * x * (s + 1)) % (6 * t * (s + 1))


def test_a_quotient_sympy_calls_an_integer_keeps_its_floor():
    """sympy 1.14 calls `y*(2*s0 + 2)/10` an integer (it weighs only the 2s) and its `floor`
    returned the fraction; tilefuse's `Floor` decides index quotients itself."""
    e = floordiv(Y * (2 * S + 2), 10)
    for s in range(1, 6):
        for y in range(12):
            assert evaluate(e, {Y: y, S: s}) == (y * (2 * s + 2)) // 10, (e, s, y)
    assert floordiv(4 * Y + X, 4) == Y + floordiv(X, 4)
    assert floordiv(S * X + Y, S) == X + floordiv(Y, S)
    assert floordiv(6 * Y, 3) == 2 * Y


def test_quotients_inside_min_max_and_ceilings_keep_their_values():
    """The same wrong integer test reached `floor` through `Min`/`Max`/`Piecewise` and sympy's
    `ceiling`; a floor by 1 of a fraction is still a floor."""
    from tilefuse.ir.symbolic import ceildiv

    frac = Y * (2 * S + 2) / 10
    cases = [(floordiv(sympy.Min(100, Y * (2 * S + 2)), 10), lambda y, s: min(100, y * (2 * s + 2)) // 10),
             (floordiv(sympy.Max(0, Y * (2 * S + 2)), 10), lambda y, s: max(0, y * (2 * s + 2)) // 10),
             (ceildiv(Y * (2 * S + 2), 10), lambda y, s: -((-y * (2 * s + 2)) // 10)),
             (floordiv(frac, 1), lambda y, s: (y * (2 * s + 2)) // 10),
             (floordiv(sympy.Min(100, frac), 1), lambda y, s: min(100 * 10, y * (2 * s + 2)) // 10),
             (floordiv(sympy.Piecewise((frac, Y > 0), (0, True)), 1), lambda y, s: (y * (2 * s + 2)) // 10),
             (floordiv(S, 2) * 0 + floordiv(S * Y, 4) + ceildiv(S + 8 * Y, 8), lambda y, s: (s * y) // 4 - ((-(s + 8 * y)) // 8))]
    for e, value in cases:
        for s in range(1, 6):
            for y in range(9):
                assert evaluate(e, {Y: y, S: s}) == value(y, s), (e, s, y)


def test_a_mod_of_a_fraction_does_not_recurse_without_end():
    from tilefuse.ir.symbolic import Mod

    z = sympy.Symbol("z", integer=True)
    s1 = sympy.Symbol("s1", integer=True, positive=True)
    Mod(5 * z / 2 - 16, (S + 1) * (2 * s1 + 2) ** 2)  # (sympy's rules called back forever)


def test_a_size_rounded_to_a_multiple_becomes_a_ceiling():
    """`x + (-x) % k` (Swin's padding of a size to its window) is `k*ceiling(x/k)`, so the
    window count `padded // k` and `padded // (padded // k)` divide exactly instead of
    leaving nested divisions in every index."""
    from tilefuse.ir.symbolic import Ceiling, fold_mod_complement

    n = floordiv(S, 4)
    padded = fold_mod_complement(n + mod(-n, 7))
    assert padded == 7 * Ceiling(n / 7)
    assert floordiv(padded, floordiv(padded, 7)) == 7
    assert simplify_index(Y + n + mod(-n, 7), {Y: 3}) == Y + 7 * Ceiling(n / 7)
    assert fold_mod_complement(n + mod(n, 7)) == n + mod(n, 7)  # not a complement: unchanged
    assert fold_mod_complement(3 - 2 * mod(Y, S) + 2 * Y) == 3 + 2 * S * floordiv(Y, S)
    for s in range(1, 40):
        assert evaluate(padded, {S: s}) == s // 4 + (-(s // 4)) % 7
        for y in range(-5, 9):
            folded = fold_mod_complement(3 - 2 * mod(Y, S) + 2 * Y)
            assert evaluate(folded, {S: s, Y: y}) == 3 - 2 * (y % s) + 2 * y


def test_dynamos_padded_sizes_reach_the_ir_as_ceilings():
    """A size Dynamo computes as `x + PythonMod(-x, k)` arrives in the IR folded."""
    from torch.utils._sympy.functions import FloorDiv, PythonMod

    from tilefuse.frontend.context import plain_sympy
    from tilefuse.ir.symbolic import Ceiling

    x = FloorDiv(S, 4)
    assert plain_sympy(x + PythonMod(-x, 4)) == 4 * Ceiling(floordiv(S, 4) / 4)


def test_index_quotients_rebuild_as_expression_trees():
    """`sympy_to_expr` (an index holding a gathered value, rebuilt as an expression) keeps
    floor, ceiling and modulo semantics for negative and positive values: a padded size folded
    to a ceiling (`fold_mod_complement`) no longer stops the rebuild."""
    import torch

    from tilefuse.ir import dtypes as dt
    from tilefuse.ir.expr import Load
    from tilefuse.ir.interpret import Evaluator
    from tilefuse.ir.rewrite import sympy_to_expr
    from tilefuse.ir.symbolic import Ceiling, fold_mod_complement

    g = sympy.Symbol("g", integer=True)
    values = torch.arange(-13, 14)
    gathered = Load("idx", (), dt.int64)
    for e in (Ceiling(g / 4), floordiv(g, 3), mod(g, 5), fold_mod_complement(g + mod(-g, 4)) + Y):
        tree = sympy_to_expr(e, {g: gathered})
        got = Evaluator({"idx": values}, {Y: 2})(tree)
        want = [int(evaluate(e, {g: int(v), Y: 2})) for v in values]
        assert got.tolist() == want, e


def test_a_modulo_by_a_negative_number_is_bounded_by_its_sign():
    """Python's `x % -3` lies in (-3, 0]: the simplifier's bounds follow the modulus's sign (they
    put it in [0, -4], and `floor(Mod(x, -3)/4)` became 0 where it is -1); ceilings are bounded
    as floors are."""
    from tilefuse.ir.symbolic import Ceiling, Mod

    assert bounds(Mod(Y, -3), {Y: 10}) == (-2, 0)
    assert bounds(Ceiling(Y / 4), {Y: 10}) == (0, 3)
    for e in (floordiv(Mod(Y, -3), 4), floordiv(Mod(Y, -3) + 2, 3), mod(Mod(Y, -3), 5), Ceiling(Y / 4) - 1):
        simplified = simplify_index(e, {Y: 10})
        for y in range(10):
            assert evaluate(simplified, {Y: y}) == evaluate(e, {Y: y}), (e, simplified, y)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 7), st.integers(1, 7), st.integers(1, 9), st.integers(-500, 500), st.integers(0, 4))
def test_unravelled_blocks_recombine_and_nested_quotients_divide_once(d, e, m, xv, c):
    """`c*Mod(x, d) + c*d*Mod(x // d, m)` is `c*Mod(x, d*m)`, and `x // d // e` is `x // (d*e)`,
    negative x included; a contiguous block unravelled dim by dim becomes its flat index."""
    exprs = [c * mod(X, d) + c * d * mod(floordiv(X, d), m), floordiv(floordiv(X, d), e),
             mod(floordiv(floordiv(X, d), e), m) + 3 * mod(X, d)]
    for expr in exprs:
        s = simplify_index(expr, {})
        assert evaluate(expr, {X: xv}) == evaluate(s, {X: xv}), (expr, s, xv)
    assert simplify_index(c * mod(X, d) + c * d * mod(floordiv(X, d), m), {}) == c * mod(X, d * m)
    flat = 1152 * floordiv(X, 1152) + mod(X, 3) + 9 * mod(floordiv(floordiv(X, 3), 3), 128) + 3 * mod(floordiv(X, 3), 3)
    assert simplify_index(flat, {X: 64 * 1152}) == X


def test_a_float_scaled_quotient_keeps_both_divisions():
    """`floor(0.7*s) // 7` is not `floor(0.1*s)` in floating point (s = 10: 1, not 0)."""
    s = sympy.Symbol("s0", integer=True, positive=True)
    from tilefuse.ir.symbolic import Floor
    e = floordiv(Floor(sympy.Float(0.7) * s), 7)
    assert simplify_index(e, {}).has(sympy.Float) and evaluate(simplify_index(e, {}), {s: 10}) == 1
