"""Index substitution: rename or replace index symbols inside expressions.

Inlining a producer into a consumer substitutes the producer's index symbols (`i0, i1, ..`)
with the consumer's index expressions. These are usually affine (`Index`) and stay in sympy;
for gathers they are arbitrary integer expressions, in which case the affected index leaf is
rebuilt as an expression tree.
"""
from __future__ import annotations

import sympy

from . import dtypes as dt
from .expr import Expr, Index, binary, const, transform, unary


def sympy_to_expr(e: sympy.Expr, mapping: dict, dtype=dt.int64) -> Expr:
    """Turn a sympy expression into an expression tree of `dtype`, replacing symbols in
    `mapping` by their expressions: integer index arithmetic (+, *, floor and ceiling division, modulo)
    and, for float dtypes, the exp/log/power terms that derived repairs contain."""
    e = sympy.sympify(e)
    if e in mapping:
        return mapping[e]
    if e.is_Symbol:
        return Index(e)
    if e.is_Number:
        return const(int(e) if dtype.is_int else float(e), dtype)
    if dtype.is_int and not (e.free_symbols & set(mapping)):
        return Index(e)

    def sub(x):
        return sympy_to_expr(x, mapping, dtype)

    if e.is_Add or e.is_Mul:
        op = "add" if e.is_Add else "mul"
        out = sub(e.args[0])
        for a in e.args[1:]:
            out = binary(op, out, sub(a))
        return out
    if isinstance(e, sympy.floor):
        num, den = e.args[0].as_numer_denom()
        return binary("floordiv", sub(num), sub(den))
    if isinstance(e, sympy.ceiling):  # ceil(n/d) = -floor(-n/d)
        num, den = e.args[0].as_numer_denom()
        return binary("sub", const(0, dtype), binary("floordiv", sub(-num), sub(den)))
    if isinstance(e, sympy.Mod):
        return binary("mod", sub(e.args[0]), sub(e.args[1]))
    if dtype.is_float and isinstance(e, (sympy.exp, sympy.log)):
        return unary("exp" if isinstance(e, sympy.exp) else "log", sub(e.args[0]))
    if dtype.is_float and e.is_Pow:
        base, ex = e.args
        if ex == -1:
            return binary("truediv", const(1.0, dtype), sub(base))
        if base == 2:
            return unary("exp2", sub(ex))
        return binary("pow", sub(base), sub(ex))
    raise NotImplementedError(f"cannot rebuild expression {e}")


def substitute_index(body: Expr, mapping: dict) -> Expr:
    """Replace index symbols by expressions throughout `body`."""
    if not mapping:
        return body
    affine = {s: v.expr for s, v in mapping.items() if isinstance(v, Index) and v.dtype.is_int}
    general = {s: v for s, v in mapping.items() if s not in affine}

    def fn(node):
        if not isinstance(node, Index):
            return None
        syms = node.expr.free_symbols
        if not (syms & set(mapping)):
            return None
        if not (syms & set(general)):
            return Index(node.expr.xreplace(affine), node.dtype)
        partial = node.expr.xreplace(affine)
        out = sympy_to_expr(partial, general)
        return out if out.dtype == node.dtype else binary("mul", out, const(1, node.dtype))

    return transform(body, fn)
