"""What a C++ kernel's values do across the lanes of a tile: which are the same in every lane
(*uniform*), and the strides of an offset that is affine in the lanes.

A gathered operand's address mixes both: a MoE's `w1[experts]` tile is read at
`idx * F·D + Mod(rn, F) * D + rk`, where `idx` was loaded at `floor(rn / F)`. With the
program's aranges starting at multiples of their blocks (`aligned_aranges`), `floor((B·q + t) / c)`
for a lane t in [0, B) and B dividing c is the same in every lane, and `Mod(B·q + t, c)` is
`Mod(B·q, c) + t`. The general rule used here: `floor(A + L)` is `floor(A)` when A's fractional
part is a multiple of 1/D (A a polynomial with integer coefficients over D) and every lane's
part L lies in [0, 1/D); `Mod(x, c)` is `x − c·floor(x / c)`. So `idx` is uniform, and the tile
is D-contiguous rows at a uniform base: a dot can read it where it lies (`dot.inplace_operands`).
"""
from __future__ import annotations

import sympy

from ...ir.expr import Binary, Cast, Const, Index, Var, transform, walk
from ...ir.symbolic import Floor, Mod
from ...tile.ir import (Arange, ArgReduceTile, Assign, BroadcastTile, DotTile, For, Full, Let, LoadTile, ProgramId,
                        ReduceTile, TileKernel, statements, stmt_exprs)


def aligned_aranges(kernel: TileKernel, sh) -> dict:
    """Aranges whose start is a multiple of their block: name -> (block, dim)."""
    out = {}
    for s in statements(kernel.body):
        if isinstance(s, Arange) and isinstance(s.start, Index) and s.name in sh.aranges:
            block = sh.block(s.block)
            start = sympy.sympify(s.start.expr)
            start = start.subs({x: sh.constexprs[x.name] for x in start.free_symbols if x.name in sh.constexprs})
            if block > 1 and sympy.fraction(sympy.cancel(start / block))[1] == 1:
                out[s.name] = (block, sh.aranges[s.name])
    return out


class Lanes:
    """`uniform`: the names of tile values equal in every lane; `strides(expr)`: (row, column)
    strides of an integer expression affine in the lanes, or None."""

    def __init__(self, kernel: TileKernel, sh, aligned: dict):
        self.sh = sh
        self.dim = {}  # lane symbol (one per arange) -> the tile dim it runs along
        self.extent = {}  # lane symbol -> its count
        self.moved = {}  # arange symbol name -> its value in terms of its lane
        for name, d in sh.aranges.items():
            ext = sh.shape[name][d]
            if ext <= 1:
                continue
            t = sympy.Dummy(f"t_{name}", integer=True, nonnegative=True)
            self.dim[t], self.extent[t] = d, ext
            if name in aligned:  # start = block · q for an integer q
                self.moved[name] = aligned[name][0] * sympy.Dummy(f"q_{name}", integer=True) + t
            else:
                self.moved[name] = sympy.Symbol(name, integer=True) + t
        self.lanes = frozenset(self.dim)
        self.uniform = self._uniform(kernel)
        assigned = {s.name for s in statements(kernel.body) if isinstance(s, Assign)}
        #: integer values named by a Let (an offset computed apart from its load)
        self.lets = {s.name: s.value for s in statements(kernel.body)
                     if isinstance(s, Let) and s.name not in assigned and sh.dtype.get(s.name) is not None
                     and sh.dtype[s.name].is_int}

    # ------------------------------------------------------------------ index expressions
    def index_strides(self, e) -> tuple | None:
        """(row, column) strides of a sympy index expression over the tile's aranges, or None
        when it is not affine in the lanes."""
        e = sympy.sympify(e)
        for x in e.free_symbols:  # (a tile value named in an index: uniform, or not known affine)
            shape = self.sh.shape.get(x.name)
            if x.name not in self.moved and shape is not None and shape != (1, 1) and x.name not in self.uniform:
                return None
        subs = {x: self.moved[x.name] for x in e.free_symbols if x.name in self.moved}
        if not subs:
            return (sympy.Integer(0), sympy.Integer(0))
        e = self._resolve(e.xreplace(subs))
        if e is None:
            return None
        e = sympy.expand(e)
        st = [sympy.Integer(0), sympy.Integer(0)]
        for t in e.free_symbols & self.lanes:
            st[self.dim[t]] += sympy.diff(e, t)
        if (st[0].free_symbols | st[1].free_symbols) & self.lanes:
            return None
        return st[0], st[1]

    def _resolve(self, e):
        """`e` with every floor and Mod whose lane part the rule allows resolved; None if one
        cannot be (or a Min, Max, ceiling or power mixes lanes in)."""
        if not (e.free_symbols & self.lanes):
            return e
        if e.is_Symbol:
            return e
        if e.is_Add or e.is_Mul:
            args = [self._resolve(a) for a in e.args]
            return None if any(a is None for a in args) else e.func(*args)
        if isinstance(e, sympy.floor):
            arg = self._resolve(e.args[0])
            split = None if arg is None else self._split(arg, 1)
            return None if split is None else Floor(split[0])
        if isinstance(e, sympy.Mod):
            x, c = e.args
            if not (c.is_Integer and int(c) > 0):
                return None
            x = self._resolve(x)
            split = None if x is None else self._split(x, c)
            return None if split is None else Mod(split[0], c) + split[1]
        return None

    def _split(self, x, c):
        """(A, L) with x = A + L, L the lanes' part, when floor(x / c) = floor(A / c)."""
        lanes, rest = [], []
        for term in sympy.Add.make_args(sympy.expand(x)):
            (lanes if term.free_symbols & self.lanes else rest).append(term)
        a, low, high = sympy.Add(*rest), sympy.Integer(0), sympy.Integer(0)
        for term in lanes:
            coeff, t = term.as_coeff_Mul()
            if t not in self.extent or not coeff.is_Rational:
                return None
            span = coeff * (self.extent[t] - 1)
            low, high = low + min(span, 0), high + max(span, 0)
        num, den = sympy.fraction(sympy.together(a / c))
        if not den.is_Integer or int(den) <= 0:
            return None
        for term in sympy.Add.make_args(sympy.expand(num)):
            if not term.as_coeff_Mul()[0].is_Integer:
                return None
        if low < 0 or high / c >= sympy.Rational(1, int(den)):
            return None
        return a, sympy.Add(*lanes)

    # ------------------------------------------------------------------ tile expressions
    def strides(self, e) -> tuple | None:
        """(row, column) strides of an integer tile expression: index arithmetic, uniform
        values, sums and products by constants; None otherwise."""
        zero = (sympy.Integer(0), sympy.Integer(0))
        if isinstance(e, Index):
            return self.index_strides(e.expr)
        if isinstance(e, Const):
            return zero if isinstance(e.value, (int, bool)) else None
        if isinstance(e, Var):
            if e.name in self.uniform:
                return zero
            return self.strides(self.lets[e.name]) if e.name in self.lets else None
        if isinstance(e, Cast):
            return self.strides(e.x) if e.dtype.is_int else None
        if isinstance(e, Binary) and e.op in ("add", "sub", "mul"):
            a, b = self.strides(e.a), self.strides(e.b)
            if a is None or b is None:
                return None
            if e.op == "add":
                return (a[0] + b[0], a[1] + b[1])
            if e.op == "sub":
                return (a[0] - b[0], a[1] - b[1])
            for x, sx, y in ((e.a, a, b), (e.b, b, a)):
                c = _constant(x)
                if c is not None:
                    return (c * y[0], c * y[1])
            return zero if a == zero and b == zero else None
        return zero if self.lane_free(e) else None

    def inline(self, e):
        """`e` with the lane-dependent integer values it names (`lets`) spelt out: an offset a
        dot reads in place is printed once, at the tile's first element, not kept per lane."""
        def spell(n):
            if isinstance(n, Var) and n.name in self.lets and n.name not in self.uniform:
                return self.inline(self.lets[n.name])
            return None
        return transform(e, spell)

    def lane_free(self, e) -> bool:
        """Every lane of `e` has the same value."""
        for n in walk(e):
            if isinstance(n, Var) and n.name not in self.uniform:
                return False
            if isinstance(n, Index) and self.index_strides(n.expr) != (0, 0):
                return False
        return True

    def _uniform(self, kernel) -> set:
        out = set()
        self.uniform = out
        # a name assigned or accumulated (in a loop, from lanes' values) is never uniform, nor
        # anything computed from it
        varying = {s.name for s in statements(kernel.body) if isinstance(s, (Assign, DotTile, ReduceTile, ArgReduceTile))}
        for s in statements(kernel.body):
            if isinstance(s, ProgramId):
                out.add(s.name)
            elif isinstance(s, Arange) and s.name not in self.moved:
                out.add(s.name)
            elif isinstance(s, (Let, LoadTile, BroadcastTile, Full)):
                if s.name not in varying and all(e is None or self.lane_free(e) for e in stmt_exprs(s)):
                    out.add(s.name)
            elif isinstance(s, For):
                out.add(s.var)
        return out


def _constant(e):
    if isinstance(e, Const) and isinstance(e.value, int) and not isinstance(e.value, bool):
        return sympy.Integer(e.value)
    if isinstance(e, Index) and sympy.sympify(e.expr).is_Integer:
        return sympy.sympify(e.expr)
    return None
