"""Whether a tile kernel's index arithmetic fits 32-bit integers (`fits_int32`), and the kernel
with 32-bit program ids when it does (`narrowed`).

A program id cast to 64 bits makes every offset computed from it 64-bit: twice the registers
for each address a program holds (a flash kernel holds tens per thread for its K and V tiles)
and more instructions per address. The lowerings decide the width from the problem's extents
before the kernel exists, and must be cautious there (a flash kernel's rule multiplies rows,
keys, head dim and batch). Here the finished kernel is bounded instead: with every program id,
range and loop variable at its largest — masked lanes past the last row or key included — the
magnitude of every integer its index arithmetic forms (each `Index` leaf, each partial sum and
product inside it, each integer operation on such values) must stay below 2**31. A size symbol
(a dynamic shape), an integer read from memory in arithmetic, counter-based random numbers, or
arithmetic it cannot bound keeps the kernel as it is.
"""
from __future__ import annotations

import math
from dataclasses import replace

import sympy

from ..ir.expr import Binary, Cast, Const, Expr, Index, Unary, Var, Where, walk_unique
from .common import tile_symbol
from .ir import Arange, Assign, For, Let, ProgramId, TileKernel, statements, stmt_exprs

LIMIT = 2 ** 31
_INF = math.inf
_ARITHMETIC = {"add", "sub", "mul", "floordiv", "mod", "fmod", "maximum", "minimum", "lshift"}


def narrowed(kernel: TileKernel) -> TileKernel:
    """`kernel` with 32-bit program ids where its index arithmetic provably fits them."""
    if not any(isinstance(s, ProgramId) and s.wide for s in kernel.body) or not fits_int32(kernel):
        return kernel
    return replace(kernel, body=[replace(s, wide=False) if isinstance(s, ProgramId) else s for s in kernel.body])


def fits_int32(kernel: TileKernel) -> bool:
    """Every integer the kernel's index arithmetic forms has a magnitude below 2**31."""
    blocks = {tile_symbol(k): sympy.Integer(v) for k, v in kernel.constexprs.items()}
    grid = []
    for g in kernel.grid:
        value = sympy.sympify(g).xreplace(blocks)
        if not value.is_number:
            return False
        grid.append(int(value))
    if math.prod(grid) >= LIMIT:  # (a grouped launch order flattens the grid's program ids)
        return False
    bound = _Bounds(blocks)
    for s in statements(kernel.body):
        for e in stmt_exprs(s):
            if not bound.fits(e):
                return False
        if isinstance(s, ProgramId):
            bound.extent[s.name] = grid[s.axis] if s.axis < len(grid) else _INF
        elif isinstance(s, Arange):
            bound.extent[s.name] = bound.expr(s.start) + kernel.constexprs.get(s.block, _INF)
        elif isinstance(s, For):
            bound.extent[s.var] = max(bound.expr(s.start) + 1, bound.expr(s.stop))
        elif isinstance(s, Let) and s.value.dtype.is_int:
            bound.value[s.name] = bound.expr(s.value)
        elif isinstance(s, Assign):
            bound.value[s.name] = _INF  # (a carried integer grows with the loop: unbounded here)
    return True


class _Bounds:
    """Magnitude bounds: `extent[name]` bounds a tile symbol's values (0 <= v < extent),
    `value[name]` an integer tile value's magnitude; `peak`, the largest magnitude any
    intermediate result reached since it was last reset."""

    def __init__(self, blocks: dict):
        self.blocks = blocks
        self.extent: dict = {}
        self.value: dict = {}
        self.peak = 0

    def fits(self, e: Expr) -> bool:
        for node in walk_unique(e):
            if isinstance(node, Binary) and node.op == "rand":
                return False  # (random numbers keep the counters' width the kernel was written with)
            if isinstance(node, Index) or (isinstance(node, (Binary, Unary)) and node.dtype.is_int):
                self.peak = 0
                if max(self.expr(node), self.peak) >= LIMIT:
                    return False
        return True

    def expr(self, e: Expr) -> float:
        """An upper bound of |e| (and `peak` raised to what its evaluation forms on the way)."""
        out = self._expr(e)
        self.peak = max(self.peak, out)
        return out

    def _expr(self, e: Expr) -> float:
        if isinstance(e, Index):
            return self.sym(sympy.sympify(e.expr).xreplace(self.blocks))
        if isinstance(e, Const):
            return abs(e.value) if isinstance(e.value, (int, float)) else _INF
        if isinstance(e, Var):
            return self.value.get(e.name, _INF)
        if isinstance(e, Cast) and e.dtype.is_int and (e.x.dtype.is_int or e.x.dtype.is_bool):
            return self.expr(e.x)
        if isinstance(e, Where):
            return max(self.expr(e.a), self.expr(e.b))
        if isinstance(e, Unary) and e.op in ("neg", "abs"):
            return self.expr(e.x)
        if isinstance(e, Binary) and e.op in _ARITHMETIC:
            a, b = self.expr(e.a), self.expr(e.b)
            if e.op == "mul":
                return a * b
            if e.op == "lshift":
                return a * 2 ** b if b < 64 else _INF
            return a + b if e.op in ("add", "sub") else max(a, b)
        if e.dtype.is_bool:
            return 1
        return _INF

    def sym(self, e) -> float:
        """The same for a sympy integer expression over tile and block symbols, as the Triton
        printer (`backends/triton/indexing.py`) writes it: a quotient's numerator over the
        common denominator, products left to right."""
        out = self._sym(e)
        self.peak = max(self.peak, out)
        return out

    def _sym(self, e) -> float:
        if e.is_Integer:
            return abs(int(e))
        if e.is_Rational:
            return abs(int(e.p)) / int(e.q)
        if e.is_Symbol:
            return max(self.extent.get(e.name, _INF) - 1, 0)
        if e.is_Add:
            return sum(self.sym(a) for a in e.args)
        if e.is_Mul:
            num, den = e.as_numer_denom()
            if den != 1:  # printed `num / den`
                return self._quotient(num, den)
            factors = [self.sym(a) for a in e.args]
            self.peak = max(self.peak, math.prod(max(1, f) for f in factors))  # (every prefix of the product)
            return math.prod(factors)
        if e.is_Pow and e.exp.is_Integer and int(e.exp) >= 0:
            base = self.sym(e.base)
            self.peak = max(self.peak, max(1, base) ** int(e.exp))
            return base ** int(e.exp)
        if isinstance(e, (sympy.floor, sympy.ceiling)):  # printed `num // den`, `tl.cdiv(num, den)`
            num, den = e.args[0].as_numer_denom()
            if isinstance(e, sympy.ceiling):
                self.peak = max(self.peak, self.sym(num) + self.sym(den))
            return self._quotient(num, den) + 1
        if isinstance(e, sympy.Mod):
            x, m = (self.sym(a) for a in e.args)
            return min(x, m)
        if isinstance(e, (sympy.Min, sympy.Max)):
            return max(self.sym(a) for a in e.args)
        return _INF

    def _quotient(self, num, den) -> float:
        """A bound of num / den, the numerator itself recorded (it is formed first)."""
        top, bottom = self.sym(num), self.sym(den)
        smallest = abs(int(den)) if den.is_Integer else 1
        return top / max(1, smallest) if bottom < _INF else _INF


__all__ = ["fits_int32", "narrowed", "LIMIT"]
