"""What an FX tensor value lowers to: a buffer, or a view of one given by an index map.

Lowerings never materialise views. A `ViewValue` composes its index map into every load, so
`x.t().reshape(...)[..., 1:]` costs nothing until a consumer reads it. Index maps work on
index *expressions* (`Index` leaves for affine indices, arbitrary expressions for gathers);
the `ix_*` helpers keep the common affine case in sympy, where it simplifies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import sympy

from ..ir import dtypes as dt
from ..ir.dtypes import DType
from ..ir.expr import Expr, Index, Load, binary, cast
from ..ir.symbolic import floordiv, mod

IndexTuple = tuple  # tuple[Expr, ...]


class TensorValue:
    dtype: DType
    shape: tuple

    @property
    def rank(self) -> int:
        return len(self.shape)

    def load(self, index: IndexTuple) -> Expr:
        raise NotImplementedError

    def numel(self) -> sympy.Expr:
        return sympy.Mul(*self.shape) if self.shape else sympy.Integer(1)


@dataclass
class BufferValue(TensorValue):
    """A node of the graph read with its own indices."""

    name: str
    dtype: DType
    shape: tuple

    def load(self, index):
        assert len(index) == len(self.shape), (self.name, index, self.shape)
        return Load(self.name, tuple(index), self.dtype)


@dataclass
class ViewValue(TensorValue):
    """`base` seen through `index_map`: view[idx] = base[index_map(idx)]."""

    base: TensorValue
    shape: tuple
    index_map: Callable[[IndexTuple], IndexTuple]
    what: str = "view"

    @property
    def dtype(self):
        return self.base.dtype

    def load(self, index):
        assert len(index) == len(self.shape), (self.what, index, self.shape)
        return self.base.load(tuple(self.index_map(tuple(index))))


# ---------------------------------------------------------------- index arithmetic on Exprs


def _sym(e):
    return e.expr if isinstance(e, Index) and e.dtype.is_int else None


def ix(value) -> Expr:
    """Coerce an int / sympy expression / Expr into an integer index expression."""
    if isinstance(value, Expr):
        return value if value.dtype == dt.int64 else cast(value, dt.int64)
    return Index(sympy.sympify(value))


def ix_add(a, b) -> Expr:
    a, b = ix(a), ix(b)
    sa, sb = _sym(a), _sym(b)
    if sa is not None and sb is not None:
        return Index(sa + sb)
    return binary("add", a, b)


def ix_mul(a, b) -> Expr:
    a, b = ix(a), ix(b)
    sa, sb = _sym(a), _sym(b)
    if sa is not None and sb is not None:
        return Index(sa * sb)
    return binary("mul", a, b)


def ix_floordiv(a, b) -> Expr:
    a, b = ix(a), ix(b)
    sa, sb = _sym(a), _sym(b)
    if sa is not None and sb is not None:
        return Index(floordiv(sa, sb))
    return binary("floordiv", a, b)


def ix_mod(a, b) -> Expr:
    a, b = ix(a), ix(b)
    sa, sb = _sym(a), _sym(b)
    if sa is not None and sb is not None:
        return Index(mod(sa, sb))
    return binary("mod", a, b)


def ravel(index: IndexTuple, shape: tuple) -> Expr:
    """Row-major linear index of `index` in `shape`."""
    flat = ix(0)
    for i, n in zip(index, shape):
        flat = ix_add(ix_mul(flat, n), i)
    return flat


def unravel(flat: Expr, shape: tuple) -> IndexTuple:
    """Inverse of `ravel`."""
    out = []
    for k in range(len(shape) - 1, -1, -1):
        n = shape[k]
        if k == 0:
            out.append(flat)
        else:
            out.append(ix_mod(flat, n))
            flat = ix_floordiv(flat, n)
    return tuple(reversed(out))
