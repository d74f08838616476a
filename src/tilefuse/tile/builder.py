"""Shared machinery for lowering kernel plans to tile IR.

`KernelBuilder` collects parameters (buffers with their strides, size symbols), emits
statements into the current block, and turns graph-IR expressions into tile values: every
shared subexpression becomes one `Let`, loads become masked `LoadTile`s at strided offsets,
and loads under an unselected `where` branch are masked by that branch's condition (padding,
concatenation and gathers never read out of bounds). An index read from tensor data
(`CheckedIndex`) becomes a `Check` statement over its live elements, and the loads at it are
masked by its in-range condition as well. With `divisor_checks` (kernels for CPU tensors), the
divisor of an integer division or remainder gets a `Check` that it is non-zero wherever it is
live, unless its value range proves it (`ir.bounds.provably_nonzero`): a constant, a size.
"""
from __future__ import annotations

import sympy

from ..ir import dtypes as dt
from ..ir.bounds import ZERO_DIVISION, check_message, provably_nonzero
from ..ir.expr import (Binary, Cast, CheckedIndex, Const, Expr, Index, Load, Unary, Var, Where, binary, const, unary,
                       walk, walk_unique)
from ..ir.graph import Constant, Extern, ExternResult, Graph, Input
from ..ir.storage import promised_strides
from ..ir.symbolic import contiguous_strides, simplify_index
from .index_casts import per_axis_cast
from .ir import Arange, Check, LoadTile, Let, Param, StoreTile


def tile_symbol(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, integer=True, nonnegative=True)


def land(a: Expr | None, b: Expr | None) -> Expr | None:
    if a is None:
        return b
    if b is None:
        return a
    return binary("logical_and", a, b)


def known_strides(graph: Graph, name: str, node=None) -> tuple | None:
    """The strides a kernel addresses buffer `name` (graph node `node`, or a scratch buffer)
    with, dims of extent 1 as 0, when the compile knows them: an input's traced strides, a
    constant's, an ATen call's promised ones, the graph's chosen layout of its own buffers;
    None for the strides an input or an ATen call's result has only at run time."""
    node = graph[name] if node is None else node

    def unit_zero(strides):
        return tuple(sympy.Integer(0) if sympy.sympify(d) == 1 else st for d, st in zip(node.shape, strides))
    if isinstance(node, Input) and node.strides is not None:
        return unit_zero(node.strides)
    if isinstance(node, Constant):
        return unit_zero(tuple(sympy.Integer(st) for st in node.value.stride()))
    promised = promised_strides(node) if isinstance(node, (Extern, ExternResult)) else None
    if promised is not None:
        return promised
    if isinstance(node, (Input, Extern, ExternResult)):
        return None
    return unit_zero(graph.output_strides.get(name) or contiguous_strides(node.shape))


#: integer ops that divide by their second operand
_DIVISIONS = ("floordiv", "mod", "fmod")


class KernelBuilder:
    def __init__(self, graph: Graph, name: str, divisor_checks: bool = False):
        self.graph = graph
        self.name = name
        self.divisor_checks = divisor_checks
        self.params: dict[str, Param] = {}
        self.blocks: list[list] = [[]]
        self.memo: list[dict] = [{}]
        self.counter = 0
        self.reads: list[str] = []
        self.writes: list[str] = []
        self.bound: dict[str, Var] = {}  # node name -> in-register value (kernel members)
        self.tile_symbols: set[str] = set()
        self.index_ranges: dict = {}  # tile symbol -> extent, for index simplification
        #: `(offset) -> offset`: applied to every load's and store's simplified offset (a
        #: reduction walked in aligned runs, `reduction_runs`); None: none
        self.offset_rewrite = None
        #: tile coordinate -> the extent it is bound-checked against (`common.bound_check`) or
        #: the grid gives it: where a load's index stays in range, no `where` guards it
        self.coordinate_extents: dict = {}
        self.axes: dict = {}  # arange symbol -> the tile axis it runs along
        self.scratch: dict = {}  # name -> tile.ir.Scratch: temporaries outside the graph
        #: a 2-D tile's whole mask and the mask of each of its axes (`restrict_masks`)
        self.tile_mask: Expr | None = None
        self.axis_masks: dict[str, Expr | None] = {}
        self._positional: dict = {}  # expression -> whether it reads positions (`_on_positions`)

    def restrict_masks(self, tile_mask: Expr | None, axis_masks: dict) -> None:
        """Loads and checks under `tile_mask` are masked only by the axes their value depends on
        (`axis_masks`: tile symbol name -> that axis's bound mask or None): a value per row of a
        [rows, columns] tile is then loaded and checked once per row, as a [rows, 1] tile."""
        self.tile_mask, self.axis_masks = tile_mask, dict(axis_masks)

    def _mask_for(self, mask: Expr | None, e: Expr) -> Expr | None:
        if mask is None or mask is not self.tile_mask or not self.axis_masks:
            return mask
        used = set()
        for n in walk(e):
            if isinstance(n, Index):
                used |= {str(x) for x in sympy.sympify(n.expr).free_symbols}
            elif isinstance(n, Load):
                used |= {str(x) for c in n.index if isinstance(c, Index) for x in sympy.sympify(c.expr).free_symbols}
        if not used <= set(self.axis_masks) | self._size_names(used) or set(self.axis_masks) <= used:
            return mask  # (an index over some other tile symbol, or over every axis: the whole mask)
        restricted = None
        for name, axis_mask in self.axis_masks.items():
            if name in used:
                restricted = land(restricted, axis_mask)
        return restricted

    def _size_names(self, names: set) -> set:
        return {n for n in names if not self._is_tile_symbol(n)}

    # ------------------------------------------------------------------ statements
    @property
    def body(self) -> list:
        return self.blocks[0]

    def fresh(self, prefix: str = "tmp") -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def emit(self, stmt) -> None:
        if isinstance(stmt, Arange):
            self.axes[tile_symbol(stmt.name)] = stmt.axis
        self.blocks[-1].append(stmt)

    def push_block(self, block: list) -> None:
        self.blocks.append(block)
        self.memo.append(dict(self.memo[-1]))

    def pop_block(self) -> None:
        self.blocks.pop()
        self.memo.pop()

    def let(self, value: Expr, prefix: str = "tmp") -> Var:
        if isinstance(value, (Var, Const)):
            return value
        name = self.fresh(prefix)
        self.emit(Let(name, value))
        return Var(name, value.dtype)

    # ------------------------------------------------------------------ parameters
    def size_params(self, expr) -> None:
        for s in sympy.sympify(expr).free_symbols:
            name = str(s)
            if name not in self.params and not self._is_tile_symbol(name):
                self.params[name] = Param(name, "size")

    def _is_tile_symbol(self, name: str) -> bool:
        return name in self.tile_symbols

    def buffer(self, name: str, write: bool = False) -> tuple:
        """Register a buffer parameter; returns its (symbolic) strides."""
        node = self.scratch[name] if name in self.scratch else self.graph[name]
        if name not in self.params:
            self.params[name] = Param(name, "buffer", node.dtype)
        seen = self.writes if write else self.reads
        if name not in seen:
            seen.append(name)
        strides = known_strides(self.graph, name, node)
        if strides is None:  # the run-time strides of an input or an ATen call's result
            strides = []
            for k, d in enumerate(node.shape):
                if sympy.sympify(d) == 1:
                    strides.append(sympy.Integer(0))
                else:
                    sname = f"{name}_stride{k}"
                    self.params.setdefault(sname, Param(sname, "size"))
                    strides.append(sympy.Symbol(sname, integer=True, nonnegative=True))
            return tuple(strides)
        for st in strides:
            self.size_params(st)
        return strides

    def finish_params(self) -> list[Param]:
        buffers = [p for p in self.params.values() if p.kind == "buffer"]
        sizes = sorted((p for p in self.params.values() if p.kind == "size"), key=lambda p: p.name)
        return buffers + sizes

    # ------------------------------------------------------------------ expressions
    def offset(self, name: str, index: tuple, write: bool = False, mask: Expr | None = None,
               guard: Expr | None = None) -> Expr:
        strides = self.buffer(name, write=write)
        if all(isinstance(c, Index) for c in index):
            off = sympy.Integer(0)
            for c, s in zip(index, strides):
                off += c.expr * s
            off = simplify_index(sympy.expand(off), self.index_ranges)
            if self.offset_rewrite is not None:
                off = self.offset_rewrite(off)
            self.size_params(off)
            return Index(off)
        off: Expr = Index(sympy.Integer(0))
        for c, s in zip(index, strides):
            if s == 0:
                if not isinstance(c, Index):
                    self.value(c, mask, guard)  # a dim of one element: its index is still checked
                continue
            comp = self.value(c, mask, guard) if not isinstance(c, Index) else Index(c.expr)
            if isinstance(c, Index):
                self.size_params(c.expr)
            self.size_params(s)
            off = binary("add", off, binary("mul", comp, Index(s)))
        return off

    def value(self, e: Expr, mask: Expr | None = None, guard: Expr | None = None) -> Expr:
        """Emit `e` and return a tile value (a Var, or a constant)."""
        key = (e, mask, guard)
        memo = self.memo[-1]
        if key in memo:
            return memo[key]
        out = self._value(e, mask, guard)
        memo[key] = out
        return out

    def _value(self, e: Expr, mask, guard) -> Expr:
        if isinstance(e, Const):
            return e
        if isinstance(e, Var):
            return e
        if isinstance(e, Index):
            self.size_params(e.expr)
            return self.let(e, "idx")
        if isinstance(e, Load):
            if e.buffer in self.bound:
                return self.bound[e.buffer]
            # a branch's guard masks only the loads that could read out of range without it:
            # one in range everywhere reads what the selection then drops (a row's statistic
            # stays a [rows, 1] load beside a gather that needs the branch's [rows, keys] mask)
            m = land(self._mask_for(mask, e), guard if guard is not None and not self._reads_in_range(e) else None)
            off = self.offset(e.buffer, e.index, mask=mask, guard=guard)
            for ok in self._in_range(e.index, mask, guard):  # an index outside its bound reads nothing
                m = land(m, ok)
            off_v = self.let(off, "off") if not isinstance(off, Index) else off
            name = self.fresh("ld")
            self.emit(LoadTile(name, e.buffer, off_v, m, e.dtype))
            return Var(name, e.dtype)
        if isinstance(e, Where):
            c = self.value(e.cond, mask, guard)
            not_c = self.let(unary("logical_not", c), "tmp")
            a = self.value(e.a, mask, land(guard, c) if self._needs_guard(e.a, e.cond) else guard)
            b = self.value(e.b, mask, land(guard, not_c) if self._needs_guard(e.b, e.cond) else guard)
            return self.let(Where(c, a, b, e.dtype))
        if isinstance(e, Cast) and (narrow := per_axis_cast(e, self.axes, self.coordinate_extents)) is not None:
            return self.value(narrow, mask, guard)  # converted per row and per column, then added
        if isinstance(e, (Unary, Binary, Cast)):
            kids = tuple(self.value(k, mask, guard) for k in e.children())
            if isinstance(e, Binary) and e.op in _DIVISIONS and self.divisor_checks and not e.dtype.is_float:
                self.check_divisor(e.b, kids[1], mask, guard)
            return self.let(e.rebuild(kids))
        if isinstance(e, CheckedIndex):
            return self.checked(e, mask, guard)
        raise TypeError(f"cannot lower {type(e).__name__} to tile IR")

    def _in_range(self, index: tuple, mask, guard) -> list:
        """The in-range conditions of the checked indices inside a load's index components."""
        found: list = []
        for c in index:
            if isinstance(c, Index):
                continue
            for n in walk(c):
                ok = self.memo[-1].get(("in-range", n, mask, guard)) if isinstance(n, CheckedIndex) else None
                if ok is not None and ok not in found:
                    found.append(ok)
        return found

    def checked(self, e: CheckedIndex, mask, guard) -> Expr:
        """The index value (wrapped when the op wraps negative indices), after a `Check` that
        it lies in [0, size) wherever it is live; its in-range condition masks the loads at it.
        The same index against the same bound is checked once, whichever op reads it (a RoPE
        table gather and a cache write at the same positions)."""
        if self._in_bounds(e) is not None:  # (a position, in range by its extent: nothing to check)
            return self.value(e.x, mask, guard)
        key = ("checked", e.x, sympy.sympify(e.size), e.wrap, mask, guard)
        done = self.memo[-1].get(key)
        if done is not None:
            v, ok = done
            self.memo[-1][("in-range", e, mask, guard)] = ok
            return v
        v = self.value(e.x, mask, guard)
        self.size_params(e.size)
        n = Index(sympy.sympify(e.size))
        if e.wrap:
            v = self.let(Where(binary("lt", v, const(0)), binary("add", v, n), v, dt.int64), "idx")
        ok = self.let(binary("logical_and", binary("ge", v, const(0)), binary("lt", v, n)), "inb")
        live = land(self._mask_for(mask, e.x), guard)
        cond = ok if live is None else self.let(binary("logical_or", ok, unary("logical_not", live)), "chk")
        self.emit(Check(cond, check_message(e, "{size}"), e.error, n))
        self.memo[-1][("in-range", e, mask, guard)] = ok
        self.memo[-1][key] = (v, ok)
        return v

    def check_divisor(self, divisor: Expr, value: Expr, mask, guard) -> None:
        """A `Check` that an integer divisor is non-zero wherever it is live (once per value),
        unless its value range proves it."""
        if provably_nonzero(divisor, self.index_ranges):
            return
        key = ("nonzero", value, mask, guard)
        if key in self.memo[-1]:
            return
        self.memo[-1][key] = True
        ok = self.let(binary("ne", value, Const(0, value.dtype)), "nz")
        live = land(mask, guard)
        cond = ok if live is None else self.let(binary("logical_or", ok, unary("logical_not", live)), "chk")
        self.emit(Check(cond, ZERO_DIVISION, ZERO_DIVISION))

    def store(self, name: str, index: tuple, value: Expr, mask: Expr | None) -> None:
        node = self.scratch[name] if name in self.scratch else self.graph[name]
        off = self.offset(name, index, write=True)
        v = value if value.dtype == node.dtype else self.let(Cast(value, node.dtype) if not node.dtype.is_bool
                                                              else binary("ne", value, Const(0, value.dtype)))
        self.emit(StoreTile(name, off, v, mask, node.dtype))


    def _needs_guard(self, branch: Expr, cond: Expr) -> bool:
        """Whether a branch's loads must be masked by the selection's condition: they may be
        out of range where the branch is not taken. A condition on positions can guard index
        arithmetic (`cat`: `where(i < 48, a[i], b[i - 48])`); one on data alone cannot, so an
        affine load under it reads in range everywhere its tile's bounds do — it is then loaded
        unmasked by the data (a value per row stays a [rows, 1] load, and one mask tile is read
        once, not once per branch). So does a load whose index is in range for every
        coordinate in its bounds (the backward's row statistics per key under a causal mask
        `where(j > i, 0, dS)`: a [1, keys] load, not one per score). Gathers keep the guard
        (their positions are data) unless their index is a position in range (`slopes[h]`).
        (A load under a selection on positions of its own inside the branch still needs this
        guard: `cat` of a padded tensor reads the pad's input in range only where the `cat`
        takes that branch.)"""
        loads = [n for n in walk_unique(branch) if isinstance(n, Load)]
        if not loads:
            return False
        if any(self._position_of(c) is None for n in loads for c in n.index):
            return True
        return self._on_positions(cond) and not all(self._reads_in_range(n) for n in loads)

    def _on_positions(self, x: Expr) -> bool:
        """Whether a condition reads positions (an index), not only data (a load's own index
        picks the datum: the datum is what is tested)."""
        memo = self._positional
        stack = [(x, False)]
        while stack:  # (post-order: a shared subexpression is decided once, before its users)
            n, expanded = stack.pop()
            if n in memo:
                continue
            if isinstance(n, (Index, Load)):
                memo[n] = isinstance(n, Index)
            elif expanded:
                memo[n] = any(memo[k] for k in n.children())
            else:
                stack.append((n, True))
                stack.extend((k, False) for k in n.children() if k not in memo)
        return memo[x]

    def _reads_in_range(self, load: Load) -> bool:
        """Whether every component of the load's index lies within its buffer's dim for every
        tile coordinate within its extent (`coordinate_extents`)."""
        from ..ir.symbolic import bounds

        if load.buffer in self.bound:
            return True  # (a value held in registers: nothing is read)
        if load.buffer not in self.graph.nodes:
            return False
        shape = self.graph[load.buffer].shape
        if len(shape) != len(load.index):
            return False
        for comp, size in zip(load.index, shape):
            expr = self._position_of(comp)
            if expr is None or not expr.free_symbols <= set(self.coordinate_extents):
                return False
            lo, hi = bounds(expr, self.coordinate_extents)
            size = sympy.sympify(size)
            if not (size.is_Integer and lo >= 0 and hi < int(size)):
                return False
        return True

    def _position_of(self, comp: Expr) -> sympy.Expr | None:
        """A load's index component as an expression of positions: an affine index, or a gather's
        index that is a position provably in range (`slopes[h]` with `h` a head coordinate);
        None for an index read from data."""
        if isinstance(comp, Index):
            return sympy.sympify(comp.expr)
        if isinstance(comp, CheckedIndex):
            return self._in_bounds(comp)
        return None

    def _in_bounds(self, e: CheckedIndex) -> sympy.Expr | None:
        """The position a checked index is, where it is one and lies in [0, size) for every
        tile coordinate within its extent (no wrap, no check needed); else None."""
        from ..ir.symbolic import bounds

        if not isinstance(e.x, Index):
            return None
        expr, size = sympy.sympify(e.x.expr), sympy.sympify(e.size)
        if not size.is_Integer or not expr.free_symbols <= set(self.coordinate_extents):
            return None
        lo, hi = bounds(expr, self.coordinate_extents)
        return expr if lo >= 0 and hi < int(size) else None


__all__ = ["KernelBuilder", "known_strides", "tile_symbol", "land"]
