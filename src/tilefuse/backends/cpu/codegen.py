"""Tile IR → C++ source: two `extern "C"` functions per kernel, printed from its loop plan.

`loop_plan.plan_kernel` decides how the kernel runs (its loop nests, what stays in registers,
what is recomputed, how each `dot` reads its operands); this module only spells that plan: a
function running a range of the grid's programs on the calling thread (`<name>__programs`,
what a graph's run of kernels calls from its one parallel region: `fast_call.run_steps`), the
kernel's own entry spreading its programs over OpenMP threads through it, the per-program
declarations, and each planned
item in order — a loop nest (`nests.py`), a `dot` (the register-blocked micro-kernel or the
plain loop of `dot.py`), a `For`, or a statement on its own. Each kind of statement has one
handler (`_SINGLE` on its own, `_ELEMENT` for one element inside a nest). An index check
(`Check`) records its number in the kernel's error word (`tf_ptrs` after the buffers); the
launcher raises it.

A program whose tile can run past the end of its space (`bound_check`'s masks: the last block
of a flat walk, the last rows or columns of a 2-D tile) is printed twice after its program ids
and aranges: once with those masks taken as true, for every block that is whole, and once as
planned, for the last: masked loads and stores keep a loop from vectorising well (a cast of
1953408 elements took 212 µs where 1953792, a multiple of the block, took 115).
"""
from __future__ import annotations

import sympy

from ...ir import dtypes as dt
from ...ir.expr import Binary, Index
from ...tile.ir import (Arange, Assign, BroadcastTile, Check, Comment, DotTile, Full, Let, LoadTile, ProgramId,
                        StoreTile, TileKernel, statements)
from ...tile.variants import all_kernels
from ..dispatch import handler
from .dot import DOT_SOURCE, DotPlan, Operand, zeros_extent
from .exprs import STORAGE, CppUnsupported, ExprPrinter, const, ctype, narrow_ints, round_to
from .loop_plan import Loop, LoopPlan, Nest, Single, plan_kernel
from .nests import NestPrinter
from .runtime import HEADER
from .shapes import SCALAR


class CppPrinter(NestPrinter):
    """Prints one planned kernel; holds nothing but the plan and the lines printed so far."""

    def __init__(self, plan: LoopPlan):
        self.plan = plan
        self.sh = plan.shapes
        self.narrow = narrow_ints(plan.kernel)
        self.lines: list[str] = []
        self.tmp = 0
        #: bound masks printed as `true` (the whole-block version of the program: `function`;
        #: the unmasked columns of a peeled nest: `NestPrinter.peeled_masks`)
        self.whole: frozenset = frozenset()
        self._row_bounds: dict | None = None

    # ------------------------------------------------------------------ references
    def ref_in(self, loops: tuple, scope: set):
        """A `ref(name)` spelling names at the element (loops[0], loops[1]) of a nest; names in
        `scope` are scalars of the nest's body."""
        def ref(name: str) -> str:
            if name in self.whole:
                return "true"
            if name in scope:
                return f"{name}_v"
            name = self.plan.alias.get(name, name)
            if name in self.sh.aranges:
                d = self.sh.aranges[name]
                ext = self.sh.shape[name][d]
                return f"({name} + {loops[d]})" if ext > 1 else name
            shape = self.sh.shape.get(name)
            if shape is None or shape == SCALAR:
                return name
            if name in self.plan.columns and shape[0] > 1 and shape[1] > 1:  # stored by columns
                return f"{name}[{loops[1]} * {shape[0]} + {loops[0]}]"
            parts = []
            if shape[0] > 1:
                parts.append(f"{loops[0]} * {shape[1]}" if shape[1] > 1 else loops[0])
            if shape[1] > 1:
                parts.append(loops[1])
            return f"{name}[{' + '.join(parts)}]"
        return ref

    def printer(self, loops=("0", "0"), scope=frozenset()) -> ExprPrinter:
        return ExprPrinter(self.ref_in(loops, scope), narrow=self.narrow)

    def at(self, loops: tuple, scope: set) -> ExprPrinter:
        """The printer of a loop nest's body (index arithmetic that knows its aligned aranges)."""
        aligned = {}
        for name, (block, d) in self.plan.aligned.items():
            if self.sh.shape[name][d] > 1:
                aligned[name] = (block, loops[d])
        return ExprPrinter(self.ref_in(loops, scope), aligned, self.narrow)

    def flag(self, check) -> str:
        return f"tf_bad{self.plan.check_ids[id(check)]}"

    # ------------------------------------------------------------------ emission
    def emit(self, line: str, indent: int) -> None:
        self.lines.append("  " * indent + line)

    def fresh(self, prefix: str) -> str:
        self.tmp += 1
        return f"tf_{prefix}{self.tmp}"

    def items(self, items, indent: int) -> None:
        for it in items:
            handler(_ITEM, it, CppUnsupported)(self, it, indent)

    def loop(self, it: Loop, indent: int) -> None:
        s, p = it.stmt, self.printer()
        self.emit(f"for (int64_t {s.var} = {p.expr(s.start)}; {s.var} < {p.expr(s.stop)}; {s.var} += {s.step}) {{",
                  indent)
        self.items(it.body, indent + 1)
        self.emit("}", indent)

    def single(self, it: Single, indent: int) -> None:
        s = it.stmt
        handler(_SINGLE, s, CppUnsupported, "cannot print {} as C++")(self, s, self.printer(), indent)

    def _program_id(self, s, p, indent) -> None:
        self.emit(f"{s.name} = tf_grid[{s.axis}] - 1 - tf_pid{s.axis};" if s.reverse else f"{s.name} = tf_pid{s.axis};", indent)

    def _arange(self, s, p, indent) -> None:
        self.emit(f"{s.name} = {p.expr(s.start)};", indent)

    def _comment(self, s, p, indent) -> None:
        self.emit(f"// {s.text}", indent)

    def _check(self, s, p, indent) -> None:
        self.emit(f"if (!({p.expr(s.ok)})) tf_fail(tf_err, {self.plan.check_ids[id(s)]});", indent)

    def _scalar(self, s, p, indent) -> None:
        for line in self.body_lines(s, p):
            self.emit(line, indent)

    # ------------------------------------------------------------------ one element
    def body_lines(self, s, p: ExprPrinter, target: str | None = None) -> list[str]:
        """The C++ for one element of an elementwise statement. `target`: where a defined
        value goes (`name_v` for nest scalars, or the array element)."""
        return handler(_ELEMENT, s, CppUnsupported, "cannot print {} elementwise")(self, s, p, target)

    def _store(self, s, p, target) -> list[str]:
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

    def _check_element(self, s, p, target) -> list[str]:
        # (a set, not `flag |= !ok`: GCC 13.3 at -O2 and above, with AVX-512 on an Intel host,
        # vectorised that `|=` of a negated bool in a `simd reduction` loop wrongly and raised
        # for in-range indices; GCC 12 and the conditional form are right)
        return [f"if (!({p.expr(s.ok)})) {self.flag(s)} = 1;"]

    def _assign(self, s, p, target) -> list[str]:
        t = ctype(self.sh.dtype[s.name])
        return [f"{target or p.ref(s.name)} = ({t})({p.expr(s.value)});"]

    def _define(self, s, value: str, p, target) -> list[str]:
        if target is None:
            target = p.ref(s.name)
            if target == "true":  # a bound mask of a whole block: nothing reads it
                return []
        decl = f"const {ctype(self.sh.dtype[s.name])} " if target.endswith("_v") else ""
        return [f"{decl}{target} = {value};"]

    def _let(self, s, p, target) -> list[str]:  # (and BroadcastTile)
        t = ctype(self.sh.dtype[s.name])
        return self._define(s, f"({t})({p.expr(s.value)})", p, target)

    def _full(self, s, p, target) -> list[str]:
        t = ctype(self.sh.dtype[s.name])
        return self._define(s, f"({t})({const(s.value, s.dtype)})", p, target)

    def _load(self, s, p, target) -> list[str]:
        t = ctype(self.sh.dtype[s.name])
        elem = f"ptr_{s.buffer}[{p.expr(s.offset)}]"
        if s.dtype == dt.bfloat16:
            elem = f"tf_bf16_to_f({elem})"
        elif s.dtype == dt.float16:
            elem = f"tf_h_to_f({elem})"
        if s.mask is not None:
            value = f"(({p.expr(s.mask)}) ? ({t})({elem}) : ({t})({const(s.other, s.dtype)}))"
        else:
            value = f"({t})({elem})"
        return self._define(s, value, p, target)

    # ------------------------------------------------------------------ dot
    def dot(self, d: DotPlan, indent: int) -> None:
        s, m, n, k = d.stmt, d.m, d.n, d.k
        self.emit("{", indent)
        ind = indent + 1
        if d.init:
            p = ExprPrinter(self.ref_in(("tf_i", "tf_j"), set()))
            self.emit(f"for (int64_t tf_i = 0; tf_i < {m}; ++tf_i) for (int64_t tf_j = 0; tf_j < {n}; ++tf_j) "
                      f"{s.name}[tf_i * {n} + tf_j] = {p.expr(s.acc)};", ind)
        a, b = self.operand(d.a, d.acc_dtype, ind), self.operand(d.b, d.acc_dtype, ind)
        lda, ldb = d.a.ld, d.b.ld
        if d.b.kind in ("array_t", "in_place_t"):  # b by columns: a dot product along K per element
            self.emit(f"tf_dot_nt<{m}, {n}, {k}, {lda}, {'true' if d.zero else 'false'}, {ldb}>({a}, {b}, {d.out});",
                      ind)
        elif d.block is not None:
            flag = ", true" if d.zero else ""
            if (lda, ldb) == (k, n):
                self.emit(f"tf_dot_rb<{m}, {n}, {k}, {d.block[0]}, {d.block[1]}{flag}>({a}, {b}, {d.out});", ind)
            else:
                self.emit(f"tf_dot_rb_ld<{m}, {n}, {k}, {d.block[0]}, {d.block[1]}, {lda}, {ldb}{flag}>({a}, {b}, "
                          f"{d.out});", ind)
        else:
            if d.zero:
                self.emit(f"for (int64_t tf_i = 0; tf_i < {m * n}; ++tf_i) {d.out}[tf_i] = 0;", ind)
            self.emit(f"tf_dot_ikj<{m}, {n}, {k}>({a}, {b}, {d.out});", ind)
        self.emit("}", indent)

    def operand(self, o: Operand, acc_t, ind: int) -> str:
        """The pointer the dot reads `o` from (printing the dense copy it needs first)."""
        t = ctype(acc_t)
        if o.kind in ("in_place", "in_place_t"):
            p = self.printer()
            where = f"&ptr_{o.load.buffer}[{p.expr(o.expr)}]"
            if o.load.mask is None:
                return where
            # a mask equal in every lane (`lanes.py`) that fails: zeros over the tile's extent
            rows, cols = o.shape
            extent = zeros_extent(o.kind == "in_place_t", o.ld, rows, cols)
            zeros = self.fresh("zeros")
            self.emit(f"static const float {zeros}[{extent}] = {{}};", ind)
            return f"(({p.expr(o.load.mask)}) ? {where} : {zeros})"
        if o.kind in ("array", "array_t"):
            return o.name
        p = ExprPrinter(self.ref_in(("tf_i", "tf_j"), set()))
        elem = f"ptr_{o.load.buffer}[{p.expr(o.load.offset)}]" if o.kind == "copy_load" else p.expr(o.expr)
        name = self.fresh("op")
        rows, cols = o.shape
        self.emit(f"alignas(64) {t} {name}[{rows * cols}];", ind)
        self.emit(f"for (int64_t tf_i = 0; tf_i < {rows}; ++tf_i) for (int64_t tf_j = 0; tf_j < {cols}; ++tf_j) "
                  f"{name}[tf_i * {cols} + tf_j] = ({t})({elem});", ind)
        return name

    # ------------------------------------------------------------------ the kernel
    def declarations(self, indent: int) -> None:
        for name in self.plan.arrays:
            shape = self.sh.shape[name]
            t = ctype(self.sh.dtype[name])
            size = shape[0] * shape[1]
            if name in self.sh.aranges or size == 1:
                self.emit(f"{t} {name};", indent)
            else:  # bool arrays as bytes: GCC 12 miscompiles masked AVX-512 stores driven by bool arrays
                self.emit(f"alignas(64) {'uint8_t' if t == 'bool' else t} {name}[{size}];", indent)
        for s in self.plan.arg_values:  # column reductions of argmax keep their values too
            shape = self.sh.shape[s.name]
            size = shape[0] * shape[1]
            self.emit(f"{ctype(s.value.dtype)} {s.name}_cv" + (f"[{size}];" if size > 1 else ";"), indent)

    def bound_masks(self) -> tuple[int, dict]:
        """(n, {mask: the C++ condition under which it holds for the whole block}): the masks
        `bound_check` makes of the aranges among the program's first `n` items (its program ids
        and aranges), where those conditions can be tested before the rest runs."""
        items = self.plan.items
        n = 0
        while n < len(items) and isinstance(items[n], Single) and \
                isinstance(items[n].stmt, (ProgramId, Arange, Comment)):
            n += 1
        aranges = {it.stmt.name: it.stmt for it in items[:n] if isinstance(it.stmt, Arange)}
        body = list(statements(self.plan.kernel.body))
        if any(isinstance(st, DotTile) for st in body):
            return n, {}  # (products plan their ragged tiles themselves; twice their code would cost compile time)
        p = self.printer()
        out = {}
        for st, x, extent in self._bound_lets(set(aranges)):
            try:
                out[st.name] = f"({x.name} + {aranges[x.name].block} <= {p.index(extent)})"
            except CppUnsupported:
                continue
        return n, out

    def _bound_lets(self, aranges: set):
        """(let, arange, extent) for each bound mask `arange < extent` of the kernel over one of
        `aranges` (names), the extent a function of the sizes alone."""
        sizes = {q.name for q in self.plan.kernel.params if q.kind == "size"}
        for st in statements(self.plan.kernel.body):
            v = getattr(st, "value", None)
            if not (isinstance(st, Let) and isinstance(v, Binary) and v.op == "lt" and isinstance(v.a, Index)
                    and isinstance(v.b, Index)):
                continue
            x, extent = sympy.sympify(v.a.expr), sympy.sympify(v.b.expr)
            if x.is_Symbol and x.name in aranges and all(sym.name in sizes for sym in extent.free_symbols):
                yield st, x, extent

    def row_bounds(self) -> dict:
        """{mask: (arange, extent)} for each bound mask along a row (`arange + j < extent`, the
        arange along the tile's second axis, the extent a function of the sizes alone), as C++
        (`NestPrinter.peeled_masks`)."""
        if self._row_bounds is not None:
            return self._row_bounds
        along_rows = {st.name for st in statements(self.plan.kernel.body)
                      if isinstance(st, Arange) and self.sh.aranges.get(st.name) == 1}
        p = self.printer()
        out = {}
        for st, x, extent in self._bound_lets(along_rows):
            try:
                out[st.name] = (x.name, p.index(extent))
            except CppUnsupported:
                continue
        self._row_bounds = out
        return out

    def function(self) -> str:
        """The kernel's `extern "C"` function (after the prelude that `_prelude` prints)."""
        k = self.plan.kernel
        n, masks = self.bound_masks()
        if masks:
            self.items(self.plan.items[:n], 3)
            head, self.lines = self.lines, []
            self.whole = frozenset(masks)
            self.items(self.plan.items[n:], 4)
            whole, self.lines = self.lines, []
            self.whole = frozenset()
            self.items(self.plan.items[n:], 4)
            body = head + [f"      if ({' && '.join(masks.values())}) {{"] + whole + ["      } else {"] + \
                self.lines + ["      }"]
        else:
            self.items(self.plan.items, 3)
            body = self.lines
        self.lines = []
        out = []
        # The programs [tf_begin, tf_end) on the calling thread: what a graph's run of kernels
        # (`fast_call`'s `run_steps`) calls inside its one parallel region; the kernel's own
        # entry below spreads its programs over threads through it.
        out.append(f'extern "C" void __attribute__((noinline)) {k.name}{RANGE_SUFFIX}(void* const* tf_ptrs, '
                   f'const int64_t* tf_sizes, const int64_t* tf_grid, int64_t tf_begin, int64_t tf_end) {{')
        for name, v in k.constexprs.items():
            out.append(f"  constexpr int64_t {name} = {int(v)};")
        nb = 0
        for q in k.params:
            if q.kind == "buffer":
                out.append(f"  {STORAGE[q.dtype.name]}* __restrict__ ptr_{q.name} = "
                           f"({STORAGE[q.dtype.name]}*)tf_ptrs[{nb}];")
                nb += 1
        if self.plan.check_ids:  # the error word: after the buffers
            out.append(f"  int64_t* tf_err = (int64_t*)tf_ptrs[{nb}];")
        ns = 0
        for q in k.params:
            if q.kind == "size":
                out.append(f"  const int64_t {q.name} = tf_sizes[{ns}];")
                ns += 1
        out.append("  (void)tf_sizes;")
        out.append("  const int64_t tf_g0 = tf_grid[0], tf_g1 = tf_grid[1];")
        out.append("  for (int64_t tf_p = tf_begin; tf_p < tf_end; ++tf_p) {")
        out.append("    const int64_t tf_pid0 = tf_p % tf_g0, tf_pid1 = (tf_p / tf_g0) % tf_g1, tf_pid2 = tf_p / (tf_g0 * tf_g1);")
        out.append("    (void)tf_pid0; (void)tf_pid1; (void)tf_pid2;")
        self.declarations(2)
        out.extend("  " + line for line in self.lines)
        out.append("    {")
        out.extend(body)
        out.append("    }")
        out.append("  }")
        out.append("}")
        out.append(f'extern "C" void {k.name}(void* const* tf_ptrs, const int64_t* tf_sizes, '
                   f'const int64_t* tf_grid, int32_t tf_threads) {{')
        out.append("  const int64_t tf_n = tf_grid[0] * tf_grid[1] * tf_grid[2];")
        out.append("  if (tf_n > 1 && tf_threads > 1) {  /* chunks of programs, about 8 per thread, taken as threads free up */")
        out.append("    const int64_t tf_chunk = tf_n / (8 * (int64_t)tf_threads) > 1 ? tf_n / (8 * (int64_t)tf_threads) : 1;")
        out.append("    #pragma omp parallel for schedule(dynamic) num_threads(tf_threads)")
        out.append("    for (int64_t tf_c = 0; tf_c < (tf_n + tf_chunk - 1) / tf_chunk; ++tf_c)")
        out.append(f"      {k.name}{RANGE_SUFFIX}(tf_ptrs, tf_sizes, tf_grid, tf_c * tf_chunk, "
                   "tf_c * tf_chunk + tf_chunk < tf_n ? tf_c * tf_chunk + tf_chunk : tf_n);")
        out.append("  } else {")
        out.append(f"    {k.name}{RANGE_SUFFIX}(tf_ptrs, tf_sizes, tf_grid, 0, tf_n);")
        out.append("  }")
        out.append("}")
        return "\n".join(out) + "\n"


#: planned item -> its printer
_ITEM = {Nest: NestPrinter.nest, Loop: CppPrinter.loop, DotPlan: CppPrinter.dot, Single: CppPrinter.single}
#: statement printed on its own -> its printer
_SINGLE = {ProgramId: CppPrinter._program_id, Arange: CppPrinter._arange, Comment: CppPrinter._comment,
           Check: CppPrinter._check, Let: CppPrinter._scalar, LoadTile: CppPrinter._scalar,
           BroadcastTile: CppPrinter._scalar, Full: CppPrinter._scalar, Assign: CppPrinter._scalar,
           StoreTile: CppPrinter._scalar}
#: statement -> the C++ of one of its elements
_ELEMENT = {StoreTile: CppPrinter._store, Check: CppPrinter._check_element, Assign: CppPrinter._assign,
            Let: CppPrinter._let, BroadcastTile: CppPrinter._let, Full: CppPrinter._full, LoadTile: CppPrinter._load}


#: the suffix of a kernel's function that runs a range of its programs on the calling thread
RANGE_SUFFIX = "__programs"


_FAIL = r"""
/* a failed index check: its number goes to the error word (any one of several is reported) */
TF_INLINE void tf_fail(int64_t* err, int64_t code) { __atomic_store_n(err, code, __ATOMIC_RELAXED); }
"""


def _prelude(checks: bool) -> str:
    return "\n".join([HEADER, DOT_SOURCE] + ([_FAIL] if checks else [])) + "\n"


def generate(kernel: TileKernel) -> str:
    """The C++ source of one kernel, with its size variants (`tile.variants`) after it in the
    same library (raises `CppUnsupported` for what it cannot print)."""
    printers = [CppPrinter(plan_kernel(k)) for k in all_kernels(kernel)]
    functions = [p.function() for p in printers]
    return _prelude(any(p.plan.check_ids for p in printers)) + "".join(functions)


__all__ = ["generate", "CppUnsupported", "round_to", "RANGE_SUFFIX"]
