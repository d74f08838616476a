"""Index substitution: rename or replace index symbols inside expressions.

Inlining a producer into a consumer substitutes the producer's index symbols (`i0, i1, ..`)
with the consumer's index expressions. These are usually affine (`Index`) and stay in sympy;
for gathers they are arbitrary integer expressions, in which case the affected index leaf is
rebuilt as an expression tree.
"""
from __future__ import annotations

import sympy

from . import dtypes as dt
from .expr import Expr, Index, binary, const, transform


def sympy_to_expr(e: sympy.Expr, mapping: dict) -> Expr:
    """Turn an integer sympy expression into an expression tree, replacing symbols in
    `mapping` by their expressions."""
    e = sympy.sympify(e)
    if e.is_Symbol:
        return mapping.get(e, Index(e))
    if e.is_Integer:
        return const(int(e), dt.int64)
    if not (e.free_symbols & set(mapping)):
        return Index(e)
    if e.is_Add:
        out = sympy_to_expr(e.args[0], mapping)
        for a in e.args[1:]:
            out = binary("add", out, sympy_to_expr(a, mapping))
        return out
    if e.is_Mul:
        out = sympy_to_expr(e.args[0], mapping)
        for a in e.args[1:]:
            out = binary("mul", out, sympy_to_expr(a, mapping))
        return out
    if isinstance(e, sympy.floor):
        num, den = e.args[0].as_numer_denom()
        return binary("floordiv", sympy_to_expr(num, mapping), sympy_to_expr(den, mapping))
    if isinstance(e, sympy.Mod):
        return binary("mod", sympy_to_expr(e.args[0], mapping), sympy_to_expr(e.args[1], mapping))
    raise NotImplementedError(f"cannot rebuild index expression {e}")


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
