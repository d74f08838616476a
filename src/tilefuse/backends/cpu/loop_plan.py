"""The loop-nest plan of a C++ kernel: every decision the C++ printer follows, made once.

`plan_kernel(kernel)` walks a tile kernel and returns a `LoopPlan`, an immutable value (frozen
dataclasses, read-only mappings): which consecutive statements share one loop nest (`Nest`:
its extents, which reductions run along rows in vector lanes and which down columns, whether
the inner loop may be `omp simd`), which values stay scalars of their nest and which need an
array, which cheap values a later nest recomputes (`remat.py`), which statements nothing
reads any more, which Kᵀ tiles are copied by register transposes before their nest, and for
each `dot` (`DotPlan`) its register block, its operands (read in place, an array, or a dense
copy), whether it starts from zero and whether it accumulates straight into carried state
(`dot.py`). The printer (`codegen.py`, `nests.py`) only spells that plan as C++.

Statements are the tile IR's own (mutable, unhashable) objects: the plan holds them, and the
few per-statement facts kept in maps (error codes of index checks) are keyed by `id`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping, Union

import sympy

from ...ir import dtypes as dt
from ...ir.expr import Index, Var
from ...tile.ir import (Arange, ArgReduceTile, Assign, BroadcastTile, Check, DotTile, For, Full, Let, LoadTile,
                        ReduceTile, StoreTile, TileKernel, checks_of, expr_names, statements)
from .dot import DotPlan, columns_first, fold_accumulator, inplace_operands, plan_dot, stmt_readers
from .lanes import Lanes, aligned_aranges
from .remat import plan_remat
from .shapes import SCALAR, Shapes, defines, reads

#: statements a loop nest can hold (one element of each per iteration)
ELEMENTWISE = (Let, LoadTile, StoreTile, BroadcastTile, Full, Assign, ReduceTile, ArgReduceTile, Check)
#: vector lanes of a reduction along rows
LANES = 16


# ---------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Step:
    """One statement of a nest's body. `role`: "value" (defines a scalar of the body; also
    written to its array when `stored`), "effect" (a store, an assignment or a check), "row" /
    "col" (a reduction along the row in lanes / down the column into per-column accumulators),
    "copy" (a reduction over a dim of one element)."""

    stmt: object
    role: str
    stored: bool = False


@dataclass(frozen=True)
class TransposedLoad:
    """An fp32 tile load copied before its nest by 16x16 register transposes (`tf_load_t`):
    the source is contiguous along the tile's rows, `col_stride` apart along its columns."""

    stmt: LoadTile
    col_stride: object  # sympy


@dataclass(frozen=True)
class Nest:
    """One loop nest over a `(rows, cols)` iteration space."""

    shape: tuple
    steps: tuple  # Step, in order
    remat: tuple  # statements recomputed at the top of the body (remat.py)
    transposed: tuple  # TransposedLoad, printed before the loops
    checks: tuple  # Check statements: one failure flag each
    row_reductions: tuple
    col_reductions: tuple
    lanes: int  # vector lanes of the row reductions (the row's extent when it is not a multiple of 16)
    simd: bool  # False when lanes store to one address (their order matters)
    #: the loop over rows is the inner, vectorised one: every load from memory is contiguous
    #: along the rows and strided along the columns (an operand tile read transposed through a
    #: gather, a MoE's `w1[experts]`), and nothing in the nest depends on the order
    rows_inner: bool = False
    #: loads the row's columns read strided, backwards or gathered, at least one of them masked
    #: (`_Planner.staged_loads`), and the statements their masks and offsets need, in order: a
    #: scalar pass over the columns loads them into lane arrays that the vectorised pass reads
    staged: tuple = ()
    staged_inputs: tuple = ()


@dataclass(frozen=True)
class Single:
    """A statement printed on its own (program ids, aranges, scalars, comments, checks)."""

    stmt: object


@dataclass(frozen=True)
class Loop:
    """A `For` over a planned body."""

    stmt: For
    body: tuple


Item = Union[Nest, Single, DotPlan, Loop]


@dataclass(frozen=True)
class LoopPlan:
    """Everything the printer of one kernel follows. `local`: values that never leave their
    nest (no array); `alias`: name -> the carried array written in its place; `arrays`: the
    names declared per program (scalars or arrays, in order); `arg_values`: the argmax/argmin
    statements whose results keep a value per column too; `check_ids`: id(Check) -> error code;
    `aligned`: aranges whose start is a multiple of their block, name -> (block, dim)."""

    kernel: TileKernel
    shapes: Shapes
    items: tuple
    local: frozenset
    alias: Mapping
    arrays: tuple
    arg_values: tuple
    check_ids: Mapping
    aligned: Mapping
    #: tiles stored by columns (element (i, j) at `j * rows + i`), name -> rows: the `b` of
    #: dots with few rows, written by a nest that reads memory along the rows (`dot.columns_first`)
    columns: Mapping = field(default_factory=lambda: MappingProxyType({}))


def plan_kernel(kernel: TileKernel) -> LoopPlan:
    return _Planner(kernel).plan()


# ---------------------------------------------------------------------------- planning
class _Group:
    """A nest being built: consecutive elementwise statements over one iteration space."""

    def __init__(self, shape):
        self.shape = shape
        self.stmts: list = []
        self.defined: set[str] = set()
        self.touched: set[str] = set()  # defined or assigned here
        self.reduced: set[str] = set()  # reduction results: final only after the loop


class _Planner:
    def __init__(self, kernel: TileKernel):
        self.kernel = kernel
        self.sh = Shapes(kernel)
        self.site: dict[int, object] = {}  # id(stmt) -> its group (or the statement itself)
        self.local: set[str] = set()
        self.zero_dot: set[int] = set()  # ids of dots whose accumulator starts at 0
        self.remat: dict = {}  # id(group) -> statements recomputed in its loop body
        self.readers: dict[str, set] = {}  # name -> ids of the sites that read it
        self.stmt_readers = stmt_readers(kernel.body)  # name -> statements that read it
        self.alias: dict[str, str] = {}  # R -> acc: `R = f(acc)` written into acc's array (dot.py)
        self.dot_into: dict[int, str] = {}  # id(dot) -> the carried array it accumulates into
        self.skip: set[int] = set()  # ids of `acc = R + X` statements those dots replace
        self.folded: set[str] = set()  # names X of those dots (never stored)
        self.aligned = aligned_aranges(kernel, self.sh)
        self.lanes = Lanes(kernel, self.sh, self.aligned)
        self.inplace = inplace_operands(kernel, self.sh, self.lanes, self.stmt_readers)
        # (dot kernels keep their order: the accumulator folds in `dot.py` match neighbours)
        self.hoist = not any(isinstance(st, DotTile) for st in statements(kernel.body))

    def plan(self) -> LoopPlan:
        k = self.kernel
        draft = self.group(k.body)
        self.remat = plan_remat(k, draft, self.sh, _Group)
        self.find_locals(draft)
        arrays, arg_values = self.declarations()
        items, columns = self.store_by_columns(self.freeze(draft))
        return LoopPlan(kernel=k, shapes=self.sh, items=items, local=frozenset(self.local), columns=columns,
                        alias=MappingProxyType(dict(self.alias)), arrays=arrays, arg_values=arg_values,
                        check_ids=MappingProxyType({id(c): n + 1 for n, c in enumerate(checks_of(k.body))}),
                        aligned=MappingProxyType(self.aligned))

    # ------------------------------------------------------------------ grouping
    def zero_starts(self, stmts) -> set:
        """ids of `X = full(0)` statements whose only use is as the accumulator of a following
        `X = dot(a, b) + X`: the dot starts its registers at 0 instead (no zero fill, no load)."""
        skip = set()
        for k, s in enumerate(stmts):
            if not (isinstance(s, DotTile) and isinstance(s.acc, Var) and s.acc.name == s.name):
                continue
            for j in range(k - 1, -1, -1):
                t = stmts[j]
                if isinstance(t, Full) and t.name == s.name:
                    if isinstance(t.value, (int, float)) and t.value == 0:
                        skip.add(id(t))
                        self.zero_dot.add(id(s))
                    break
                if isinstance(t, For) or s.name in reads(t) or defines(t) == s.name:
                    break
        return skip

    def group(self, stmts) -> list:
        """Split a block into nests being built, single statements and ("for", stmt, body)."""
        items: list = []
        group: _Group | None = None
        side: _Group | None = None  # values per row or per column, hoisted before the open group
        written: set[str] = set()  # buffers the open group stores to
        zero_fills = self.zero_starts(stmts)

        def flush():
            nonlocal group, side
            if group is not None:
                items.append(group)
                group = side = None
                written.clear()

        for k, s in enumerate(stmts):
            if id(s) in self.zero_dot:
                fold = fold_accumulator(stmts, k, self.stmt_readers, self.sh)
                if fold is not None:
                    j, a = fold
                    self.alias[stmts[j].name] = a.name
                    self.dot_into[id(s)] = a.name
                    self.skip.add(id(a))
                    self.folded.add(s.name)
        for s in stmts:
            if id(s) in zero_fills or id(s) in self.skip:
                continue
            if isinstance(s, For):
                flush()
                items.append(("for", s, self.group(s.body)))
                self.site[id(s)] = s
                continue
            if not isinstance(s, ELEMENTWISE):
                flush()
                items.append(s)
                self.site[id(s)] = s
                continue
            shape = self.sh.loop_shape(s)
            r = reads(s)
            if shape == SCALAR and not isinstance(s, (ReduceTile, ArgReduceTile)):
                if group is not None and isinstance(s, (Let, LoadTile, BroadcastTile)) and not (r & group.touched):
                    items.append(s)  # before the open group (appended when it is flushed)
                    self.site[id(s)] = s
                    side = None  # (a later hoisted value may read it: its nest comes after)
                    continue
                flush()
                items.append(s)
                self.site[id(s)] = s
                continue
            if self.hoist and group is not None and shape != group.shape and _hoistable(s, shape, group, written):
                # a per-column bias read after the row's first values: a nest of its own before
                # the open one, which then keeps its values in registers (no array between halves)
                if side is None or side.shape != shape:
                    side = _Group(shape)
                    items.append(side)
                side.stmts.append(s)
                self.site[id(s)] = side
                side.defined.add(s.name)
                side.touched.add(s.name)
                continue
            if group is not None and (group.shape != shape or r & group.reduced):
                flush()
            if group is None:
                group = _Group(shape)
            group.stmts.append(s)
            if isinstance(s, StoreTile):
                written.add(s.buffer)
            self.site[id(s)] = group
            name = defines(s)
            if name is not None:
                group.defined.add(name)
                group.touched.add(name)
                if isinstance(s, (ReduceTile, ArgReduceTile)):
                    group.reduced.add(name)
            if isinstance(s, Assign):
                group.touched.add(s.name)
        flush()
        return items

    def find_locals(self, items) -> None:
        """A value defined in a group and read only there (or recomputed where it is read)
        never needs an array."""
        readers = self.readers
        recomputed = {gid: {s.name for s in stmts} for gid, stmts in self.remat.items()}

        def visit(stmts):
            for s in stmts:
                site = id(self.site.get(id(s)))  # (zero fills a dot replaces have no site: they read nothing)
                skip = recomputed.get(site, set())
                names = reads(s) if not isinstance(s, For) else expr_names(s.start) | expr_names(s.stop)
                if isinstance(s, DotTile):  # an operand read in place: its address is printed here
                    names = names | set().union(*(_in_place_reads(self.inplace[n]) for n in names if n in self.inplace))
                for name in names:
                    if name not in skip:
                        readers.setdefault(name, set()).add(site)
                if isinstance(s, For):
                    visit(s.body)

        visit(self.kernel.body)
        for gid, stmts in self.remat.items():  # what the recomputations read
            for s in stmts:
                for name in reads(s) - recomputed[gid]:
                    readers.setdefault(name, set()).add(gid)
        for g in _groups(items):
            for s in g.stmts:
                name = defines(s)
                if name is None or name in g.reduced:
                    continue
                # (a tile read transposed stays an array: copied by register transposes before
                # its nest, `transposed_load`, where a scalar of the nest would gather it)
                if readers.get(name, set()) <= {id(g)} and self.transposed_load(s, g.shape) is None:
                    self.local.add(name)

    # ------------------------------------------------------------------ freezing
    def freeze(self, items) -> tuple:
        out = []
        for it in items:
            if isinstance(it, _Group):
                nest = self.nest(it)
                if nest is not None:
                    out.append(nest)
            elif isinstance(it, tuple):
                out.append(Loop(it[1], self.freeze(it[2])))
            elif isinstance(it, DotTile):
                out.append(self.dot(it))
            else:
                out.append(Single(it))
        return tuple(out)

    def nest(self, g: _Group) -> Nest | None:
        """The nest of a group, or None when every value it computes is recomputed where it
        is read (nothing to print)."""
        d0, d1 = g.shape
        reds = [s for s in g.stmts if isinstance(s, (ReduceTile, ArgReduceTile))]
        row_reds = [s for s in reds if self.sh.dim(s.axis) == 1 and d1 > 1]
        col_reds = [s for s in reds if self.sh.dim(s.axis) == 0 and d0 > 1]
        # lanes that store to one address (a [BLOCK_M, 1] tile stored at a row-only offset)
        # must keep their order: no `omp simd` on that loop
        inner = 1 if d1 > 1 else 0
        simd = all(self.sh.of(s.offset)[inner] == g.shape[inner] for s in g.stmts if isinstance(s, StoreTile))
        dead = {id(s) for s in self.dead(g)}
        if len(dead) == len(g.stmts):
            return None
        transposed = []
        for s in g.stmts:
            if id(s) not in dead:
                t = self.transposed_load(s, g.shape)
                if t is not None:
                    transposed.append(t)
        hoisted = {id(t.stmt) for t in transposed}
        steps = []
        for s in g.stmts:
            if id(s) in hoisted or id(s) in dead:
                continue
            if isinstance(s, (ReduceTile, ArgReduceTile)):
                role = "row" if any(s is r for r in row_reds) else "col" if any(s is r for r in col_reds) else "copy"
                steps.append(Step(s, role))
            elif defines(s) is not None:
                steps.append(Step(s, "value", stored=defines(s) not in self.local))
            else:
                steps.append(Step(s, "effect"))
        rows_inner = (simd and not reds and not transposed and d0 > 1 and d1 > 1
                      and self.rows_contiguous([s for s in g.stmts if id(s) not in dead]))
        remat = tuple(self.remat.get(id(g), ()))
        staged, inputs = self.staged_loads(remat, steps) if simd and d1 > 1 and not rows_inner else ((), ())
        return Nest(shape=g.shape, steps=tuple(steps), remat=remat,
                    transposed=tuple(transposed), checks=tuple(s for s in g.stmts if isinstance(s, Check)),
                    row_reductions=tuple(row_reds), col_reductions=tuple(col_reds),
                    lanes=(LANES if d1 % LANES == 0 else d1) if row_reds else d1, simd=simd,
                    rows_inner=rows_inner, staged=staged, staged_inputs=inputs)

    def staged_loads(self, remat: tuple, steps: list) -> tuple:
        """(loads, inputs): when one of the nest's masked loads reads an address that moves
        along the row by other than 0 or 1 element (a stride, a reversal, a gather), every load
        of the nest that does, with the statements of the nest their masks and offsets read
        (transitively), in order. GCC 12 vectorises no masked load but a contiguous one: one
        such load keeps the whole row loop scalar, and its selects and NaN-propagating maxima
        become branches (a 3×3 max-pool window over a padded input, stride 2: 3.7 ms where the
        vectorised loop takes 0.5). The unmasked ones go too, since GCC sinks a load under the
        selects that read it and then masks it. Loaded in a scalar pass of their own (index
        arithmetic beside them), they leave the row loop vectorisable. Nothing is staged in a
        nest that updates a carried value (an `Assign`) or stores to a buffer a staged load
        reads, when an input is a reduction, or when nothing else would be left."""
        if any(isinstance(st.stmt, Assign) for st in steps):
            return (), ()  # (a carried value the staged pass would read before its update)
        stored = {st.stmt.buffer for st in steps if isinstance(st.stmt, StoreTile)}
        loads, masked = [], False
        for st in steps:
            s = st.stmt
            if st.role == "value" and isinstance(s, LoadTile):
                strides = self.lanes.strides(s.offset)
                if strides is None or strides[1] not in (0, 1):
                    loads.append(s)
                    masked = masked or s.mask is not None
        if not masked or any(s.buffer in stored for s in loads):
            return (), ()  # (nor a load of what the row stores: the pass would read it first)
        defs = {defines(s): s for s in remat}
        for st in steps:
            name = defines(st.stmt)
            if name is not None:
                defs[name] = st.stmt
        need: set = set()
        todo = [n for s in loads for n in reads(s)]
        while todo:
            name = todo.pop()
            s = defs.get(name)
            if s is None or id(s) in need:
                continue
            need.add(id(s))
            todo.extend(reads(s))
        order = [s for s in remat] + [st.stmt for st in steps]
        staged_ids = {id(s) for s in loads}
        inputs = tuple(s for s in order if id(s) in need and id(s) not in staged_ids)
        roles = {id(st.stmt): st.role for st in steps}
        if any(isinstance(s, (ReduceTile, ArgReduceTile)) or roles.get(id(s), "value") != "value"
               for s in inputs):
            return (), ()
        if len(steps) <= len(loads) + len([s for s in inputs if id(s) in roles]):
            return (), ()
        return tuple(loads), inputs

    def rows_contiguous(self, stmts) -> bool:
        """Every load and store of memory in `stmts` either moves one element per tile row and
        some other amount (or an unknown one: a gathered index) per column, or reads one
        address for the whole tile (a gathered expert's index) or for each column (a row
        statistic read by a column tile); and at least one moves: the nest reads memory
        contiguously with rows innermost."""
        lets = {s.name: s.value for s in stmts if isinstance(s, Let)}
        accesses = [(s, self.sh.strides(s.offset)) for s in stmts if isinstance(s, (LoadTile, StoreTile))]
        for s, strides in accesses:  # a load of one address (its mask aside) is the same value on every row
            if isinstance(s, LoadTile) and strides == (0, 0):
                lets[s.name] = Index(sympy.Integer(0))
        moving = 0
        for s, strides in accesses:
            if strides == (0, 0):
                continue  # one address: the order does not matter
            step = self.row_stride(s.offset, lets)
            if step == 0 and isinstance(s, LoadTile):
                continue  # one value per column (a column tile's row statistic, mean[r]): a scalar of the inner loop
            if step != 1:
                return False
            if strides is not None and strides[1] == 1:
                return False  # contiguous along the columns as well: keep the usual order
            moving += 1
        return moving > 0

    def row_stride(self, e, lets: dict, depth: int = 0):
        """How far the address `e` moves per tile row: a sympy number, or None when it does not
        move by a fixed amount (a row-dependent gather, an index division)."""
        from ...ir.expr import Binary, Cast, Const, Where

        if depth > 32:
            return None
        if isinstance(e, Index):
            expr = sympy.sympify(e.expr)
            rows = {x for x in expr.free_symbols
                    if self.sh.aranges.get(x.name) == 0 and self.sh.shape.get(x.name, (1,))[0] > 1}
            if not rows:
                return sympy.Integer(0)
            for a in sympy.preorder_traversal(expr):
                if isinstance(a, (sympy.floor, sympy.Mod, sympy.ceiling, sympy.Min, sympy.Max)) and a.free_symbols & rows:
                    return None
            ti = sympy.Dummy("ti")
            d = sympy.diff(sympy.expand(expr.subs({r: r + ti for r in rows})), ti)
            return None if d.free_symbols else d
        if isinstance(e, Cast):
            return self.row_stride(e.x, lets, depth + 1)
        if isinstance(e, Where):  # (only the address matters: a lane masked off reads nothing)
            a, b = self.row_stride(e.a, lets, depth + 1), self.row_stride(e.b, lets, depth + 1)
            return a if a is not None and a == b else None
        if isinstance(e, Const):
            return sympy.Integer(0)
        if isinstance(e, Var):
            if e.name in lets:
                return self.row_stride(lets[e.name], lets, depth + 1)
            shape = self.sh.shape.get(e.name)
            return sympy.Integer(0) if shape is not None and shape[0] == 1 else None
        if isinstance(e, Binary) and e.op in ("add", "sub", "mul"):
            a, b = self.row_stride(e.a, lets, depth + 1), self.row_stride(e.b, lets, depth + 1)
            if a is None or b is None:
                return None
            if e.op == "add":
                return a + b
            if e.op == "sub":
                return a - b
            if a == 0 and b == 0:
                return sympy.Integer(0)
            # otherwise it moves by a fixed amount only when the other factor is a number
            for moving, factor in ((a, e.b), (b, e.a)):
                value = factor.value if isinstance(factor, Const) else sympy.sympify(factor.expr) \
                    if isinstance(factor, Index) else None
                if value is not None and sympy.sympify(value).is_number:
                    return moving * value
            return None
        return None

    def dead(self, g: _Group) -> list:
        """Statements of a group whose value nothing reads (every later reader recomputes it)."""
        live: set[str] = set()
        dead = []
        for s in reversed(g.stmts):
            name = defines(s)
            if name in self.inplace or isinstance(s, (Let, LoadTile, Full, BroadcastTile)) and name in self.local \
                    and name not in live and not (self.readers.get(name, set()) - {id(g)}):
                dead.append(s)
                continue
            live |= reads(s)
        return dead

    def transposed_load(self, s, shape) -> TransposedLoad | None:
        """An unmasked fp32 tile load kept in an array whose source is contiguous along the
        tile's rows (a Kᵀ tile read from K): copied by register transposes before the nest (the
        nest's inner loop would gather it one element at a time)."""
        d0, d1 = shape
        if not (isinstance(s, LoadTile) and s.mask is None and s.dtype == dt.float32 and s.name not in self.local
                and d0 % 16 == 0 and d1 % 16 == 0 and isinstance(s.offset, Index)
                and self.sh.shape.get(s.name) == shape):
            return None
        strides = self.sh.strides(s.offset)
        if strides is None or strides[0] != 1 or strides[1] == 1:
            return None
        return TransposedLoad(s, strides[1])

    def store_by_columns(self, items: tuple) -> tuple:
        """(items, columns): the dots whose `b` tile is better stored by columns
        (`dot.columns_first`) read it so, and the mapping of those tiles to their rows; and
        the carried accumulators that a nest walking rows innermost updates (a column tile's
        lanes: `acc[i, j] += x[r + j, i]`), stored by columns so that the update reads and
        writes them contiguously, as it reads memory."""
        rows_inner, dots, carried = {}, [], {}

        def visit(its):
            for it in its:
                if isinstance(it, Nest) and it.rows_inner:
                    for st in it.steps:
                        if st.role == "value" and st.stored:
                            rows_inner[defines(st.stmt)] = it.shape
                        elif isinstance(st.stmt, Assign) and it.shape[0] > 1 and it.shape[1] > 1 \
                                and self.sh.shape.get(st.stmt.name) == it.shape:
                            carried[self.alias.get(st.stmt.name, st.stmt.name)] = it.shape[0]
                elif isinstance(it, Loop):
                    visit(it.body)
                elif isinstance(it, DotPlan):
                    dots.append(it)

        visit(items)
        columns = columns_first(dots, rows_inner, self.stmt_readers, self.sh)
        # (a dot addresses its operands and accumulator itself, row-major)
        by_dots = set().union(*({d.out, d.stmt.name} | reads(d.stmt) for d in dots)) if dots else set()
        columns.update((name, rows) for name, rows in carried.items() if name not in by_dots)
        if not columns:
            return items, MappingProxyType({})

        def swap(its):
            out = []
            for it in its:
                if isinstance(it, Loop):
                    it = Loop(it.stmt, swap(it.body))
                elif isinstance(it, DotPlan) and it.b.kind == "array" and it.b.name in columns:
                    it = replace(it, b=replace(it.b, kind="array_t", ld=it.k))
                out.append(it)
            return tuple(out)

        return swap(items), MappingProxyType(columns)

    def dot(self, s: DotTile) -> DotPlan:
        zero = id(s) in self.zero_dot and id(s) not in self.dot_into
        return plan_dot(s, self.sh, self.local, self.inplace, zero=zero, out=self.dot_into.get(id(s), s.name))

    # ------------------------------------------------------------------ per program
    def declarations(self) -> tuple:
        """(names declared once per program, argmax/argmin results that keep values too)."""
        seen: list[str] = []
        loop_vars = {s.var for s in statements(self.kernel.body) if isinstance(s, For)}
        for name in self.sh.shape:
            if name in self.local or name in seen or name in loop_vars or name in self.alias \
                    or name in self.inplace or name in self.folded:
                continue
            seen.append(name)
        args = tuple(s for s in statements(self.kernel.body) if isinstance(s, ArgReduceTile))
        return tuple(seen), args


def _hoistable(s, shape: tuple, group: _Group, written: set) -> bool:
    """Whether `s` may run before the open `group` in a nest of its own: a load or value over
    a broadcast part of the group's space (a row or a column of it) that reads nothing the
    group defines or stores."""
    if not isinstance(s, (Let, LoadTile)) or reads(s) & group.touched:
        return False
    if isinstance(s, LoadTile) and s.buffer in written:
        return False
    d0, d1 = group.shape
    return shape in ((1, d1), (d0, 1)) and shape != (1, 1)


def _groups(items):
    for it in items:
        if isinstance(it, _Group):
            yield it
        elif isinstance(it, tuple):
            yield from _groups(it[2])


def _in_place_reads(found) -> set:
    """The names the address of an operand read in place reads (`dot.InPlace`)."""
    out = expr_names(found.offset)
    return out | expr_names(found.load.mask) if found.load.mask is not None else out
