"""A reduction walked run by run: a reduced axis flattened over several dims (a batch norm's
(N, H, W) per channel, a loss summed over a whole [rows, classes] tensor and split over the
threads) reads memory in contiguous runs of its inner dims, but a flat tile over it divides
every lane's position into coordinates and gathers.

Walked in runs of `RUN` elements — an outer loop over run starts `rbase` (multiples of RUN),
an inner one over tiles of the run (`rindex = rbase + roffset + lane`, masked at the run's
end) —, a position is `r = rbase + t` with `t` in `[0, RUN)`, so

    floor(r / C) = floor(rbase / C)          (RUN divides C)
    Mod(r, C)    = Mod(rbase, C) + t

and, where RUN is a whole run of the layout, a load's offset is a scalar per run plus `t`: a
contiguous read, and a value per run (a row's statistic) is read once per tile instead of
gathered lane by lane. `run_offset` rewrites an offset so (exactly, or leaves it as it was
where no such form exists); `run_length` finds, for a CPU's rules, the longest run in which
every load of a plan is contiguous.
"""
from __future__ import annotations

import weakref

import sympy

from ..ir.expr import Load, out_index, red_index, walk
from ..ir.symbolic import simplify_index
from .common import index_values

#: runs shorter than this are not worth a loop of their own (one AVX-512 vector)
MIN_RUN = 16
#: runs shorter than this are walked only where the flat walk divides twice (`run_length`)
SHORT_RUN = 64

_K = sympy.Symbol("tf_run_k", integer=True, nonnegative=True)
_T = sympy.Symbol("tf_run_t", integer=True, nonnegative=True)


def _lane_affine(e: sympy.Expr, t: sympy.Symbol) -> bool:
    """Whether `e` is `c·t + rest` with an integer `c` and `rest` free of `t`."""
    e = sympy.expand(e)
    coeff = e.coeff(t)
    return bool(coeff.is_Integer) and t not in sympy.expand(e - coeff * t).free_symbols


def _in_runs(expr: sympy.Expr, r: sympy.Symbol, run: int, extent, ranges: dict) -> sympy.Expr | None:
    """`expr` (over the flat position `r` < `extent`) over the run's number `_K` and the
    position `_T` < `run` in it, when that makes it affine in `_T`; else None."""
    runs = sympy.ceiling(sympy.sympify(extent) / run)
    e = simplify_index(sympy.expand(sympy.sympify(expr).subs(r, run * _K + _T)),
                       {**ranges, _K: runs, _T: sympy.Integer(run)})
    return e if _lane_affine(e, _T) else None


def run_offset(offset: sympy.Expr, r: sympy.Symbol, rbase: sympy.Symbol, run: int, extent) -> sympy.Expr:
    """`offset` over the flat position `r = rbase + t` (`rbase` a multiple of `run`, `t` in
    `[0, run)`) rewritten as a scalar per run plus a multiple of `t`, where it can be."""
    offset = sympy.sympify(offset)
    if r not in offset.free_symbols or _lane_affine(offset, r):
        return offset
    found = _in_runs(offset, r, run, extent, {})
    if found is None:
        return offset
    return found.subs({_K: sympy.floor(rbase / run), _T: r - rbase})


def _offsets(graph, plan, r: sympy.Symbol, x: sympy.Symbol, extent, rows):
    """The offset of every load of the plan's stages that moves along the flat reduced position
    `r` (and the program's row `x`, for stages over the whole [rows, axis] space), with the
    strides the kernel will address it by (contiguous ones where they are known only at run
    time: the rewrite is exact whatever they are, only the choice of the run assumes them)."""
    from ..fusion.plan import StageKind
    from ..ir.symbolic import contiguous_strides
    from .builder import known_strides
    from .common import mapped

    ranges = {x: rows, r: extent}  # (as the lowering simplifies: `reduction._lower`)
    for st in plan.stages:
        node = graph[st.node]
        if st.kind == StageKind.REDUCE:
            xi = index_values(node.shape, x, ranges)
            ri = index_values(node.ranges, r, ranges)
            body = mapped(mapped(st.body, out_index(node.rank), xi), red_index(len(node.ranges)), ri)
        elif st.kind == StageKind.FULL:
            body = mapped(st.body, out_index(node.rank), index_values(node.shape, x * extent + r, ranges))
        else:
            continue
        for e in walk(body):
            if not (isinstance(e, Load) and e.buffer in graph.nodes):
                continue
            exprs = [getattr(c, "expr", None) for c in e.index]
            if None in exprs or not any(r in sympy.sympify(c).free_symbols for c in exprs):
                continue
            source = graph[e.buffer]
            strides = known_strides(graph, e.buffer, source) or contiguous_strides(source.shape)
            if len(strides) != len(exprs):
                continue
            yield sympy.expand(sum((sympy.sympify(c) * st for c, st in zip(exprs, strides)), sympy.Integer(0)))


def _nested_division(e: sympy.Expr) -> bool:
    """Whether a division or modulo of `e` divides the result of another."""
    return any(inner is not f and isinstance(inner, (sympy.floor, sympy.Mod))
               for f in e.atoms(sympy.floor, sympy.Mod) for inner in sympy.preorder_traversal(f.args[0]))


def _candidates(offsets, extent: int) -> list:
    """Run lengths to try, longest first: the divisions' and moduli's denominators and their
    products (H·W from W and H), and powers of two — those that divide the axis."""
    found = set()
    for c in offsets:
        for f in c.atoms(sympy.floor, sympy.Mod):
            d = f.args[0].as_numer_denom()[1] if isinstance(f, sympy.floor) else f.args[1]
            if d.is_Integer and int(d) > 1:
                found.add(int(d))
    lengths = set(found) | {d * e for d in found for e in found} | {1 << k for k in range(4, 13)}
    return sorted((n for n in lengths if MIN_RUN <= n < extent and extent % n == 0), reverse=True)


def run_length(graph, plan, extent: int, rows) -> int | None:
    """The longest run (from `MIN_RUN`, dividing the static axis length `extent`) in which
    every load of the plan's stages is contiguous (`run_offset`), where some load is not
    contiguous along the flat axis; None when none gathers or no run makes them all
    contiguous. `rows`: the count of the programs' rows. Remembered per graph (the rules are
    asked for a plan's schedule several times: its space, its lowering, its variants)."""
    key = (id(graph), tuple((st.node, st.kind, st.body) for st in plan.stages), extent, rows)
    found = _FOUND.get(key)
    if found is not None and found[0]() is graph:
        return found[1]
    if len(_FOUND) >= _FOUND_LIMIT:
        _FOUND.clear()
    answer = _run_length(graph, plan, extent, rows)
    _FOUND[key] = (weakref.ref(graph), answer)
    return answer


#: (graph's id, stages, extent, rows) -> (a reference to the graph, run_length's answer); the
#: reference tells a graph from a later one at the same address
_FOUND: dict = {}
_FOUND_LIMIT = 4096


def _run_length(graph, plan, extent: int, rows) -> int | None:
    r = sympy.Symbol("tf_run_r", integer=True, nonnegative=True)
    x = sympy.Symbol("tf_run_x", integer=True, nonnegative=True)
    ranges = {x: rows, r: extent}
    gathers = [simplify_index(c, ranges) for c in dict.fromkeys(_offsets(graph, plan, r, x, extent, rows))]
    gathers = [c for c in gathers if not _lane_affine(c, r)]
    if not gathers:
        return None
    # (a short run pays only where a gathered load moves along it — a plane's elements, read
    # at `floor(r / (H·W))` and `r mod (H·W)` — or divides twice: a value per row of 17, read
    # at `floor(r / 17)` and the same along the run, summed 1.8× slower run by run than flat)
    nested = any(_nested_division(c) for c in gathers)
    for run in _candidates(gathers, extent):
        found = [_in_runs(c, r, run, extent, {x: rows}) for c in gathers]
        if any(f is None for f in found):
            continue
        moving = any(sympy.expand(f).coeff(_T) != 0 for f in found)
        if run < SHORT_RUN and not (nested or moving):
            continue
        return run
    return None


__all__ = ["run_offset", "run_length", "MIN_RUN"]
