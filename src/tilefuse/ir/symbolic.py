"""Index arithmetic on sympy: integer division and modulo with range-aware simplification,
and evaluation of index expressions on concrete values (ints or tensors).

Index symbols are non-negative integers with known extents; `simplify_index` uses those
extents to drop divisions and modulos that cannot change a value (`(i0 + 4*i1) // 4 == i1`
when `i0 < 4`), which is what keeps folded reshapes cheap in generated code.
"""
from __future__ import annotations

import functools
import math

import sympy


class Mod(sympy.Mod):
    """sympy's `Mod` without its rewrite of a product holding a `Mod`, which is wrong: sympy
    (1.14 and before) turns `Mod(2*Mod(a, 4), 4)` into `2*Mod(a, 4)` (a = 2: 4 where the value
    is 0) and `Mod(128*Mod(x, 3), 356)` into a square (sympy issues 28744, 29757). A Swin
    transformer's patch merging, fused after its attention windows are put back in place,
    composes such indices and read the wrong rows. Here such a product only has the common factor of its coefficient and the
    modulus taken out (`Mod(g*x, g*m) = g*Mod(x, m)` for integers: `Mod(2*Mod(a, 4), 4)` is
    `2*Mod(a, 2)`) and is otherwise left as written; everything else evaluates as sympy's.
    Every index `Mod` tilefuse builds is this one (`mod`), and the index simplifier turns a
    plain sympy `Mod` into it, so rebuilding an expression (`subs`, `xreplace`) evaluates
    with these rules."""

    @classmethod
    def eval(cls, p, q):
        if p.is_Mul and any(isinstance(f, sympy.Mod) for f in p.args) and not (p.is_number and q.is_number):
            coeff, rest = p.as_coeff_Mul()
            if q.is_Integer and coeff.is_Integer and int(q) > 0:
                g = math.gcd(int(coeff), int(q))
                if g > 1:
                    return g * cls(sympy.Integer(int(coeff) // g) * rest, sympy.Integer(int(q) // g))
            return None
        quick = _index_mod(cls, p, q)
        if quick is not _UNDECIDED:
            return quick
        global _SYMPY_MOD_DEPTH
        if _SYMPY_MOD_DEPTH >= 8:
            return None  # (sympy's rules call back into this class: on a fraction, without end)
        _SYMPY_MOD_DEPTH += 1
        try:
            return super().eval(p, q)
        finally:
            _SYMPY_MOD_DEPTH -= 1


_SYMPY_MOD_DEPTH = 0


_UNDECIDED = object()


def _index_mod(cls, p, q):
    """`Mod(p, q)` for index arithmetic, where sympy's own rules are slow: sympy extracts a
    common factor with a polynomial gcd on every evaluation, which took most of a dynamic-shape
    compile's planning. Here p is a sum of integer-coefficient terms over integer atoms and q
    a positive monomial (`7`, `s0`, `4*s0*s1`); the same rules apply with the gcd of monomials:
    terms that are multiples of q dropped, an inner `Mod` by a multiple of q unwrapped, a
    constant or a coefficient of q's size or more reduced, and the common factor of p's terms
    and q taken out. Any integer-valued factor counts as an atom (`floor(s0/4)`, a sum), so
    `Mod((a + b)*n + c, n)` is `Mod(c, n)`. Anything else is `_UNDECIDED` and left to sympy."""
    q_coeff, q_mono = q.as_coeff_Mul()
    if not (q_coeff.is_Integer and int(q_coeff) > 0):
        return _UNDECIDED  # (each rule holds for any non-zero q; sympy cannot tell `s0 // 4 > 0`)
    q_powers = _monomial_powers(q_mono)
    if q_powers is None:
        return _UNDECIDED
    if p.is_Integer:
        if p == 0:
            return sympy.Integer(0)
        return sympy.Integer(int(p) % int(q)) if q.is_Integer else _UNDECIDED
    terms, changed, pending = [], False, list(sympy.Add.make_args(p))
    while pending:
        c, m = pending.pop().as_coeff_Mul()
        if not c.is_Integer:
            return _UNDECIDED
        c = int(c)
        if isinstance(m, sympy.Mod) and _divides(m.args[1], q_coeff, q_powers):
            pending.extend(sympy.Add.make_args(c * m.args[0]))  # c*Mod(y, k*q) ≡ c*y (mod q)
            changed = True
            continue
        powers = _monomial_powers(m)
        if powers is None:
            return _UNDECIDED
        if _is_multiple(c, powers, q_coeff, q_powers):
            changed = True  # a multiple of q
            continue
        if q.is_Integer and abs(c) >= int(q):
            c, changed = c % int(q), True
        terms.append((c, m, powers))
    if not terms:
        return sympy.Integer(0)
    if len(terms) == 1 and isinstance(terms[0][1], sympy.Mod) and terms[0][0] == 1:
        inner = terms[0][1].args[1]  # Mod(Mod(x, k), q) with 0 < k <= q is Mod(x, k)
        if inner.is_Integer and q.is_Integer and 0 < int(inner) <= int(q):
            return terms[0][1]
    g = math.gcd(int(q_coeff), *(c for c, _, _ in terms))
    common = dict(q_powers)
    for _, _, powers in terms:
        common = {b: min(e, powers[b]) for b, e in common.items() if b in powers}
    if g > 1 or common:
        # (each quotient from the exponents: dividing by g*(a + b) would not cancel, as sympy
        # distributes g into the sum)
        common_atoms = sympy.Mul(*(b**e for b, e in common.items()))
        rest = sympy.Add(*(sympy.Integer(c // g) * (m / common_atoms) for c, m, _ in terms))
        modulus = sympy.Integer(int(q_coeff) // g) * sympy.Mul(*(b**(e - common.get(b, 0)) for b, e in q_powers.items()))
        return sympy.Integer(g) * common_atoms * cls(rest, modulus)
    if changed:
        return cls(sympy.Add(*(sympy.Integer(c) * m for c, m, _ in terms)), q)
    return None


def _monomial_powers(m):
    """{atom: power} of an integer-valued monomial with positive integer powers, or None."""
    powers = {}
    for f in sympy.Mul.make_args(m):
        if f == 1:
            continue
        base, e = f.as_base_exp()
        if not (e.is_Integer and int(e) > 0 and not base.is_Number and _integer_valued(base)):
            return None
        powers[base] = powers.get(base, 0) + int(e)
    return powers


def _integer_valued(e) -> bool:
    """Whether an index expression is an integer, read from its structure: sympy cannot tell
    for `floor(a / n)` (its argument is not known to be real while n might be 0), and its own
    test of a product is wrong (`y*(2*s0 + 2)/10`), so only atoms are asked."""
    if e.is_Integer or isinstance(e, (sympy.floor, sympy.ceiling)):
        return True
    if e.is_Add or e.is_Mul or isinstance(e, (sympy.Mod, sympy.Min, sympy.Max)):
        return all(_integer_valued(a) for a in e.args)
    if e.is_Pow:
        return e.exp.is_Integer and int(e.exp) >= 0 and _integer_valued(e.base)
    if isinstance(e, sympy.Piecewise):
        return all(_integer_valued(value) for value, _ in e.args)
    return (e.is_Symbol or e.is_Atom) and e.is_integer is True


def _divides(x, q_coeff, q_powers) -> bool:
    """Whether q (q_coeff times the monomial q_powers) divides the term x."""
    c, m = x.as_coeff_Mul()
    powers = _monomial_powers(m)
    return c.is_Integer and powers is not None and _is_multiple(int(c), powers, q_coeff, q_powers)


def _is_multiple(c: int, powers: dict, q_coeff, q_powers: dict) -> bool:
    """Whether c times the monomial `powers` is a multiple of q_coeff times `q_powers`."""
    return c % int(q_coeff) == 0 and all(powers.get(b, 0) >= e for b, e in q_powers.items())


class Floor(sympy.floor):
    """sympy's `floor` without its trust in sympy's integer test of a product, which is wrong:
    sympy (1.14) calls `y*(2*s0 + 2)/10` an integer, weighing only the factors of 2 in the
    numerator against the 10, so `floor(y*(2*s0 + 2)/10)` became that fraction. An index
    quotient is decided here instead: an argument made of integers is its own floor, and the
    terms of an integer numerator that the (integer or monomial) denominator divides are taken
    out (`floor((4*y + x)/4)` is `y + floor(x/4)`); anything else stays as written. Every
    index floor tilefuse builds is this one (`floordiv`), and the index simplifier rebuilds a
    plain sympy `floor` as it, as it does `Mod`."""

    def _sympystr(self, printer):  # (printed as sympy's own)
        return f"floor({printer._print(self.args[0])})"

    @classmethod
    def eval(cls, arg):
        return super().eval(arg) if arg.is_Number else _integer_quotient(cls, arg)


class Ceiling(sympy.ceiling):
    """sympy's `ceiling`, with index quotients decided as `Floor` decides them (sympy's own
    has the same trust in its integer test)."""

    def _sympystr(self, printer):  # (printed as sympy's own)
        return f"ceiling({printer._print(self.args[0])})"

    @classmethod
    def eval(cls, arg):
        return super().eval(arg) if arg.is_Number else _integer_quotient(cls, arg)


def _integer_quotient(cls, arg):
    """`cls(arg)` (a floor or ceiling) where arg is an integer numerator over a positive integer
    or monomial denominator: arg itself if it is an integer, else the numerator's terms that
    the denominator divides taken out (`cls(q + r/d)` is `q + cls(r/d)` for an integer q), else
    None (left as written)."""
    if _integer_valued(arg):
        return arg
    num, den = arg.as_numer_denom()
    if den.is_Add and _integer_valued(num) and _integer_valued(den):
        return _polynomial_quotient(cls, num, den)
    d_coeff, d_mono = den.as_coeff_Mul()
    d_powers = _monomial_powers(d_mono) if d_coeff.is_Integer and int(d_coeff) > 0 else None
    if d_powers is None or not _integer_valued(num):
        return None
    whole, rest = [], []
    for t in sympy.Add.make_args(num):
        (whole if _divides(t, d_coeff, d_powers) else rest).append(t)
    if not whole:
        return None
    quotient = sympy.Add(*whole) / den
    return quotient + cls(sympy.Add(*rest) / den) if rest else quotient


@functools.lru_cache(maxsize=4096)
def _polynomial_quotient(cls, num, den):
    """`cls(num / den)` over a sum `den` (a size less one: `s - 1`) as `q + cls(r / den)`, where
    polynomial division gives `num = q*den + r` with integer coefficients, else None. Without
    it a quotient that `sympy.expand` had split term by term (`floor(a*s/(s - 1) - a/(s - 1)
    + r/(s - 1))`) was left with fractions, which Triton divided as floats and C++ truncated
    term by term."""
    gens = sorted(den.free_symbols, key=str)
    if not gens:
        return None
    try:
        q, r = sympy.div(sympy.expand(num), sympy.expand(den), *gens)
    except sympy.PolynomialError:
        return None
    if q == 0 or not all(_integer_polynomial(part) for part in (q, r)):
        return None
    return q + cls(r / den) if r != 0 else q


def _integer_polynomial(e) -> bool:
    """Whether `e` is a polynomial with integer coefficients in integer symbols."""
    syms = sorted(e.free_symbols, key=str)
    if not syms:
        return e.is_Integer
    if not all(x.is_integer for x in syms):
        return False
    try:
        return all(c.is_Integer for c in sympy.Poly(e, *syms).coeffs())
    except sympy.PolynomialError:
        return False


def fold_mod_complement(e):
    """`c*Mod(u, k) - c*u` in a sum as `-c*k*floor(u/k)` (a ceiling where u is negated):
    rounding to a multiple, as `x + (k - x % k) % k` pads a size, is `k*ceiling(x/k)`, which
    later quotients divide exactly (`padded // (padded // k)` is `k`), where the Mod form
    leaves every division written out. Only a sum that holds each term of `-c*u` as written
    changes; anything else is returned as it is."""
    if not e.is_Add:
        return e
    for t in sympy.Add.make_args(e):
        c, core = t.as_coeff_Mul()
        if not isinstance(core, sympy.Mod):
            continue
        u, k = core.args
        others = e - t
        if not set(sympy.Add.make_args(-c * u)) <= set(sympy.Add.make_args(others)):
            continue
        rest = others + c * u
        if u.could_extract_minus_sign():
            return fold_mod_complement(rest + c * k * Ceiling(-u / k))
        return fold_mod_complement(rest - c * k * Floor(u / k))
    return e


@functools.lru_cache(maxsize=4096)
def _min_max(kind, args: tuple) -> sympy.Expr:
    return (sympy.Min if kind == "min" else sympy.Max)(*args)


def smin(*args) -> sympy.Expr:
    """`sympy.Min(*args)`, remembered: sympy decides which argument is smaller by comparing
    them under their assumptions (milliseconds for expressions of floors and ceilings), and the
    layers of a model ask for the same bounds of their kernels again and again."""
    return _min_max("min", tuple(sympy.sympify(a) for a in args))


def smax(*args) -> sympy.Expr:
    """`sympy.Max(*args)`, remembered (see `smin`)."""
    return _min_max("max", tuple(sympy.sympify(a) for a in args))


def floordiv(a, b) -> sympy.Expr:
    """`a // b` of index expressions (`a` itself where b is 1 and a an integer)."""
    return Floor(sympy.sympify(a) / sympy.sympify(b))


def ceildiv(a, b) -> sympy.Expr:
    return Ceiling(sympy.sympify(a) / sympy.sympify(b))


def mod(a, b) -> sympy.Expr:
    a, b = sympy.sympify(a), sympy.sympify(b)
    if b == 1:
        return sympy.Integer(0)
    return Mod(a, b)


def unravel_sym(flat, shape) -> tuple:
    """The coordinates of row-major position `flat` in `shape` (the first one unbounded)."""
    out = []
    for k in range(len(shape) - 1, -1, -1):
        n = sympy.sympify(shape[k])
        if k == 0:
            out.append(flat)
        elif n == 1 or n == 0:  # an extent of 0 has no elements: any index will do
            out.append(sympy.Integer(0))
        else:
            out.append(mod(flat, n))
            flat = floordiv(flat, n)
    return tuple(reversed(out))


def ravel_sym(index, shape) -> sympy.Expr:
    """The row-major position of `index` in `shape`."""
    flat = sympy.Integer(0)
    for i, n in zip(index, shape):
        flat = flat * n + i
    return flat


def bounds(expr: sympy.Expr, ranges: dict) -> tuple[float, float]:
    """Inclusive (lo, hi) of an integer expression given `ranges[sym] = extent` (the symbol
    lies in [0, extent)). Unknown parts give infinite bounds."""
    expr = sympy.sympify(expr)
    if expr.is_Integer:
        v = int(expr)
        return v, v
    if expr.is_Symbol:
        ext = ranges.get(expr)
        if ext is not None and sympy.sympify(ext).is_Integer:
            return 0, int(ext) - 1
        return (0 if expr.is_nonnegative else -math.inf), math.inf
    if expr.is_Add:
        lo = hi = 0
        for t in expr.args:
            a, b = bounds(t, ranges)
            lo, hi = lo + a, hi + b
        return lo, hi
    if expr.is_Mul:
        lo, hi = 1, 1
        for t in expr.args:
            a, b = bounds(t, ranges)
            cands = [x * y for x in (lo, hi) for y in (a, b) if not (x == 0 and math.isinf(y)) and not (y == 0 and math.isinf(x))]
            if not cands:
                return -math.inf, math.inf
            lo, hi = min(cands), max(cands)
        return lo, hi
    if isinstance(expr, (sympy.floor, sympy.ceiling)):
        num, den = expr.args[0].as_numer_denom()
        if den.is_Integer and int(den) > 0:
            d, up = int(den), isinstance(expr, sympy.ceiling)
            quotient = (lambda v: -((-v) // d)) if up else (lambda v: v // d)
            return tuple(v if math.isinf(v) else quotient(v) for v in bounds(num, ranges))
    if isinstance(expr, sympy.Mod):
        m = expr.args[1]
        if m.is_Integer and int(m) != 0:  # (Python's sign: that of the modulus)
            return (0, int(m) - 1) if int(m) > 0 else (int(m) + 1, 0)
        return (0, math.inf) if m.is_positive else (-math.inf, math.inf)
    return -math.inf, math.inf


#: simplify_index's results by (expression, the ranges of its own symbols): a model's layers
#: ask for the same index expressions over and over
_SIMPLIFIED: dict = {}
_SIMPLIFIED_LIMIT = 16384


def simplify_index(expr, ranges: dict) -> sympy.Expr:
    """Remove divisions/modulos that the symbols' ranges make redundant."""
    expr = sympy.sympify(expr)
    if expr.is_Atom:
        return expr
    try:  # (only the ranges of the expression's own symbols are read)
        key = (expr, frozenset((s, ranges[s]) for s in expr.free_symbols if s in ranges))
        hash(key)
    except TypeError:  # (a range that cannot be a key: simplified without the memo)
        return _simplify_index(expr, ranges)
    found = _SIMPLIFIED.get(key)
    if found is None:
        if len(_SIMPLIFIED) >= _SIMPLIFIED_LIMIT:
            _SIMPLIFIED.clear()
        found = _SIMPLIFIED[key] = _simplify_index(expr, ranges)
    return found


def _simplify_index(expr: sympy.Expr, ranges: dict) -> sympy.Expr:

    def rewrite(e):
        if e.is_Add:
            return fold_mod_complement(e)
        if isinstance(e, sympy.floor):
            num, den = e.args[0].as_numer_denom()
            if isinstance(num, sympy.floor) and den.is_Integer and int(den) > 0 and not num.has(sympy.Float):
                # floor(floor(y) / d) == floor(y / d) for a positive integer d: an index
                # unravelled dim by dim divides once (`x // 28 // 28` is `x // 784`); not for a
                # float-scaled y (`floor(0.7*s) // 7`), whose double rounding would change
                return Floor(num.args[0] / den)
            if not den.is_Integer and den.is_positive:
                # symbolic divisor: (q*den + r) // den == q when r is a symbol ranging over den
                q, rest = _split_multiple(num, den)
                if rest == 0 or (rest.is_Symbol and sympy.sympify(ranges.get(rest)) == den):
                    return q
            if den.is_Integer and int(den) > 0:
                d = int(den)
                # split num = d*q + rest where q collects terms with coefficients divisible by d
                q, rest = sympy.Integer(0), sympy.Integer(0)
                for t in sympy.Add.make_args(sympy.expand(num)):
                    c, _ = t.as_coeff_Mul()
                    if c.is_Integer and int(c) % d == 0:
                        q += t / d
                    else:
                        rest += t
                lo, hi = bounds(rest, ranges)
                if lo >= 0 and hi < d:
                    return q
                if q != 0 and lo >= 0:
                    return q + Floor(rest / d)
        if isinstance(e, sympy.Mod):
            a, m = e.args
            if not m.is_Integer and m.is_positive:
                q, rest = _split_multiple(a, m)
                if rest.is_Symbol and sympy.sympify(ranges.get(rest)) == m:
                    return rest
            if m.is_Integer:
                d = int(m)
                rest = sympy.Integer(0)
                for t in sympy.Add.make_args(sympy.expand(a)):
                    c, _ = t.as_coeff_Mul()
                    if not (c.is_Integer and int(c) % d == 0):
                        rest += t
                lo, hi = bounds(rest, ranges)
                if lo >= 0 and hi < d:
                    return rest
                if rest != a and lo >= 0:
                    return Mod(rest, m)
        return e

    prev = None
    while prev != expr:
        prev = expr
        expr = _postorder_rewrite(expr, rewrite)
        expr = _postorder_rewrite(expr, _recombine_divmod)
        expr = _postorder_rewrite(expr, _recombine_nested_mod)
    return expr


def _recombine_divmod(e):
    """c*d*floor(a/d) + c*Mod(a, d) -> c*a (what ravel(unravel(a)) produces)."""
    if not e.is_Add:
        return e
    terms = list(sympy.Add.make_args(e))
    floors = {sympy.expand(f) for t in terms for f in _floors_of(t)}
    if not floors:
        return e  # (nothing to recombine with: the common case, decided without expanding)
    changed = True
    while changed:
        changed = False
        for t in terms:
            coeff, core = t.as_coeff_Mul()
            mods = [f for f in sympy.Mul.make_args(core) if isinstance(f, sympy.Mod)]
            if len(mods) != 1:
                continue
            m = mods[0]
            rest = sympy.Mul(*[f for f in sympy.Mul.make_args(core) if f is not m])
            a, d = m.args
            quotient = sympy.expand(Floor(a / d))
            if quotient not in floors:
                continue
            target = coeff * rest * d * quotient
            for u in terms:
                if u is not t and quotient in map(sympy.expand, _floors_of(u)) and sympy.expand(u - target) == 0:
                    terms.remove(u)
                    terms.remove(t)
                    terms.append(coeff * rest * a)
                    changed = True
                    break
            if changed:
                break
    return sympy.Add(*terms)


def _recombine_nested_mod(e):
    """c*Mod(a, d) + c*d*Mod(floor(a/d), m) -> c*Mod(a, d*m) for positive integers d, m: the
    offset of an element of a contiguous block unravelled dim by dim (`x % 3 + 3*(x // 3 % 3)`
    is `x % 9`), which `_recombine_divmod` then folds with the block's own quotient."""
    if not e.is_Add or not e.has(sympy.Mod) or e.has(sympy.Float):
        return e  # (a float-scaled size rounds differently once its divisors are merged)
    terms = list(sympy.Add.make_args(e))

    def split(t):
        coeff, core = t.as_coeff_Mul()
        mods = [f for f in sympy.Mul.make_args(core) if isinstance(f, sympy.Mod)]
        if len(mods) != 1:
            return None
        rest = sympy.Mul(*[f for f in sympy.Mul.make_args(core) if f is not mods[0]])
        return coeff * rest, mods[0]

    changed = True
    while changed:
        changed = False
        parts = [(t, split(t)) for t in terms]
        for t, pt in parts:
            if pt is None or not (pt[1].args[1].is_Integer and int(pt[1].args[1]) > 0):
                continue
            k, (a, d) = pt[0], pt[1].args
            quotient = sympy.expand(Floor(a / d))
            for u, pu in parts:
                if u is t or pu is None:
                    continue
                inner, m = pu[1].args
                if (m.is_Integer and int(m) > 0 and isinstance(inner, sympy.floor)
                        and sympy.expand(inner) == quotient and sympy.expand(pu[0] - k * d) == 0):
                    terms.remove(t)
                    terms.remove(u)
                    terms.append(k * mod(a, d * m))
                    changed = True
                    break
            if changed:
                break
    return sympy.Add(*terms)


def _floors_of(term):
    return [f for f in sympy.Mul.make_args(term) if isinstance(f, sympy.floor)]


def _split_multiple(num, den):
    """num = den*q + rest, collecting the terms of num that are multiples of den."""
    q, rest = sympy.Integer(0), sympy.Integer(0)
    for t in sympy.Add.make_args(sympy.expand(num)):
        quotient = sympy.cancel(t / den)
        if quotient.is_polynomial() and sympy.fraction(quotient)[1] == 1 and not quotient.has(sympy.floor, sympy.Mod) and sympy.expand(quotient * den - t) == 0 and all(
                f.is_Integer for f in [sympy.fraction(quotient)[1]]):
            q += quotient
        else:
            rest += t
    return q, rest


def _postorder_rewrite(e, fn):
    if e.is_Atom:
        return e
    args = [_postorder_rewrite(a, fn) for a in e.args]
    ours = as_index_function(e, args)
    if ours is not None:
        e = ours
    elif any(a is not b for a, b in zip(args, e.args)):
        e = e.func(*args)
    return fn(e)


#: sympy's own index functions and tilefuse's, whose rules are right (`Mod`, `Floor`, `Ceiling`)
_INDEX_FUNCTIONS = {sympy.Mod: lambda p, q: mod(p, q), sympy.floor: lambda x: Floor(x),
                    sympy.ceiling: lambda x: Ceiling(x)}


def as_index_function(e, args):
    """`e` (sympy's own `Mod`, `floor` or `ceiling`) rebuilt over `args` as tilefuse's, else None."""
    make = _INDEX_FUNCTIONS.get(type(e))
    return make(*args) if make is not None else None


def evaluate(expr, env: dict):
    """Evaluate an index expression with symbols bound to ints or integer tensors."""
    expr = sympy.sympify(expr)
    if expr.is_Integer:
        return int(expr)
    if expr.is_Rational:
        return float(expr)
    if expr.is_Float:
        return float(expr)
    if expr.is_Symbol:
        if expr in env:
            return env[expr]
        if expr.name in env:
            return env[expr.name]
        raise KeyError(f"no value bound for symbol {expr}")
    if isinstance(expr, sympy.Piecewise):  # torch.sym_ite: the first branch whose condition holds
        for value, cond in expr.args:
            if cond == sympy.true or bool(evaluate(cond, env)):
                return evaluate(value, env)
        raise ValueError(f"no branch of {expr} holds")
    if expr == sympy.true or expr == sympy.false:
        return bool(expr)
    if expr.is_Relational:
        return _RELATIONS[type(expr)](evaluate(expr.lhs, env), evaluate(expr.rhs, env))
    if isinstance(expr, (sympy.And, sympy.Or, sympy.Not)):
        values = [bool(evaluate(a, env)) for a in expr.args]
        return all(values) if isinstance(expr, sympy.And) else any(values) if isinstance(expr, sympy.Or) else not values[0]
    args = [evaluate(a, env) for a in expr.args]
    if expr.is_Add:
        out = args[0]
        for a in args[1:]:
            out = out + a
        return out
    if expr.is_Mul:
        # keep integer arithmetic exact: multiply by the numerators, then floor-divide
        num, den = expr.as_numer_denom()
        if den != 1:
            return evaluate(num, env) / evaluate(den, env)
        out = args[0]
        for a in args[1:]:
            out = out * a
        return out
    if expr.is_Pow:
        base, exp = args
        return base**exp
    if isinstance(expr, sympy.floor):
        inner = expr.args[0]
        num, den = inner.as_numer_denom()
        n, d = evaluate(num, env), evaluate(den, env)
        return n // d
    if isinstance(expr, sympy.ceiling):
        num, den = expr.args[0].as_numer_denom()
        n, d = evaluate(num, env), evaluate(den, env)
        return -((-n) // d)
    if isinstance(expr, sympy.Mod):
        return args[0] % args[1]
    if isinstance(expr, sympy.Max):
        out = args[0]
        for a in args[1:]:
            out = _max(out, a)
        return out
    if isinstance(expr, sympy.Min):
        out = args[0]
        for a in args[1:]:
            out = _min(out, a)
        return out
    raise NotImplementedError(f"cannot evaluate index expression {expr} ({type(expr).__name__})")


_RELATIONS = {sympy.Eq: lambda a, b: a == b, sympy.Ne: lambda a, b: a != b, sympy.Lt: lambda a, b: a < b,
              sympy.Le: lambda a, b: a <= b, sympy.Gt: lambda a, b: a > b, sympy.Ge: lambda a, b: a >= b}


def _max(a, b):
    if hasattr(a, "clamp_min") or hasattr(b, "clamp_min"):
        import torch

        return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))
    return max(a, b)


def _min(a, b):
    if hasattr(a, "clamp_min") or hasattr(b, "clamp_min"):
        import torch

        return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))
    return min(a, b)
def contiguous_strides(shape) -> tuple:
    """Row-major strides of `shape` (sympy), in elements."""
    strides, acc = [], sympy.Integer(1)
    for d in reversed(shape):
        strides.append(acc)
        acc = acc * d
    return tuple(reversed(strides))


