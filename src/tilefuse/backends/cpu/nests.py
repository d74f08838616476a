"""Printing one planned loop nest (`loop_plan.Nest`) as C++.

The nest's steps run in a loop over rows and an inner loop along the contiguous axis under
`#pragma omp simd`; values of the body are scalars (`name_v`), written to their array only
when the plan says a later site reads it. Reductions along the row accumulate in vector lanes
(an array of 16 partial results, combined once per row by halving steps); reductions down
the column accumulate per column. An index check ORs its failures into a flag of the nest (an
OpenMP simd reduction) and reports the check's number after the loops. Nothing here decides:
the shape of the nest, its reductions and its lanes come from the plan.
"""
from __future__ import annotations

from ...ir import dtypes as dt
from ...ir.monoid import ARGMAX, MAX, MIN, PROD, SUM
from ...tile.ir import ArgReduceTile, ReduceTile
from .exprs import CppUnsupported, ExprPrinter, const, ctype
from .loop_plan import Nest
from .shapes import reads

#: rows shorter than this are not peeled (`NestPrinter.peeled_masks`): twice the code for little
PEEL_MIN = 64


class NestPrinter:
    """Mixed into `CppPrinter`: uses its `plan`, `emit`, `ref_in`, `at`, `body_lines`, `flag`."""

    def nest(self, g: Nest, indent: int) -> None:
        d0, d1 = g.shape
        lanes = g.lanes
        row_reds, col_reds = g.row_reductions, g.col_reductions
        i, j = ("tf_i" if d0 > 1 else "0"), ("tf_j" if d1 > 1 else "0")
        simd = "#pragma omp simd" if g.simd else "// (stores to a shared address: not simd)"
        if g.checks and g.simd:
            simd += f" reduction(|:{', '.join(self.flag(c) for c in g.checks)})"
        self.emit("{", indent)
        ind = indent + 1
        for c in g.checks:
            self.emit(f"int32_t {self.flag(c)} = 0;", ind)
        for t in g.transposed:
            self.transposed_load(t, g.shape, ind)
        if not g.steps:
            self.emit("}", indent)
            return
        for s in col_reds:  # per column accumulators, over rows
            self.emit(f"for (int64_t tf_c = 0; tf_c < {d1}; ++tf_c) {_acc_at(s, 'tf_c', d1)} = {_ident(s)};", ind)
            if isinstance(s, ArgReduceTile):
                self.emit(f"for (int64_t tf_c = 0; tf_c < {d1}; ++tf_c) {_acc_at(s, 'tf_c', d1, True)} = {_vident(s)};",
                          ind)
        if g.rows_inner:  # columns outside, rows inside and vectorised (see `Nest.rows_inner`)
            self.emit(f"for (int64_t tf_j = 0; tf_j < {d1}; ++tf_j) {{", ind)
            self.emit(simd, ind + 1)
            self.emit(f"for (int64_t tf_i = 0; tf_i < {d0}; ++tf_i) {{", ind + 1)
            ind += 2
        elif d0 > 1:
            if d1 == 1 and not col_reds:  # accumulating over rows is a dependence along them
                self.emit(simd, ind)
            self.emit(f"for (int64_t tf_i = 0; tf_i < {d0}; ++tf_i) {{", ind)
            ind += 1
        for s in row_reds:
            t = ctype(s.dtype if isinstance(s, ReduceTile) else dt.int64)
            self.emit(f"{t} {_lanes(s)}[{lanes}];", ind)
            self.emit(f"for (int64_t tf_l = 0; tf_l < {lanes}; ++tf_l) {_lanes(s)}[tf_l] = {_ident(s)};", ind)
            if isinstance(s, ArgReduceTile):
                vt = ctype(self.plan.shapes.dtype.get(s.name + "__v", s.value.dtype))
                self.emit(f"{vt} {_lanes(s)}_v[{lanes}];", ind)
                self.emit(f"for (int64_t tf_l = 0; tf_l < {lanes}; ++tf_l) {_lanes(s)}_v[tf_l] = {_vident(s)};", ind)
        peel = self.peeled_masks(g) if d1 > 1 and not g.rows_inner else {}
        if peel:
            # the row's lanes before the first that a bound mask turns off run unmasked (masked
            # loads keep GCC from vectorising: a persistent row of 1000 in a 1024 tile, every
            # tile of a looped row whose length the tile does not divide)
            ends = [f"({extent}) - ({arange})" for arange, extent in peel.values()]
            live = ends[0] if len(ends) == 1 else "tf_min_i64(" + ", ".join(ends) + ")"
            self.emit(f"const int64_t tf_jw = tf_clamp_lanes({live}, {d1}, {lanes if row_reds else 1});", ind)
            saved = self.whole
            self.whole = saved | frozenset(peel)
            self.nest_columns(g, d1, lanes, row_reds, simd, ind, (i, j), "0", "tf_jw")
            self.whole = saved
            self.nest_columns(g, d1, lanes, row_reds, simd, ind, (i, j), "tf_jw", str(d1))
        else:
            self.nest_columns(g, d1, lanes, row_reds, simd, ind, (i, j), "0", str(d1))
        if g.rows_inner:
            for _ in range(2):
                ind -= 1
                self.emit("}", ind)
        for s in row_reds:
            self.finish_lanes(s, lanes, ind, (i, j))
        if d0 > 1 and not g.rows_inner:
            ind -= 1
            self.emit("}", ind)
        for c in g.checks:
            self.emit(f"if ({self.flag(c)}) tf_fail(tf_err, {self.plan.check_ids[id(c)]});", ind)
        self.emit("}", indent)

    def nest_columns(self, g: Nest, d1: int, lanes: int, row_reds, simd: str, ind: int, loops, start: str,
                     stop: str) -> None:
        """The nest's body over the columns `[start, stop)` of its row (all of them, or one side
        of a peeled bound mask: `peeled_masks`), inside the row loop when there is one."""
        i, j = loops
        staged = {s.name: f"tf_staged_{s.name}" for s in g.staged}
        if staged:  # (a scope of their own: a peeled row prints its columns twice)
            self.emit("{", ind)
            ind += 1
            self.staged_pass(g, staged, ind, loops, start, stop)
        if d1 > 1 and not g.rows_inner:  # (rows inside: `nest` opened both loops)
            if row_reds:
                self.emit(f"for (int64_t tf_jo = {start}; tf_jo < {stop}; tf_jo += {lanes}) {{", ind)
                self.emit(simd, ind + 1)
                self.emit(f"for (int64_t tf_jl = 0; tf_jl < {lanes}; ++tf_jl) {{", ind + 1)
                self.emit("const int64_t tf_j = tf_jo + tf_jl;", ind + 2)
                ind += 2
            else:
                self.emit(simd, ind)
                self.emit(f"for (int64_t tf_j = {start}; tf_j < {stop}; ++tf_j) {{", ind)
                ind += 1
        scope: set[str] = set()
        p = self.at((i, j), scope)
        for s in g.remat:
            for line in self.body_lines(s, p, target=f"{s.name}_v"):
                self.emit(line, ind)
            scope.add(s.name)
        for step in g.steps:
            s = step.stmt
            if step.role in ("row", "col", "copy"):
                self.accumulate(s, p, step.role, d1, ind, (i, j))
            elif step.role == "value":
                array = p.ref(s.name) if step.stored else None
                if s.name in staged:
                    self.emit(f"const {ctype(self.sh.dtype[s.name])} {s.name}_v = "
                              f"({ctype(self.sh.dtype[s.name])})({staged[s.name]}[{j}]);", ind)
                else:
                    for line in self.body_lines(s, p, target=f"{s.name}_v"):
                        self.emit(line, ind)
                scope.add(s.name)
                if array is not None and array != "true":  # ("true": a bound mask of a whole block)
                    self.emit(f"{array} = {s.name}_v;", ind)
            else:
                for line in self.body_lines(s, p):
                    self.emit(line, ind)
        if d1 > 1 and not g.rows_inner:
            if row_reds:
                ind -= 1
                self.emit("}", ind)
                ind -= 1
            else:
                ind -= 1
            self.emit("}", ind)
        if staged:
            self.emit("}", ind - 1)

    def staged_pass(self, g: Nest, staged: dict, ind: int, loops, start: str, stop: str) -> None:
        """The scalar pass over the columns `[start, stop)` that loads the nest's staged loads
        (`Planner.staged_loads`) into lane arrays, computing only what their masks and
        offsets need."""
        d1, (i, j) = g.shape[1], loops
        for s in g.staged:  # (bool arrays as bytes, as `codegen` declares them)
            t = "uint8_t" if self.sh.dtype[s.name].is_bool else ctype(self.sh.dtype[s.name])
            self.emit(f"alignas(64) {t} {staged[s.name]}[{d1}];", ind)
        self.emit(f"for (int64_t {j} = {start}; {j} < {stop}; ++{j}) {{", ind)
        scope: set[str] = set()
        p = self.at((i, j), scope)
        wanted = {id(s) for s in g.staged_inputs} | {id(s) for s in g.staged}
        for s in list(g.remat) + [step.stmt for step in g.steps]:
            if id(s) not in wanted:
                continue
            for line in self.body_lines(s, p, target=f"{s.name}_v"):
                self.emit(line, ind + 1)
            scope.add(s.name)
            if s.name in staged:
                self.emit(f"{staged[s.name]}[{j}] = {s.name}_v;", ind + 1)
        self.emit("}", ind)

    def peeled_masks(self, g: Nest) -> dict:
        """{mask: (arange, extent)}: the bound masks along the row (`arange + j < extent`,
        `CppPrinter.row_bounds`) that this nest reads and no later nest reads from its array,
        when its row is at least `PEEL_MIN` long: its columns are printed twice, unmasked up
        to the first lane a mask turns off and as planned from there."""
        bounds = self.row_bounds()
        if not bounds or g.shape[1] < PEEL_MIN:
            return {}
        used: set = set()
        for s in g.remat:
            used |= reads(s)
        for step in g.steps:
            used |= reads(step.stmt)
            if step.stored and step.stmt.name in bounds:
                return {}  # (its array must hold every lane for the nests after this one)
        return {m: b for m, b in bounds.items() if m in used and m not in self.whole}

    def transposed_load(self, t, shape, ind: int) -> None:
        s = t.stmt
        p = ExprPrinter(self.ref_in(("0", "0"), set()))
        self.emit(f"tf_load_t<{shape[0]}, {shape[1]}>(&ptr_{s.buffer}[{p.expr(s.offset)}], {p.index(t.col_stride)}, "
                  f"{s.name});", ind)

    # ------------------------------------------------------------------ reductions
    def arg_step(self, s, vacc: str, iacc: str, v: str, ix: str, ind: int) -> None:
        """(vacc, iacc) ← the better of itself and (v, ix): NaN counts as the largest value,
        ties go to the lower index."""
        t = ctype(s.value.dtype)
        better = "(v2 > v1)" if s.combiner == ARGMAX else "((v2 < v1) && !n1)"
        self.emit("{", ind)
        self.emit(f"const {t} v1 = {vacc}; const int64_t i1 = {iacc}; const {t} v2 = {v}; const int64_t i2 = {ix};",
                  ind + 1)
        self.emit("const bool n1 = v1 != v1, n2 = v2 != v2;", ind + 1)
        self.emit(f"const bool take = {better} || (n2 && !n1) || ((v1 == v2 || (n1 && n2)) && i2 < i1);", ind + 1)
        self.emit(f"{vacc} = take ? v2 : v1; {iacc} = take ? i2 : i1;", ind + 1)
        self.emit("}", ind)

    def accumulate(self, s, p: ExprPrinter, role: str, d1: int, ind: int, loops) -> None:
        v = p.expr(s.value)
        if isinstance(s, ArgReduceTile):
            ix = p.expr(s.index)
            if role == "row":
                self.arg_step(s, f"{_lanes(s)}_v[tf_jl]", f"{_lanes(s)}[tf_jl]", v, ix, ind)
            elif role == "col":
                self.arg_step(s, _acc_at(s, loops[1], d1, True), _acc_at(s, loops[1], d1), v, ix, ind)
            else:  # over a dim of one element: the index itself
                self.emit(f"{p.ref(s.name)} = {ix};", ind)
            return
        t = ctype(s.dtype)
        if role == "row":
            lane = f"{_lanes(s)}[tf_jl]"
            self.emit(f"{lane} = {_combine(s, lane, f'({t})({v})')};", ind)
        elif role == "col":
            acc = _acc_at(s, loops[1], d1)
            self.emit(f"{acc} = {_combine(s, acc, f'({t})({v})')};", ind)
        else:
            self.emit(f"{p.ref(s.name)} = ({t})({v});", ind)

    def finish_lanes(self, s, lanes: int, ind: int, loops) -> None:
        out = self.ref_in(loops, set())(s.name)
        lv = _lanes(s)
        if isinstance(s, ArgReduceTile):
            t = ctype(s.value.dtype)
            self.emit(f"{t} {s.name}_bv = {lv}_v[0]; int64_t {s.name}_bi = {lv}[0];", ind)
            self.emit(f"for (int64_t tf_l = 1; tf_l < {lanes}; ++tf_l)", ind)
            self.arg_step(s, f"{s.name}_bv", f"{s.name}_bi", f"{lv}_v[tf_l]", f"{lv}[tf_l]", ind + 1)
            self.emit(f"{out} = {s.name}_bi;", ind)
            return
        t = ctype(s.dtype)
        if lanes == 16 and s.dtype == dt.float32 and s.combiner.tile in (SUM, MAX, MIN):  # tf_hsum16f, ...
            self.emit(f"{out} = tf_h{s.combiner.tile.name}16f({lv});", ind)
            return
        if lanes & (lanes - 1) == 0:  # halving steps (vector ops) instead of a chain of lanes - 1
            self.emit(f"for (int tf_w = {lanes // 2}; tf_w > 0; tf_w >>= 1)", ind)
            self.emit(f"  for (int tf_l = 0; tf_l < tf_w; ++tf_l) {lv}[tf_l] = "
                      f"{_combine(s, f'{lv}[tf_l]', f'{lv}[tf_l + tf_w]')};", ind)
            self.emit(f"{out} = {lv}[0];", ind)
            return
        self.emit(f"{t} {s.name}_r = {lv}[0];", ind)
        self.emit(f"for (int64_t tf_l = 1; tf_l < {lanes}; ++tf_l) {s.name}_r = "
                  f"{_combine(s, f'{s.name}_r', f'{lv}[tf_l]')};", ind)
        self.emit(f"{out} = {s.name}_r;", ind)


def _lanes(s) -> str:
    return f"{s.name}_lanes"


def _ident(s) -> str:
    if isinstance(s, ArgReduceTile):  # the index of no element yet: any real one is lower
        return "INT64_MAX"
    return const(s.combiner.tile.identity(s.dtype), s.dtype)


def _vident(s) -> str:
    return const(s.combiner.identity(s.value.dtype), s.value.dtype)


def _acc_at(s, col: str, d1: int, values: bool = False) -> str:
    name = s.name + ("_cv" if values else "")
    return f"{name}[{col}]" if d1 > 1 else name


def _combine(s, acc: str, v: str) -> str:
    m = s.combiner.tile
    t = ctype(s.dtype)
    if m == SUM:
        return f"({acc} + {v})"
    if m == PROD:
        return f"({acc} * {v})"
    if m.extremum:
        return f"tf_{m.name}<{t}>({acc}, {v})"
    raise CppUnsupported(f"reduction combiner {s.combiner}")
