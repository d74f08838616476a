"""Integer index expressions (sympy, over sizes, strides and tile symbols) printed as Triton.

sympy's floor and Mod round toward minus infinity where Triton's `//` and `%` truncate, so a
dividend that may be negative goes through a helper (`_floordiv`, `_remainder`) whose name is
added to the caller's `helpers`; sizes computed in floats (`floor(1.5 * s0)`) are computed in
fp64 as PyTorch computes them.
"""
from __future__ import annotations

import sympy


def format_sympy(e, helpers: set | None = None) -> str:
    """Print an integer index expression. sympy's floor/Mod round toward minus infinity;
    Triton's // and % truncate, so a dividend that may be negative goes through helpers."""
    helpers = set() if helpers is None else helpers
    return _fmt(sympy.sympify(e), helpers)


def _fmt(e, helpers: set, f64: bool = False) -> str:
    format_sympy = lambda x: _fmt(sympy.sympify(x), helpers, f64)  # noqa: E731
    if e.is_Integer:
        return str(int(e))
    if e.is_Rational or e.is_Float:
        # inside a size computed in floats, literals are fp64 scalars: the arithmetic is then
        # in double, as PyTorch computes it (fp32 would put floor(0.7 * 10) at 6)
        return f"tl.full([], {float(e)!r}, tl.float64)" if f64 else repr(float(e))
    if isinstance(e, (sympy.floor, sympy.ceiling)) and e.args[0].has(sympy.Float):
        fn = "tl.floor" if isinstance(e, sympy.floor) else "tl.ceil"
        return f"{fn}({_fmt(sympy.sympify(e.args[0]), helpers, True)}).to(tl.int64)"
    if e.is_Symbol:
        return e.name
    if e.is_Add:
        terms = [format_sympy(a) for a in e.args]
        return "(" + " + ".join(terms) + ")"
    if e.is_Mul:
        num, den = e.as_numer_denom()
        if den != 1:
            return f"({format_sympy(num)} / {format_sympy(den)})"
        coeff, rest = e.as_coeff_Mul()
        if coeff == -1:
            return f"(-{format_sympy(rest)})"
        return "(" + " * ".join(format_sympy(a) for a in e.args) + ")"
    if e.is_Pow and e.exp.is_Integer and int(e.exp) > 0:
        return "(" + " * ".join([format_sympy(e.base)] * int(e.exp)) + ")"
    if e.is_Pow:  # float powers of sizes (SDPA's d ** -0.25 with a symbolic head dim)
        return f"tl.exp2(tl.log2(({format_sympy(e.base)}).to(tl.float32)) * {format_sympy(e.exp)})"
    if isinstance(e, sympy.floor):
        num, den = e.args[0].as_numer_denom()
        if num.is_nonnegative and den.is_positive:
            return f"({format_sympy(num)} // {format_sympy(den)})"
        helpers.add("floordiv")
        return f"_floordiv({format_sympy(num)}, {format_sympy(den)})"
    if isinstance(e, sympy.ceiling):
        num, den = e.args[0].as_numer_denom()
        if num.is_nonnegative:  # (index denominators are positive: sizes, block sizes)
            return f"tl.cdiv({format_sympy(num)}, {format_sympy(den)})"
        helpers.add("floordiv")  # (tl.cdiv rounds a negative numerator the wrong way)
        return f"(-_floordiv({format_sympy(-num)}, {format_sympy(den)}))"
    if isinstance(e, sympy.Mod):
        a, m = e.args
        if a.is_nonnegative and m.is_positive:
            return f"({format_sympy(a)} % {format_sympy(m)})"
        helpers.add("remainder")
        return f"_remainder({format_sympy(a)}, {format_sympy(m)})"
    if isinstance(e, sympy.Min):
        out = format_sympy(e.args[0])
        for a in e.args[1:]:
            out = f"tl.minimum({out}, {format_sympy(a)})"
        return out
    if isinstance(e, sympy.Max):
        out = format_sympy(e.args[0])
        for a in e.args[1:]:
            out = f"tl.maximum({out}, {format_sympy(a)})"
        return out
    raise NotImplementedError(f"cannot print index expression {e} for Triton")
