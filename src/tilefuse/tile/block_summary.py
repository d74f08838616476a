"""Block summaries of masks read from tensor data: which key tiles each block of query rows
must visit, computed at run time.

When an attention kernel's mask (`fusion.masking`) reads data — nanoGPT's `tril` buffer,
gpt-fast's causal mask gathered by `input_pos`, Hugging Face's padding masks — no formula
bounds its live keys at compile time. A small generated pre-kernel (`lower_summary`), one
program per block of query rows (and per batch element the mask depends on), evaluates the
mask once over every tile and writes two lists of key tiles: *partial* tiles (masked in
places: the flash kernel evaluates the mask there) and *full* tiles (masked nowhere: the flash
kernel drops the mask), as tile indices. Tiles masked throughout are in neither list and are never visited.
The flash kernel walks the lists, so it neither branches per tile nor reads
the mask on full tiles; the summary is recomputed on every call, from the same data the flash
kernel reads, so it is never stale.

A finite fill (`finfo.min`) is not -inf: a query row masked everywhere averages every key in
eager. Unless every row provably keeps a live key, the pre-kernel also records, per block of
rows, whether one of its rows has none; that block then walks every key with the mask
(`counts[..., 2]`), exactly as it would without a summary.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from ..fusion.plan import KernelPlan, StageKind
from ..fusion.planner import unravel_sym
from ..ir import dtypes as dt
from ..ir.expr import Const, Expr, Index, Load, Var, binary, cast, out_index, red_index, walk, where
from ..ir.graph import Graph
from ..ir.monoid import MIN, SUM
from .builder import KernelBuilder, land, tile_symbol
from .common import LoweringOptions, bound_check, needs_int64
from .ir import Assign, Arange, For, Full, KernelKind, ProgramId, ReduceTile, Scratch, TileKernel

#: counts[..., k]: k = 0 partial tiles listed, 1 full tiles listed, 2 walk every key (a row of
#: the block may have no live key under a finite fill)
PARTIAL, FULL, EVERY = 0, 1, 2


@dataclass(frozen=True)
class BlockSummary:
    """What the pre-kernel computes for one flash plan, with the tiles it was lowered for."""

    cond: Expr  # where the scores are masked, in the output contraction's coordinates
    fallback: bool  # a row may have no live key (finite fill): record it per block of rows
    positions: tuple  # positions in the contraction's batch dims that the mask depends on
    batch: tuple  # their extents
    rows: object  # M
    keys: object  # N
    bm: int
    bn: int
    plan_name: str

    @property
    def names(self) -> tuple:
        return (f"{self.plan_name}_tiles_partial", f"{self.plan_name}_tiles_full", f"{self.plan_name}_tile_counts")

    def scratch(self) -> dict:
        nbatch = sympy.Mul(*self.batch) if self.batch else sympy.Integer(1)
        row_blocks = sympy.ceiling(sympy.sympify(self.rows) / self.bm)
        key_tiles = sympy.ceiling(sympy.sympify(self.keys) / self.bn)
        partial, full, counts = self.names
        # (one slot more than the tiles: a loop that reads its next entry ahead stays inside)
        return {partial: Scratch(partial, (nbatch, row_blocks, key_tiles + 1), dt.int32),
                full: Scratch(full, (nbatch, row_blocks, key_tiles + 1), dt.int32),
                counts: Scratch(counts, (nbatch, row_blocks, sympy.Integer(3)), dt.int32)}

    def batch_index(self, batch_vals) -> sympy.Expr:
        """The summary's batch row for a flash program whose batch coordinates are
        `batch_vals` (one per batch dim of the contraction): the mask's own dims, row-major."""
        flat = sympy.Integer(0)
        for p, extent in zip(self.positions, self.batch):
            flat = flat * sympy.sympify(extent) + sympy.sympify(batch_vals[p])
        return flat


def summary_for(graph: Graph, plan: KernelPlan, options: LoweringOptions, splits: int, bm: int, bn: int,
                diagonal_live: bool) -> BlockSummary | None:
    """The block summary a flash kernel walks, or None: no mask, a mask that is an index
    formula only (its bounds are static: `fusion.masking.live_key_range`), some reduction
    that needs the masked keys (`FlashInfo.skippable`), a split kernel (decode), or the
    `block_summary` knob off. `diagonal_live`: every row provably keeps a live key."""
    from ..fusion.masking import mask_and_fill

    info = plan.flash
    if not options.block_summary or splits > 1 or info.masked is None or not info.skippable:
        return None
    cond, fill = mask_and_fill(info.masked)
    if cond is None or not any(isinstance(e, Load) for e in walk(cond)):
        return None
    con = plan.contraction
    o_node = graph[next(st.node for st in plan.stages if st.kind == StageKind.CONTRACTION)]
    outs = out_index(o_node.rank)
    used = set()
    for e in walk(cond):
        if isinstance(e, Index):
            used |= sympy.sympify(e.expr).free_symbols
    positions = tuple(p for p, d in enumerate(con.batch_dims) if outs[d] in used)
    batch = tuple(o_node.shape[con.batch_dims[p]] for p in positions)
    return BlockSummary(cond, fill != float("-inf") and not diagonal_live, positions, batch,
                        o_node.shape[con.m_dim], o_node.ranges[0], bm, bn, plan.name)


def lower_summary(graph: Graph, plan: KernelPlan, options: LoweringOptions, summary: BlockSummary) -> TileKernel:
    """The pre-kernel: for each block of query rows (axis 0) and batch element of the mask
    (axis 1), walk the key tiles the static bounds leave, classify each (dead, partial, full)
    by reducing the mask over the tile, and append it to its list."""
    from .flash import _coordinates, _live_keys

    info, con = plan.flash, plan.contraction
    o_node = graph[next(st.node for st in plan.stages if st.kind == StageKind.CONTRACTION)]
    M, N, bm, bn = summary.rows, summary.keys, summary.bm, summary.bn
    name = f"{plan.name}_summary"
    b = KernelBuilder(graph, name, options.divisor_checks)
    b.scratch.update(summary.scratch())
    b.tile_symbols |= {"pid", "pid_b", "rm", "rj", "joffset", "BLOCK_M", "BLOCK_N"}
    for e in (M, N, *summary.batch):
        b.size_params(e)
    wide = needs_int64(M, N, *summary.batch)
    b.emit(ProgramId("pid", 0, wide=wide))
    b.emit(ProgramId("pid_b", 1, wide=wide))
    pid, pid_b, rm, rj = (tile_symbol(n) for n in ("pid", "pid_b", "rm", "rj"))
    b.emit(Arange("rm", Index(pid * tile_symbol("BLOCK_M")), "BLOCK_M", 0, 2))
    batch_vals = [sympy.Integer(0)] * len(con.batch_dims)
    for p, v in zip(summary.positions, unravel_sym(pid_b, summary.batch) if summary.batch else ()):
        batch_vals[p] = v
    _, at = _coordinates(con, o_node, tuple(batch_vals))
    outs = out_index(o_node.rank)
    (r0,) = red_index(1)
    m_ok = bound_check(b, rm, M, bm, "mmask")

    i32 = dt.int32
    one, zero = Const(1, i32), Const(0, i32)
    counts = {k: Var(b.fresh(label), i32) for k, label in ((PARTIAL, "npartial"), (FULL, "nfull"))}
    for v in counts.values():
        b.emit(Full(v.name, (1, 1), 0, i32))
    row_live = Var(b.fresh("rowlive"), i32) if summary.fallback else None
    if row_live is not None:
        b.emit(Full(row_live.name, ("BLOCK_M", 1), 0, i32))

    start, stop = _live_keys(info, outs[con.m_dim], r0, M, N)
    loop = For("joffset", Index(start), Index(stop), "BLOCK_N")
    b.emit(loop)
    b.push_block(loop.body)
    b.emit(Arange("rj", Index(tile_symbol("joffset")), "BLOCK_N", 1, 2))
    j_ok = bound_check(b, rj, N, bn, "jmask")
    inside = land(m_ok, j_ok)
    masked = b.value(at(summary.cond, rm, 0, rj), mask=inside)
    if not masked.dtype.is_bool:
        masked = b.let(binary("ne", masked, Const(0, masked.dtype)), "masked")

    # one sum tells both facts: a tile's masked scores count in units of 1, its live ones in
    # units of `per_live`, more than the masked ones can add up to (two reductions, not four)
    per_live = bm * bn + 1
    acc = dt.int32 if per_live * per_live < 2**31 else dt.int64
    unit = b.let(where(masked, Const(1, acc), Const(per_live, acc)), "unit")
    if inside is not None:
        unit = b.let(where(inside, unit, Const(0, acc)), "unit")
    per_row, total = b.fresh("per_row"), b.fresh("total")
    b.emit(ReduceTile(per_row, unit, SUM.tile, 1, acc))
    b.emit(ReduceTile(total, Var(per_row, acc), SUM.tile, 0, acc))
    total = Var(total, acc)
    live_any = b.let(where(binary("ge", total, Const(per_live, acc)), one, zero), "live_any")
    dead_any = b.let(where(binary("gt", binary("mod", total, Const(per_live, acc)), Const(0, acc)), one, zero),
                     "dead_any")
    if row_live is not None:
        live_rows = where(binary("ge", Var(per_row, acc), Const(per_live, acc)), one, zero)
        b.emit(Assign(row_live.name, binary("maximum", row_live, live_rows)))
    # the lists hold tile indices: the kernel that reads one multiplies it by BLOCK_N, so the
    # compiler knows each tile's first key is a multiple of the block (aligned, vector loads)
    positive_block = sympy.Symbol("BLOCK_N", integer=True, positive=True)
    tile = Index(sympy.floor(tile_symbol("joffset") / positive_block))
    kinds = {PARTIAL: b.let(binary("mul", live_any, dead_any), "partial"),
             FULL: b.let(binary("mul", live_any, binary("sub", one, dead_any)), "full")}
    for k, listed in zip((PARTIAL, FULL), summary.names[:2]):
        b.store(listed, (Index(pid_b), Index(pid), counts[k]), tile, binary("gt", kinds[k], zero))
        b.emit(Assign(counts[k].name, binary("add", counts[k], kinds[k])))
    b.pop_block()

    every = zero
    if row_live is not None:  # a row of the block (inside the rows) without a live key
        held = b.let(where(m_ok, row_live, one) if m_ok is not None else row_live, "held")
        fewest = b.fresh("fewest")
        b.emit(ReduceTile(fewest, held, MIN.tile, 0, i32))
        every = b.let(binary("sub", one, Var(fewest, i32)), "every")
    counts_name = summary.names[2]
    for k in (PARTIAL, FULL):
        value = counts[k] if every is zero else binary("mul", counts[k], binary("sub", one, every))
        b.store(counts_name, (Index(pid_b), Index(pid), Index(sympy.Integer(k))), value, None)
    b.store(counts_name, (Index(pid_b), Index(pid), Index(sympy.Integer(EVERY))), every, None)
    nbatch = sympy.Mul(*summary.batch) if summary.batch else sympy.Integer(1)
    return TileKernel(name, b.finish_params(), {"BLOCK_M": bm, "BLOCK_N": bn}, numel=M * N * nbatch,
                      grid=(sympy.ceiling(M / tile_symbol("BLOCK_M")), nbatch), body=b.body, num_warps=4,
                      num_stages=1 if options.target.on_cpu else 3, reads=b.reads, writes=b.writes,
                      kind=KernelKind.BLOCK_SUMMARY, plan=plan,
                      scratch=summary.scratch())


def listed_tile(b: KernelBuilder, summary: BlockSummary, listed: str, batch_row, position) -> Expr:
    """The index of the key tile at `position` of a list, as int64 (its first key is the index
    times BLOCK_N)."""
    pid = tile_symbol("pid")
    return cast(b.value(Load(listed, (Index(batch_row), Index(pid), Index(position)), dt.int32)), dt.int64)


def listed_count(b: KernelBuilder, summary: BlockSummary, batch_row, k: int) -> Expr:
    pid = tile_symbol("pid")
    return b.value(Load(summary.names[2], (Index(batch_row), Index(pid), Index(sympy.Integer(k))), dt.int32))


__all__ = ["BlockSummary", "summary_for", "lower_summary", "listed_tile", "listed_count",
           "PARTIAL", "FULL", "EVERY"]
