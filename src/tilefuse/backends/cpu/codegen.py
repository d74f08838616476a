"""Tile IR → C++ source: one `extern "C"` function per kernel.

The grid becomes an OpenMP-parallel loop over programs; each program runs the kernel body
once. Tile statements with the same iteration space that follow each other are *fused into
one loop nest* whose innermost loop runs along the contiguous axis under `#pragma omp simd`;
values that never leave their loop nest stay scalars in registers, cheap values a later nest
reads are recomputed there (`remat.py`), the others are stored in small arrays of the tile's
shape. Reductions inside a loop nest accumulate in vector lanes (an array of 16 partial
results, combined once after the loop by halving steps in vector registers); `dot` is a
register-blocked micro-kernel (8x32 or 4x64 fp32 accumulators held in vector registers
across the K loop) that reads unmasked contiguous-row operands in place and may accumulate
straight into a loop-carried tile (`dot.py`). Loop-carried state (`For` with `Assign`) lives
in arrays declared once per program.
An index check (`Check`) ORs its failures into a flag of its loop nest (an OpenMP simd
reduction, so the loop still vectorises) and, once the nest is done, records the check's number
in the kernel's error word (`tf_ptrs` after the buffers); the launcher raises it.
"""
from __future__ import annotations

import sympy

from ...ir import dtypes as dt
from ...ir.expr import Index, Var
from ...ir.monoid import ARGMAX, MAX, MIN, PROD, SUM
from ...tile.ir import (Arange, ArgReduceTile, Assign, BroadcastTile, Check, Comment, DotTile, For, Full, Let, LoadTile,
                        ProgramId, ReduceTile, StoreTile, TileKernel, checks_of)
from ...tile.variants import all_kernels
from .dot import DOT_SOURCE, fold_accumulator, inplace_operands, register_block, stmt_readers
from .exprs import STORAGE, CppUnsupported, ExprPrinter, const, ctype, round_to
from .remat import plan_remat
from .runtime import HEADER
from .shapes import SCALAR, Shapes, defines, reads

_ELEMENTWISE = (Let, LoadTile, StoreTile, BroadcastTile, Full, Assign, ReduceTile, ArgReduceTile, Check)
LANES = 16


class _Group:
    """Consecutive elementwise statements over one iteration space: one loop nest."""

    def __init__(self, shape):
        self.shape = shape
        self.stmts: list = []
        self.defined: set[str] = set()
        self.touched: set[str] = set()  # defined or assigned here
        self.reduced: set[str] = set()  # reduction results: final only after the loop


class CppPrinter:
    def __init__(self, kernel: TileKernel):
        self.kernel = kernel
        self.sh = Shapes(kernel)
        self.site: dict[int, object] = {}  # id(stmt) -> its group (or the statement itself)
        self.local: set[str] = set()  # values that never leave their loop nest
        self.lines: list[str] = []
        self.tmp = 0
        self.zero_dot: set[int] = set()  # ids of dots whose accumulator starts at 0
        self.remat: dict = {}  # id(group) -> statements recomputed in its loop body (remat.py)
        self.readers: dict[str, set] = {}  # name -> ids of the sites that read it
        self.stmt_readers = stmt_readers(kernel.body)  # name -> statements that read it
        self.alias: dict[str, str] = {}  # R -> acc: `R = f(acc)` written into acc's array (dot.py)
        self.dot_into: dict[int, str] = {}  # id(dot) -> the carried array it accumulates into
        self.skip: set[int] = set()  # ids of `acc = R + X` statements those dots replace
        self.folded: set[str] = set()  # names X of those dots (never stored)
        self.inplace = inplace_operands(kernel, self.sh, self._strides, self.stmt_readers)
        self.block_aligned = self._block_aligned()
        self.check_ids = {id(c): k + 1 for k, c in enumerate(checks_of(kernel.body))}  # error codes

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

    def plan(self, stmts) -> list:
        """Split a block into loop-nest groups and single statements (recursively)."""
        items: list = []
        group: _Group | None = None
        zero_fills = self.zero_starts(stmts)

        def flush():
            nonlocal group
            if group is not None:
                items.append(group)
                group = None

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
                items.append(("for", s, self.plan(s.body)))
                self.site[id(s)] = s
                continue
            if not isinstance(s, _ELEMENTWISE):
                flush()
                items.append(s)
                self.site[id(s)] = s
                continue
            shape = self.sh.loop_shape(s)
            if isinstance(s, (ReduceTile, ArgReduceTile)) and shape[self.sh.dim(s.axis)] == 1:
                shape = SCALAR if shape == SCALAR else shape  # reduction over a broadcast dim: a copy
            r = reads(s)
            if shape == SCALAR and not isinstance(s, (ReduceTile, ArgReduceTile)):
                pure = isinstance(s, (Let, LoadTile, BroadcastTile))
                if group is not None and pure and not (r & group.touched):
                    items.insert(len(items), s)  # hoisted above the open group
                    self.site[id(s)] = s
                    continue
                flush()
                items.append(s)
                self.site[id(s)] = s
                continue
            if group is not None and (group.shape != shape or r & group.reduced):
                flush()
            if group is None:
                group = _Group(shape)
            group.stmts.append(s)
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
                for name in reads(s) if not isinstance(s, For) else _for_reads(s):
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
                if readers.get(name, set()) <= {id(g)}:
                    self.local.add(name)

    # ------------------------------------------------------------------ references
    def ref_in(self, loops: tuple, scope: set):
        """A `ref(name)` spelling names at the element (loops[0], loops[1]) of a nest; names in
        `scope` are scalars of the nest's body."""
        def ref(name: str) -> str:
            if name in scope:
                return f"{name}_v"
            name = self.alias.get(name, name)
            if name in self.sh.aranges:
                d = self.sh.aranges[name]
                ext = self.sh.shape[name][d]
                return f"({name} + {loops[d]})" if ext > 1 else name
            shape = self.sh.shape.get(name)
            if shape is None or shape == SCALAR:
                return name
            parts = []
            if shape[0] > 1:
                parts.append(f"{loops[0]} * {shape[1]}" if shape[1] > 1 else loops[0])
            if shape[1] > 1:
                parts.append(loops[1])
            return f"{name}[{' + '.join(parts)}]"
        return ref

    def printer(self, loops=("0", "0"), scope=frozenset()) -> ExprPrinter:
        return ExprPrinter(self.ref_in(loops, scope))

    def at(self, loops: tuple, scope: set) -> ExprPrinter:
        """The printer of a loop nest's body (index arithmetic that knows its aligned aranges)."""
        aligned = {}
        for name, (block, d) in self.block_aligned.items():
            if self.sh.shape[name][d] > 1:
                aligned[name] = (block, loops[d])
        return ExprPrinter(self.ref_in(loops, scope), aligned)

    def _block_aligned(self) -> dict:
        """Aranges whose start is a multiple of their block: name -> (block, dim)."""
        out = {}
        for s in _walk(self.kernel.body):
            if isinstance(s, Arange) and isinstance(s.start, Index) and s.name in self.sh.aranges:
                block = self.sh.block(s.block)
                start = sympy.sympify(s.start.expr)
                start = start.subs({x: self.sh.constexprs[x.name] for x in start.free_symbols
                                    if x.name in self.sh.constexprs})
                if block > 1 and sympy.fraction(sympy.cancel(start / block))[1] == 1:
                    out[s.name] = (block, self.sh.aranges[s.name])
        return out

    # ------------------------------------------------------------------ emission
    def emit(self, line: str, indent: int) -> None:
        self.lines.append("  " * indent + line)

    def fresh(self, prefix: str) -> str:
        self.tmp += 1
        return f"tf_{prefix}{self.tmp}"

    def items(self, items, indent: int) -> None:
        for it in items:
            if isinstance(it, _Group):
                self.group(it, indent)
            elif isinstance(it, tuple):
                _, s, body = it
                p = self.printer()
                self.emit(f"for (int64_t {s.var} = {p.expr(s.start)}; {s.var} < {p.expr(s.stop)}; {s.var} += {s.step}) {{",
                          indent)
                self.items(body, indent + 1)
                self.emit("}", indent)
            else:
                self.single(it, indent)

    def single(self, s, indent: int) -> None:
        p = self.printer()
        if isinstance(s, ProgramId):
            self.emit(f"{s.name} = tf_pid{s.axis};", indent)
        elif isinstance(s, Arange):
            self.emit(f"{s.name} = {p.expr(s.start)};", indent)
        elif isinstance(s, Comment):
            self.emit(f"// {s.text}", indent)
        elif isinstance(s, DotTile):
            self.dot(s, indent)
        elif isinstance(s, Check):
            self.emit(f"if (!({p.expr(s.ok)})) tf_fail(tf_err, {self.check_ids[id(s)]});", indent)
        elif isinstance(s, (Let, LoadTile, BroadcastTile, Full, Assign, StoreTile)):
            for line in self.body_lines(s, p, scalar=True):
                self.emit(line, indent)
        else:
            raise CppUnsupported(f"cannot print {type(s).__name__} as C++")

    def body_lines(self, s, p: ExprPrinter, scalar: bool, target: str | None = None) -> list[str]:
        """The C++ for one element of an elementwise statement. `target`: where a defined
        value goes (`name_v` for nest scalars, or the array element)."""
        if isinstance(s, StoreTile):
            v = p.expr(s.value)
            buf = f"ptr_{s.buffer}[{p.expr(s.offset)}]"
            if s.dtype == dt.bfloat16:
                stored = f"tf_f_to_bf16((float)({v}))"
            elif s.dtype == dt.float16:
                stored = f"tf_f_to_h((float)({v}))"
            elif s.dtype.is_bool:
                stored = f"(({v}) != 0)"
            else:
                stored = f"({STORAGE[s.dtype.name]})({v})"
            line = f"{buf} = {stored};"
            return [f"if ({p.expr(s.mask)}) {line}" if s.mask is not None else line]
        if isinstance(s, Check):
            return [f"{self._flag(s)} |= !({p.expr(s.ok)});"]
        if isinstance(s, Assign):
            t = ctype(self.sh.dtype[s.name])
            return [f"{target or p.ref(s.name)} = ({t})({p.expr(s.value)});"]
        name = s.name
        t = ctype(self.sh.dtype[name])
        if isinstance(s, Let) or isinstance(s, BroadcastTile):
            value = f"({t})({p.expr(s.value)})"
        elif isinstance(s, Full):
            value = f"({t})({const(s.value, s.dtype)})"
        elif isinstance(s, LoadTile):
            elem = f"ptr_{s.buffer}[{p.expr(s.offset)}]"
            if s.dtype == dt.bfloat16:
                elem = f"tf_bf16_to_f({elem})"
            elif s.dtype == dt.float16:
                elem = f"tf_h_to_f({elem})"
            if s.mask is not None:
                value = f"(({p.expr(s.mask)}) ? ({t})({elem}) : ({t})({const(s.other, s.dtype)}))"
            else:
                value = f"({t})({elem})"
        else:
            raise CppUnsupported(f"cannot print {type(s).__name__} elementwise")
        if target is None:
            target = p.ref(name)
        decl = f"const {t} " if target.endswith("_v") else ""
        return [f"{decl}{target} = {value};"]

    # ------------------------------------------------------------------ loop nests
    def group(self, g: _Group, indent: int) -> None:
        d0, d1 = g.shape
        reds = [s for s in g.stmts if isinstance(s, (ReduceTile, ArgReduceTile))]
        row_reds = [s for s in reds if self.sh.dim(s.axis) == 1 and d1 > 1]
        col_reds = [s for s in reds if self.sh.dim(s.axis) == 0 and d0 > 1]
        lanes = (LANES if d1 % LANES == 0 else d1) if row_reds else d1
        i, j = ("tf_i" if d0 > 1 else "0"), ("tf_j" if d1 > 1 else "0")
        # lanes that store to one address (a [BLOCK_M, 1] tile stored at a row-only offset)
        # must keep their order: no `omp simd` on that loop
        inner = 1 if d1 > 1 else 0
        simd = "#pragma omp simd" if all(self.sh.of(s.offset)[inner] == g.shape[inner] for s in g.stmts
                                         if isinstance(s, StoreTile)) else "// (stores to a shared address: not simd)"
        dead = {id(s) for s in self._dead(g)}
        if len(dead) == len(g.stmts):  # every value recomputed where it is read
            return
        checks = [s for s in g.stmts if isinstance(s, Check)]
        if checks and simd.startswith("#"):
            simd += f" reduction(|:{', '.join(self._flag(c) for c in checks)})"
        self.emit("{", indent)
        ind = indent + 1
        for c in checks:
            self.emit(f"int32_t {self._flag(c)} = 0;", ind)
        hoisted = {id(s) for s in g.stmts if id(s) not in dead and self._transposed_load(s, g.shape, ind)}
        if len(hoisted) + len(dead) == len(g.stmts):
            self.emit("}", indent)
            return
        for s in col_reds:  # per column accumulators, over rows
            self.emit(f"for (int64_t tf_c = 0; tf_c < {d1}; ++tf_c) {self._acc_at(s, 'tf_c', d1)} = {self._ident(s)};", ind)
            if isinstance(s, ArgReduceTile):
                self.emit(f"for (int64_t tf_c = 0; tf_c < {d1}; ++tf_c) {self._acc_at(s, 'tf_c', d1, True)} = {self._vident(s)};", ind)
        if d0 > 1:
            if d1 == 1 and not col_reds:  # accumulating over rows is a dependence along them
                self.emit(simd, ind)
            self.emit(f"for (int64_t tf_i = 0; tf_i < {d0}; ++tf_i) {{", ind)
            ind += 1
        for s in row_reds:
            t = ctype(self._acc_dtype(s))
            self.emit(f"{t} {self._lanes(s)}[{lanes}];", ind)
            self.emit(f"for (int64_t tf_l = 0; tf_l < {lanes}; ++tf_l) {self._lanes(s)}[tf_l] = {self._ident(s)};", ind)
            if isinstance(s, ArgReduceTile):
                vt = ctype(self.sh.dtype.get(s.name + "__v", s.value.dtype))
                self.emit(f"{vt} {self._lanes(s)}_v[{lanes}];", ind)
                self.emit(f"for (int64_t tf_l = 0; tf_l < {lanes}; ++tf_l) {self._lanes(s)}_v[tf_l] = {self._vident(s)};", ind)
        if d1 > 1:
            if row_reds:
                self.emit(f"for (int64_t tf_jo = 0; tf_jo < {d1}; tf_jo += {lanes}) {{", ind)
                self.emit(simd, ind + 1)
                self.emit(f"for (int64_t tf_jl = 0; tf_jl < {lanes}; ++tf_jl) {{", ind + 1)
                self.emit("const int64_t tf_j = tf_jo + tf_jl;", ind + 2)
                ind += 2
            else:
                self.emit(simd, ind)
                self.emit(f"for (int64_t tf_j = 0; tf_j < {d1}; ++tf_j) {{", ind)
                ind += 1
        scope: set[str] = set()
        p = self.at((i, j), scope)
        for s in self.remat.get(id(g), ()):
            for line in self.body_lines(s, p, scalar=False, target=f"{s.name}_v"):
                self.emit(line, ind)
            scope.add(s.name)
        for s in g.stmts:
            if id(s) in hoisted or id(s) in dead:
                continue
            if isinstance(s, (ReduceTile, ArgReduceTile)):
                self._accumulate(s, p, row=s in row_reds, col=s in col_reds, d1=d1, ind=ind, loops=(i, j))
                continue
            name = defines(s)
            if name is not None:
                array = None if name in self.local else p.ref(name)
                for line in self.body_lines(s, p, scalar=False, target=f"{name}_v"):
                    self.emit(line, ind)
                scope.add(name)
                if array is not None:
                    self.emit(f"{array} = {name}_v;", ind)
            else:
                for line in self.body_lines(s, p, scalar=False):
                    self.emit(line, ind)
        if d1 > 1:
            if row_reds:
                ind -= 1
                self.emit("}", ind)
                ind -= 1
            else:
                ind -= 1
            self.emit("}", ind)
        for s in row_reds:
            self._finish_lanes(s, lanes, ind, (i, j))
        if d0 > 1:
            ind -= 1
            self.emit("}", ind)
        for c in checks:
            self.emit(f"if ({self._flag(c)}) tf_fail(tf_err, {self.check_ids[id(c)]});", ind)
        self.emit("}", indent)

    def _dead(self, g: _Group) -> list:
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

    def _flag(self, check) -> str:
        return f"tf_bad{self.check_ids[id(check)]}"

    def _acc_dtype(self, s):
        return s.dtype if isinstance(s, ReduceTile) else dt.int64

    def _lanes(self, s) -> str:
        return f"{s.name}_lanes"

    def _ident(self, s) -> str:
        if isinstance(s, ArgReduceTile):  # the index of no element yet: any real one is lower
            return "INT64_MAX"
        return const(s.combiner.tile.identity(s.dtype), s.dtype)

    def _vident(self, s) -> str:
        return const(s.combiner.identity(s.value.dtype), s.value.dtype)

    def _acc_at(self, s, col: str, d1: int, values: bool = False) -> str:
        name = s.name + ("_cv" if values else "")
        return f"{name}[{col}]" if d1 > 1 else name

    def _combine(self, s, acc: str, v: str) -> str:
        m = s.combiner.tile
        t = ctype(s.dtype)
        if m == SUM:
            return f"({acc} + {v})"
        if m == PROD:
            return f"({acc} * {v})"
        if m.extremum:
            return f"tf_{m.name}<{t}>({acc}, {v})"
        raise CppUnsupported(f"reduction combiner {s.combiner}")

    def _arg_step(self, s, vacc: str, iacc: str, v: str, ix: str, ind: int) -> None:
        """(vacc, iacc) ← the better of itself and (v, ix): NaN counts as the largest value,
        ties go to the lower index."""
        t = ctype(s.value.dtype)
        better = "(v2 > v1)" if s.combiner == ARGMAX else "((v2 < v1) && !n1)"
        self.emit("{", ind)
        self.emit(f"const {t} v1 = {vacc}; const int64_t i1 = {iacc}; const {t} v2 = {v}; const int64_t i2 = {ix};", ind + 1)
        self.emit("const bool n1 = v1 != v1, n2 = v2 != v2;", ind + 1)
        self.emit(f"const bool take = {better} || (n2 && !n1) || ((v1 == v2 || (n1 && n2)) && i2 < i1);", ind + 1)
        self.emit(f"{vacc} = take ? v2 : v1; {iacc} = take ? i2 : i1;", ind + 1)
        self.emit("}", ind)

    def _accumulate(self, s, p: ExprPrinter, row: bool, col: bool, d1: int, ind: int, loops) -> None:
        v = p.expr(s.value)
        if isinstance(s, ArgReduceTile):
            ix = p.expr(s.index)
            if row:
                self._arg_step(s, f"{self._lanes(s)}_v[tf_jl]", f"{self._lanes(s)}[tf_jl]", v, ix, ind)
            elif col:
                self._arg_step(s, self._acc_at(s, loops[1], d1, True), self._acc_at(s, loops[1], d1), v, ix, ind)
            else:  # over a dim of one element: the index itself
                self.emit(f"{p.ref(s.name)} = {ix};", ind)
            return
        t = ctype(s.dtype)
        if row:
            lane = f"{self._lanes(s)}[tf_jl]"
            self.emit(f"{lane} = {self._combine(s, lane, f'({t})({v})')};", ind)
        elif col:
            acc = self._acc_at(s, loops[1], d1)
            self.emit(f"{acc} = {self._combine(s, acc, f'({t})({v})')};", ind)
        else:
            self.emit(f"{p.ref(s.name)} = ({t})({v});", ind)

    def _finish_lanes(self, s, lanes: int, ind: int, loops) -> None:
        out = self.ref_in(loops, set())(s.name)
        if isinstance(s, ArgReduceTile):
            t = ctype(s.value.dtype)
            self.emit(f"{t} {s.name}_bv = {self._lanes(s)}_v[0]; int64_t {s.name}_bi = {self._lanes(s)}[0];", ind)
            self.emit(f"for (int64_t tf_l = 1; tf_l < {lanes}; ++tf_l)", ind)
            self._arg_step(s, f"{s.name}_bv", f"{s.name}_bi", f"{self._lanes(s)}_v[tf_l]", f"{self._lanes(s)}[tf_l]",
                           ind + 1)
            self.emit(f"{out} = {s.name}_bi;", ind)
            return
        t = ctype(s.dtype)
        lv = self._lanes(s)
        if lanes == 16 and s.dtype == dt.float32 and s.combiner.tile in (SUM, MAX, MIN):  # tf_hsum16f, ...
            self.emit(f"{out} = tf_h{s.combiner.tile.name}16f({lv});", ind)
            return
        if lanes & (lanes - 1) == 0:  # halving steps (vector ops) instead of a chain of lanes - 1
            self.emit(f"for (int tf_w = {lanes // 2}; tf_w > 0; tf_w >>= 1)", ind)
            self.emit(f"  for (int tf_l = 0; tf_l < tf_w; ++tf_l) {lv}[tf_l] = "
                      f"{self._combine(s, f'{lv}[tf_l]', f'{lv}[tf_l + tf_w]')};", ind)
            self.emit(f"{out} = {lv}[0];", ind)
            return
        self.emit(f"{t} {s.name}_r = {lv}[0];", ind)
        self.emit(f"for (int64_t tf_l = 1; tf_l < {lanes}; ++tf_l) {s.name}_r = "
                  f"{self._combine(s, f'{s.name}_r', f'{lv}[tf_l]')};", ind)
        self.emit(f"{out} = {s.name}_r;", ind)

    def _strides(self, offset):
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
            d = self.sh.aranges.get(sym.name)
            if d is not None and self.sh.shape[sym.name][d] > 1:
                moved[sym] = sym + (ti if d == 0 else tj)
        e = sympy.expand(e.subs(moved))
        si, sj = sympy.diff(e, ti), sympy.diff(e, tj)
        tile = set(moved) | {ti, tj}
        if (si.free_symbols | sj.free_symbols) & tile:
            return None
        return si, sj

    def _transposed_load(self, s, shape, ind: int) -> bool:
        """An unmasked fp32 tile load kept in an array whose source is contiguous along the
        tile's rows (a Kᵀ tile read from K) is copied by 16x16 register transposes before the
        loop nest (the nest's inner loop would gather it one element at a time)."""
        d0, d1 = shape
        if not (isinstance(s, LoadTile) and s.mask is None and s.dtype == dt.float32 and s.name not in self.local
                and d0 % 16 == 0 and d1 % 16 == 0 and isinstance(s.offset, Index)
                and self.sh.shape.get(s.name) == shape):
            return False
        strides = self._strides(s.offset)
        if strides is None or strides[0] != 1 or strides[1] == 1:
            return False
        sj = strides[1]
        p = ExprPrinter(self.ref_in(("0", "0"), set()))
        self.emit(f"tf_load_t<{d0}, {d1}>(&ptr_{s.buffer}[{p.expr(s.offset)}], {p.index(sj)}, {s.name});", ind)
        return True

    # ------------------------------------------------------------------ dot
    def dot(self, s: DotTile, indent: int) -> None:
        (m, n) = self.sh.shape[s.name]
        k = self.sh.of(s.a)[1]
        if self.sh.of(s.b)[0] not in (1, k):
            raise CppUnsupported("dot operands of mismatched inner extents")
        self.emit("{", indent)
        ind = indent + 1
        if not (isinstance(s.acc, Var) and s.acc.name == s.name):
            p = ExprPrinter(self.ref_in(("tf_i", "tf_j"), set()))
            self.emit(f"for (int64_t tf_i = 0; tf_i < {m}; ++tf_i) for (int64_t tf_j = 0; tf_j < {n}; ++tf_j) "
                      f"{s.name}[tf_i * {n} + tf_j] = {p.expr(s.acc)};", ind)
        acc_t = self.sh.dtype[s.name]  # fp32, or fp64 for double operands (the plain loop only)
        block = register_block(m, n) if acc_t == dt.float32 else None
        (a, lda), (b, ldb) = (self._operand(s.a, (m, k), ind, block, acc_t),
                              self._operand(s.b, (k, n), ind, block, acc_t))
        zero = id(s) in self.zero_dot and id(s) not in self.dot_into
        out = self.dot_into.get(id(s), s.name)
        if block is not None:
            flag = ", true" if zero else ""
            if (lda, ldb) == (k, n):
                self.emit(f"tf_dot_rb<{m}, {n}, {k}, {block[0]}, {block[1]}{flag}>({a}, {b}, {out});", ind)
            else:
                self.emit(f"tf_dot_rb_ld<{m}, {n}, {k}, {block[0]}, {block[1]}, {lda}, {ldb}{flag}>({a}, {b}, {out});",
                          ind)
        else:
            if zero:
                self.emit(f"for (int64_t tf_i = 0; tf_i < {m * n}; ++tf_i) {out}[tf_i] = 0;", ind)
            self.emit(f"tf_dot_ikj<{m}, {n}, {k}>({a}, {b}, {out});", ind)
        self.emit("}", indent)

    def _operand(self, e, shape, ind, block, acc_t) -> tuple:
        """(pointer, leading dim) of the operand as a row-major array of `shape` in the
        accumulator's type: the buffer itself for a load read in place (with a register block),
        else a dense array."""
        t = ctype(acc_t)
        held = (dt.float32, dt.bfloat16, dt.float16) if acc_t == dt.float32 else (acc_t,)  # arrays of type t
        p = ExprPrinter(self.ref_in(("tf_i", "tf_j"), set()))
        if isinstance(e, Var) and e.name in self.inplace:  # (its load is not emitted)
            s, ld = self.inplace[e.name]
            if block is not None and self.sh.shape.get(e.name) == shape:
                return f"&ptr_{s.buffer}[{self.printer().expr(s.offset)}]", ld
            elem = f"ptr_{s.buffer}[{p.expr(s.offset)}]"  # a dense copy from the buffer instead
        elif isinstance(e, Var) and e.name not in self.local and self.sh.shape.get(e.name) == shape \
                and self.sh.dtype[e.name] in held and e.name not in self.sh.aranges:
            return e.name, shape[1]
        else:
            elem = p.expr(e)
        name = self.fresh("op")
        self.emit(f"alignas(64) {t} {name}[{shape[0] * shape[1]}];", ind)
        self.emit(f"for (int64_t tf_i = 0; tf_i < {shape[0]}; ++tf_i) for (int64_t tf_j = 0; tf_j < {shape[1]}; ++tf_j) "
                  f"{name}[tf_i * {shape[1]} + tf_j] = ({t})({elem});", ind)
        return name, shape[1]

    # ------------------------------------------------------------------ the kernel
    def declarations(self, indent: int) -> None:
        seen = set()
        for name, shape in self.sh.shape.items():
            if name in self.local or name in seen or _is_loop_var(self.kernel.body, name) or name in self.alias \
                    or name in self.inplace or name in self.folded:
                continue
            seen.add(name)
            t = ctype(self.sh.dtype[name])
            size = shape[0] * shape[1]
            if name in self.sh.aranges or size == 1:
                self.emit(f"{t} {name};", indent)
            else:  # bool arrays as bytes: GCC 12 miscompiles masked AVX-512 stores driven by bool arrays
                self.emit(f"alignas(64) {'uint8_t' if t == 'bool' else t} {name}[{size}];", indent)
        for s in _walk(self.kernel.body):  # column reductions of argmax keep their values too
            if isinstance(s, ArgReduceTile):
                shape = self.sh.shape[s.name]
                size = shape[0] * shape[1]
                vt = ctype(s.value.dtype)
                self.emit(f"{vt} {s.name}_cv" + (f"[{size}];" if size > 1 else ";"), indent)

    def function(self) -> str:
        """The kernel's `extern "C"` function (after the prelude that `_prelude` prints)."""
        k = self.kernel
        items = self.plan(k.body)
        self.remat = plan_remat(k, items, self.sh, _Group)
        self.find_locals(items)
        body_start = len(self.lines)
        self.items(items, 3)
        body = self.lines[body_start:]
        self.lines = []
        out = []
        out.append(f'extern "C" void {k.name}(void* const* tf_ptrs, const int64_t* tf_sizes, '
                   f'const int64_t* tf_grid, int32_t tf_threads) {{')
        for name, v in k.constexprs.items():
            out.append(f"  constexpr int64_t {name} = {int(v)};")
        nb = 0
        for q in k.params:
            if q.kind == "buffer":
                out.append(f"  {STORAGE[q.dtype.name]}* __restrict__ ptr_{q.name} = "
                           f"({STORAGE[q.dtype.name]}*)tf_ptrs[{nb}];")
                nb += 1
        if self.check_ids:  # the error word: after the buffers
            out.append(f"  int64_t* tf_err = (int64_t*)tf_ptrs[{nb}];")
        ns = 0
        for q in k.params:
            if q.kind == "size":
                out.append(f"  const int64_t {q.name} = tf_sizes[{ns}];")
                ns += 1
        out.append("  (void)tf_sizes; (void)tf_threads;")
        out.append("  const int64_t tf_g0 = tf_grid[0], tf_g1 = tf_grid[1], tf_n = tf_grid[0] * tf_grid[1] * tf_grid[2];")
        out.append("  #pragma omp parallel for schedule(guided) num_threads(tf_threads) if(tf_n > 1 && tf_threads > 1)")
        out.append("  for (int64_t tf_p = 0; tf_p < tf_n; ++tf_p) {")
        out.append("    const int64_t tf_pid0 = tf_p % tf_g0, tf_pid1 = (tf_p / tf_g0) % tf_g1, tf_pid2 = tf_p / (tf_g0 * tf_g1);")
        out.append("    (void)tf_pid0; (void)tf_pid1; (void)tf_pid2;")
        self.lines = []
        self.declarations(2)
        out.extend("  " + line for line in self.lines)
        out.append("    {")
        out.extend(body)
        out.append("    }")
        out.append("  }")
        out.append("}")
        return "\n".join(out) + "\n"


_FAIL = r"""
/* a failed index check: its number goes to the error word (any one of several is reported) */
TF_INLINE void tf_fail(int64_t* err, int64_t code) { __atomic_store_n(err, code, __ATOMIC_RELAXED); }
"""


def _walk(stmts):
    for s in stmts:
        yield s
        if isinstance(s, For):
            yield from _walk(s.body)


def _is_loop_var(stmts, name: str) -> bool:
    return any(isinstance(s, For) and s.var == name for s in _walk(stmts))


def _for_reads(s: For) -> set:
    from ...tile.ir import expr_names

    return expr_names(s.start) | expr_names(s.stop)


def _groups(items):
    for it in items:
        if isinstance(it, _Group):
            yield it
        elif isinstance(it, tuple):
            yield from _groups(it[2])


def _prelude(checks: bool) -> str:
    return "\n".join([HEADER, DOT_SOURCE] + ([_FAIL] if checks else [])) + "\n"


def generate(kernel: TileKernel) -> str:
    """The C++ source of one kernel, with its size variants (`tile.variants`) after it in the
    same library (raises `CppUnsupported` for what it cannot print)."""
    printers = [CppPrinter(k) for k in all_kernels(kernel)]
    functions = [p.function() for p in printers]
    return _prelude(any(p.check_ids for p in printers)) + "".join(functions)


__all__ = ["generate", "CppUnsupported", "round_to"]
