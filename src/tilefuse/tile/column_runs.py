"""Pointwise kernels that select on their innermost column, walked one run of columns at a time.

`torch.cat` and `torch.stack` along the last dim lower to `where(column < offset, a, b)`: each
output element picks one branch by its column. The flat walk evaluates that per lane, so a CPU
loop loads every branch's operands under masks (AVX2 gathers) and computes every branch
(`cat([x.sin(), y.cos()], -1)` runs both `sin` and `cos` on every element): gpt-fast's RoPE,
a `stack` of two rotated halves, ran 9× slower than Inductor's.

Here the columns of the innermost storage dim are split into runs over which every selection
that depends on the column alone has one value (`column_runs`: the selections are evaluated at
each column, so any spelling — `i < 24`, `i % 2 == 0`, nested `cat`s — is covered). The kernel
(`lower_column_runs`) takes a block of rows per program and, run after run, computes each
stage with those selections folded to their branch: the loads of a run are contiguous along
its columns (or strided, for a `stack`'s one-column runs, which share one loop over rows), and
only the branch the run keeps is computed. C++ targets only: a run's width is any integer,
where a Triton tile's extents are powers of two.
"""
from __future__ import annotations

import operator

import sympy

from ..fusion.plan import KernelPlan, StageKind
from ..ir.expr import (Binary, Const, Expr, Index, Load, Unary, Where, free_symbols,
                       out_index, transform, walk)
from ..ir.graph import Graph
from ..passes.fold import fold_expr
from .builder import KernelBuilder
from .common import (LoweringOptions, bound_check, index_values, mapped, needs_int64, static_int, tile_symbol,
                     uniform_layout)
from .ir import Arange, KernelKind, ProgramId, TileKernel

#: the widest innermost dim whose columns are examined one by one
MAX_COLUMNS = 4096
#: the most runs a kernel is split into (each is a loop of its own in the generated code)
MAX_RUNS = 16

_COMPARE = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le, "gt": operator.gt,
            "ge": operator.ge, "logical_and": lambda a, b: bool(a) and bool(b),
            "logical_or": lambda a, b: bool(a) or bool(b), "logical_xor": lambda a, b: bool(a) != bool(b),
            "add": operator.add, "sub": operator.sub, "mul": operator.mul,
            "mod": operator.mod, "floordiv": operator.floordiv}  # (torch's remainder and floor division)


class _Undecided(Exception):
    """The expression's value at a column is not a constant (it reads data or other dims)."""


def _at_column(e: Expr, symbol: sympy.Symbol, column: int):
    """The value of an index-only expression at `column` of the innermost dim."""
    if isinstance(e, Const):
        return e.value
    if isinstance(e, Index):
        v = sympy.sympify(e.expr).xreplace({symbol: sympy.Integer(column)})
        if v is sympy.true or v is sympy.false:
            return bool(v)
        if not v.is_Integer:
            raise _Undecided
        return int(v)
    if isinstance(e, Binary) and e.op in _COMPARE:
        return _COMPARE[e.op](_at_column(e.a, symbol, column), _at_column(e.b, symbol, column))
    if isinstance(e, Unary) and e.op == "logical_not":
        return not _at_column(e.x, symbol, column)
    raise _Undecided


def _column_selections(bodies, symbol: sympy.Symbol) -> list[Expr]:
    """The conditions of `where`s in `bodies` that depend on the innermost column alone."""
    found = []
    for body in bodies:
        for e in walk(body):
            if isinstance(e, Where) and e.cond not in found and free_symbols(e.cond) == {symbol} and \
                    all(isinstance(n, (Const, Index, Binary, Unary)) for n in walk(e.cond)) and \
                    all(n.op in _COMPARE for n in walk(e.cond) if isinstance(n, Binary)):
                found.append(e.cond)
    return found


def column_runs(graph: Graph, plan: KernelPlan, options: LoweringOptions):
    """(order, runs, selections) when `plan` should be walked a run of columns at a time, else
    None: `order` the output's dims in storage order (the last is the column dim), `runs` the
    (start, stop, values) of each run with `values` the selections' value over it."""
    if not options.target.on_cpu or not plan.stages:
        return None
    if any(st.kind != StageKind.POINTWISE or not st.store for st in plan.stages):
        return None
    layout = uniform_layout(graph, plan.stages, plan.parallel)
    if layout is None:
        return None
    shape, order = layout
    stage_nodes = {st.node for st in plan.stages}
    if any(isinstance(e, Load) and e.buffer in stage_nodes for st in plan.stages for e in walk(st.body)):
        return None  # a stage reading another's result from memory: keep the element order
    width = static_int(shape[order[-1]])
    if width is None or not 2 <= width <= MAX_COLUMNS:
        return None
    symbol = out_index(len(shape))[order[-1]]
    selections = _column_selections([st.body for st in plan.stages], symbol)
    if not selections:
        return None
    runs: list = []
    try:
        for column in range(width):
            values = tuple(bool(_at_column(c, symbol, column)) for c in selections)
            if runs and runs[-1][2] == values:
                runs[-1][1] = column + 1
            else:
                runs.append([column, column + 1, values])
    except (_Undecided, TypeError, ZeroDivisionError):
        return None
    if not 2 <= len(runs) <= MAX_RUNS:
        return None
    return order, [tuple(r) for r in runs], selections


def _fold_selections(body: Expr, selections: list, values: tuple) -> Expr:
    """`body` with each column selection replaced by its value over one run, then folded."""
    table = dict(zip(selections, values))

    def fn(node):
        if isinstance(node, Where) and node.cond in table:
            return Where(Const(table[node.cond], node.cond.dtype), node.a, node.b, node.dtype)
        return None

    return fold_expr(transform(body, fn))


def _rows_per_program(rows, width: int, block: int) -> int:
    """A power of two of rows per program, about `block` elements, that divides a static row
    count where one does (no bound mask then)."""
    per = 1
    while per * 2 * width <= block:
        per *= 2
    n = static_int(rows)
    if n is not None:
        per = min(per, 1 << max(0, (n.bit_length() - 1)))
        while per > 1 and n % per:
            per //= 2
    return per


def _middle_dim(shape, order, runs) -> int | None:
    """The dim a `stack`'s one-column runs vectorise along: the next inner dim in storage
    order, when it has a static extent of at least 4 and a row of both dims stays within
    MAX_COLUMNS elements (else they walk rows one by one)."""
    if any(stop - start != 1 for start, stop, _ in runs) or len(order) < 2:
        return None
    extent = static_int(shape[order[-2]])
    ok = extent is not None and 4 <= extent and extent * len(runs) <= MAX_COLUMNS
    return order[-2] if ok else None


def lower_column_runs(graph: Graph, plan: KernelPlan, options: LoweringOptions, tiling: tuple,
                      block: int) -> TileKernel:
    """The kernel of `plan` over [YBLOCK rows, columns] tiles, one run of columns after another.

    Runs of several columns vectorise along their columns (one loop per run). Runs of one
    column each (a `stack` along a new last dim) share one loop along the next inner dim,
    storing every run's element per iteration: interleaved stores the compiler packs."""
    order, runs, selections = tiling
    shape = graph[plan.stages[0].node].shape
    rank = len(shape)
    width = static_int(shape[order[-1]])
    middle = _middle_dim(shape, order, runs)
    inner = width * (static_int(shape[middle]) if middle is not None else 1)
    outer_dims = order[:-2] if middle is not None else order[:-1]
    n = plan.parallel
    rows = sympy.sympify(n) / inner
    per_program = _rows_per_program(rows, inner, block)
    b = KernelBuilder(graph, plan.name, options.divisor_checks)
    b.tile_symbols |= {"pid", "yindex", "cindex"} | {f"cindex{k}" for k in range(len(runs))}
    b.size_params(n)
    b.emit(ProgramId("pid", 0, wide=needs_int64(n)))
    y = tile_symbol("yindex")
    b.emit(Arange("yindex", Index(tile_symbol("pid") * tile_symbol("YBLOCK")), "YBLOCK", 0, 2))
    ymask = bound_check(b, y, rows, per_program, "ymask")
    outer = index_values(tuple(shape[d] for d in outer_dims), y, {y: rows})
    constexprs = {"YBLOCK": per_program}
    if middle is not None:
        constexprs["CBLOCK"] = static_int(shape[middle])
        b.emit(Arange("cindex", Index(sympy.Integer(0)), "CBLOCK", 1, 2))
    symbols = out_index(rank)
    for k, (start, stop, values) in enumerate(runs):
        vals = [None] * rank
        for d, v in zip(outer_dims, outer):
            vals[d] = v
        if middle is not None:
            vals[middle], vals[order[-1]] = tile_symbol("cindex"), sympy.Integer(start)
        else:
            name, extent = f"cindex{k}", f"C{k}BLOCK"
            constexprs[extent] = stop - start
            b.emit(Arange(name, Index(sympy.Integer(start)), extent, 1, 2))
            vals[order[-1]] = tile_symbol(name)
        for st in plan.stages:
            node = graph[st.node]
            body = _fold_selections(st.body, selections, values)
            v = b.value(mapped(body, symbols, vals), mask=ymask)
            b.store(node.name, tuple(Index(e) for e in vals), v, ymask)
    return TileKernel(plan.name, b.finish_params(), constexprs, numel=n,
                      grid=(sympy.ceiling(rows / tile_symbol("YBLOCK")),), body=b.body, num_warps=1,
                      reads=b.reads, writes=b.writes, kind=KernelKind.POINTWISE, plan=plan,
                      exact_extents=frozenset(name for name in constexprs if name != "YBLOCK"))


__all__ = ["column_runs", "lower_column_runs", "MAX_COLUMNS", "MAX_RUNS"]
