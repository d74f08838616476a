"""Shapes and types of the tile values of a kernel, for the C++ printer.

Tile IR values broadcast like NumPy arrays of at most two dims whose extents are block sizes
(constexprs, known when the kernel is printed). Here every value gets a concrete shape
`(d0, d1)` (a 1-D kernel's tiles are `(1, n)`: the contiguous axis is always the inner one)
and its dtype, found in one walk over the statements; read-only once built. Also the strides
of an affine offset over the tile's dims, and what a statement reads, defines and writes.
"""
from __future__ import annotations

from types import MappingProxyType

import sympy

from ...ir import dtypes as dt
from ...ir.expr import Expr, Index, Var, walk
from ...tile.ir import (Arange, ArgReduceTile, Assign, BroadcastTile, Check, DotTile, For, Full, Let, LoadTile,
                        ProgramId, ReduceTile, StoreTile, TileKernel, expr_names, stmt_exprs)
from .exprs import CppUnsupported

SCALAR = (1, 1)


def broadcast(*shapes) -> tuple:
    d0 = max((s[0] for s in shapes), default=1)
    d1 = max((s[1] for s in shapes), default=1)
    for s in shapes:
        if s[0] not in (1, d0) or s[1] not in (1, d1):
            raise CppUnsupported(f"shapes {shapes} do not broadcast")
    return (d0, d1)


class Shapes:
    """`shape[name]`, `dtype[name]`, `aranges[name] -> dim` for every value of a kernel."""

    def __init__(self, kernel: TileKernel):
        self.kernel = kernel
        self.constexprs = dict(kernel.constexprs)
        self.ndim = 2 if any(isinstance(s, Arange) and s.ndim == 2 for s in _all(kernel.body)) or \
            any(isinstance(s, (Full, BroadcastTile)) and len(s.shape) == 2 for s in _all(kernel.body)) else 1
        self.shape: dict[str, tuple] = {}
        self.dtype: dict = {}
        self.aranges: dict[str, int] = {}
        self._walk(kernel.body)
        self.shape, self.dtype, self.aranges = (MappingProxyType(self.shape), MappingProxyType(self.dtype),
                                                MappingProxyType(self.aranges))

    # ------------------------------------------------------------------ helpers
    def dim(self, axis: int) -> int:
        """Tile axis → dim of the normalised (d0, d1) shape."""
        return 1 if self.ndim == 1 else axis

    def block(self, d) -> int:
        if isinstance(d, int):
            return d
        if isinstance(d, str) and d in self.constexprs:
            return int(self.constexprs[d])
        v = sympy.sympify(d).subs({sympy.Symbol(k): v for k, v in self.constexprs.items()})
        if not v.is_Integer:
            raise CppUnsupported(f"tile extent {d} is not a constant")
        return int(v)

    def tile_shape(self, shape) -> tuple:
        ext = [self.block(d) for d in shape]
        if len(ext) == 1:
            return (1, ext[0])
        if len(ext) == 2:
            return (ext[0], ext[1])
        raise CppUnsupported(f"tiles of rank {len(ext)}")

    def of_symbol(self, name: str) -> tuple:
        return self.shape.get(name, SCALAR)

    def of(self, e: Expr | None) -> tuple:
        if e is None:
            return SCALAR
        shapes = []
        for n in walk(e):
            if isinstance(n, Var):
                if n.name not in self.shape:
                    raise CppUnsupported(f"{n.name} is used before it is defined")
                shapes.append(self.shape[n.name])
            elif isinstance(n, Index):
                shapes.extend(self.of_symbol(s.name) for s in sympy.sympify(n.expr).free_symbols)
        return broadcast(*shapes) if shapes else SCALAR

    def strides(self, offset):
        """(row stride, column stride) of an affine `Index` offset over the tile's aranges
        (sympy, free of tile symbols), or None."""
        if not isinstance(offset, Index):
            return None
        e = sympy.sympify(offset.expr)
        if e.has(sympy.floor, sympy.Mod, sympy.ceiling, sympy.Min, sympy.Max):
            return None
        ti, tj = sympy.Dummy("ti"), sympy.Dummy("tj")
        moved = {}
        for sym in e.free_symbols:
            d = self.aranges.get(sym.name)
            if d is not None and self.shape[sym.name][d] > 1:
                moved[sym] = sym + (ti if d == 0 else tj)
        e = sympy.expand(e.subs(moved))
        si, sj = sympy.diff(e, ti), sympy.diff(e, tj)
        tile = set(moved) | {ti, tj}
        if (si.free_symbols | sj.free_symbols) & tile:
            return None
        return si, sj

    def _define(self, name: str, shape: tuple, dtype) -> None:
        old = self.shape.get(name)
        if old is not None and (old != shape or self.dtype[name] != dtype):
            raise CppUnsupported(f"{name} is defined twice with different shapes or types")
        self.shape[name], self.dtype[name] = shape, dtype

    # ------------------------------------------------------------------ the walk
    def loop_shape(self, s) -> tuple:
        """The iteration space of an elementwise statement (or of a reduction's input)."""
        if isinstance(s, Let):
            return self.of(s.value)
        if isinstance(s, LoadTile):
            return broadcast(self.of(s.offset), self.of(s.mask))
        if isinstance(s, StoreTile):
            return broadcast(self.of(s.offset), self.of(s.value), self.of(s.mask))
        if isinstance(s, BroadcastTile):
            return broadcast(self.tile_shape(s.shape), self.of(s.value))
        if isinstance(s, Full):
            return self.tile_shape(s.shape)
        if isinstance(s, Assign):
            return self.shape[s.name]
        if isinstance(s, ReduceTile):
            return self.of(s.value)
        if isinstance(s, ArgReduceTile):
            return broadcast(self.of(s.value), self.of(s.index))
        if isinstance(s, Check):
            return self.of(s.ok)
        raise TypeError(type(s).__name__)

    def _walk(self, stmts) -> None:
        for s in stmts:
            if isinstance(s, ProgramId):
                self._define(s.name, SCALAR, dt.int64)
            elif isinstance(s, Arange):
                ext = self.block(s.block)
                shape = (1, ext) if self.dim(s.axis) == 1 else (ext, 1)
                self._define(s.name, shape, dt.int64)
                self.aranges[s.name] = self.dim(s.axis)
            elif isinstance(s, (Let, LoadTile, BroadcastTile, Full)):
                dtype = s.value.dtype if isinstance(s, (Let, BroadcastTile)) else s.dtype
                self._define(s.name, self.loop_shape(s), dtype)
            elif isinstance(s, ReduceTile):
                shape = list(self.loop_shape(s))
                shape[self.dim(s.axis)] = 1
                self._define(s.name, tuple(shape), s.dtype)
            elif isinstance(s, ArgReduceTile):
                shape = list(self.loop_shape(s))
                shape[self.dim(s.axis)] = 1
                self._define(s.name, tuple(shape), dt.int64)
            elif isinstance(s, DotTile):
                a, b = self.of(s.a), self.of(s.b)
                self._define(s.name, broadcast((a[0], b[1]), self.of(s.acc)), s.acc.dtype)
            elif isinstance(s, Assign):
                if s.name not in self.shape:
                    raise CppUnsupported(f"{s.name} is assigned before it is defined")
                broadcast(self.shape[s.name], self.of(s.value))
            elif isinstance(s, For):
                self._define(s.var, SCALAR, dt.int64)
                self._walk(s.body)
            elif isinstance(s, StoreTile):
                self.loop_shape(s)


def _all(stmts):
    for s in stmts:
        yield s
        if isinstance(s, For):
            yield from _all(s.body)


def reads(s) -> set[str]:
    """Names (tile values and index symbols) a statement reads, nested blocks included."""
    if isinstance(s, For):
        out = set()
        for e in (s.start, s.stop):
            out |= expr_names(e)
        for t in s.body:
            out |= reads(t)
        return out
    exprs = stmt_exprs(s)
    out = set()
    for e in exprs:
        if e is not None:
            out |= expr_names(e)
    if isinstance(s, Assign):
        out.add(s.name)
    return out


def defines(s) -> str | None:
    if isinstance(s, (ProgramId, Arange, Let, LoadTile, BroadcastTile, Full, ReduceTile, ArgReduceTile, DotTile)):
        return s.name
    return None


def written(s) -> set[str]:
    """Names a statement (or a loop, through its body) defines or assigns."""
    if isinstance(s, For):
        out = {s.var}
        for t in s.body:
            out |= written(t)
        return out
    name = defines(s)
    out = {name} if name is not None else set()
    if isinstance(s, Assign):
        out.add(s.name)
    return out
