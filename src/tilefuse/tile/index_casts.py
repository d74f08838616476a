"""Conversions of index arithmetic to floating point, done per axis before broadcasting.

A score tile's bias often comes from positions: ALiBi's `slope · float(j − i)`, a relative
distance, a position ratio. Computed as written, the integer `j − i` is formed for every element
of the [rows, keys] tile and then converted, one int→float conversion per element (a quarter- to
an eighth-rate instruction on NVIDIA GPUs, where a fused multiply-add is full rate). When the
integer is a sum of parts that each vary along fewer axes (`j` per key, `−i` per row) and every
value involved is an integer the float type holds exactly, `float(j − i) = float(j) + float(−i)`
exactly: the conversions then run once per row and once per key, and each element pays one
float addition.
"""
from __future__ import annotations

import sympy

from ..ir import dtypes as dt
from ..ir.expr import Binary, Cast, Const, Expr, Index, Unary, binary
from ..ir.symbolic import bounds

#: integers of magnitude below 2**bits convert exactly; one bit is left for the sums of parts
#: and for padded lanes past a bound (their values are masked, but must stay finite and exact)
_EXACT_BITS = {dt.float32: 23, dt.float64: 52}


def as_affine(e: Expr):
    """The sympy form of an integer expression built from indices and integer constants by
    additions, subtractions, negations and products; None for anything else (a load, a division)."""
    if isinstance(e, Index):
        return sympy.sympify(e.expr)
    if isinstance(e, Const):
        if e.dtype.is_float or e.dtype == dt.bool_ or e.value in ("nan", "inf", "-inf"):
            return None
        return sympy.Integer(int(e.value))
    if isinstance(e, Unary) and e.op == "neg":
        x = as_affine(e.x)
        return None if x is None else -x
    if isinstance(e, Binary) and e.op in ("add", "sub", "mul") and not e.dtype.is_float:
        a, b = as_affine(e.a), as_affine(e.b)
        if a is None or b is None:
            return None
        return a + b if e.op == "add" else a - b if e.op == "sub" else a * b
    return None


def per_axis_cast(e: Cast, axes: dict, extents: dict) -> Expr | None:
    """`e`, an int→float conversion, as a float sum of conversions of parts that each vary
    along a strict subset of the tile's axes (`axes`: tile symbol → its axis), when that is
    exact for every coordinate within `extents`; None when it is not, or would save nothing."""
    bits = _EXACT_BITS.get(e.dtype)
    if bits is None or e.x.dtype.is_float or e.x.dtype == dt.bool_:
        return None
    form = as_affine(e.x)
    if form is None:
        return None
    groups: dict[frozenset, sympy.Expr] = {}
    for term in sympy.Add.make_args(sympy.expand(form)):
        key = frozenset(axes[s] for s in term.free_symbols if s in axes)
        groups[key] = groups.get(key, sympy.Integer(0)) + term
    spanned = frozenset().union(*groups)
    vector = [k for k in groups if k]
    if len(vector) < 2 or any(k == spanned for k in vector):
        return None  # (one axis, or a part as wide as the whole: nothing gets narrower)
    scalar = groups.pop(frozenset(), None)
    if scalar is not None:  # a part with no axis joins the first narrow part
        groups[vector[0]] = groups[vector[0]] + scalar
    limit = 2 ** bits
    reach = 0
    for part in groups.values():
        lo, hi = bounds(part, extents)
        reach += max(abs(lo), abs(hi))
        if not reach < limit:  # (infinite when a symbol's extent is unknown or symbolic)
            return None
    out = None
    for key in sorted(groups, key=lambda k: sorted(k)):
        piece = Cast(Index(groups[key], e.x.dtype), e.dtype)
        out = piece if out is None else binary("add", out, piece)
    return out


__all__ = ["per_axis_cast", "as_affine"]
