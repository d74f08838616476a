"""Block summaries of masks read from tensor data: which key tiles each block of query rows
must visit, computed at run time.

When an attention kernel's mask (`fusion.masking`) reads data — nanoGPT's `tril` buffer,
gpt-fast's causal mask gathered by `input_pos`, Hugging Face's padding masks — no formula
bounds its live keys at compile time. Two small generated kernels run before the flash kernel:

- `<plan>_summary` (`lower_classify`), one program per (block of query rows, key tile, batch
  element the mask depends on), evaluates the mask over its tile once and writes the tile's
  class: dead (masked throughout), partial, or full (masked nowhere);
- `<plan>_ranges` (`lower_ranges`), one program per block of rows, reduces its row of classes
  to four tile indices `lo <= flo <= fhi <= hi`: tiles outside [lo, hi) are dead, tiles in
  [flo, fhi) are full.

The flash kernel then walks [lo, flo) and [fhi, hi) with the mask and [flo, fhi) without it,
with the same loops as a mask that is a formula (aligned tile offsets, pipelined loads, no
branch per tile). For the masks models use (causal, sliding windows, padding) the live and the
full tiles are contiguous, and nothing dead is visited; otherwise (packed sequences) dead tiles
inside [lo, hi) are visited with the mask, still exact. The summary is recomputed from the
same data on every call, so it is never stale.

A finite fill (`finfo.min`) is not -inf: a query row masked everywhere averages every key in
eager. Unless every row provably keeps a live key, the classify kernel also records which rows
of its tile are live, and a block with a row live nowhere walks every key with the mask. A fill
that is finite and not extreme (PyTorch's -65504) masks only while the scores stay far above
it: the summary then carries a `ScoreGuard` (`tile.score_guard`), a run-time bound on the
scores that the flash kernel checks before it skips anything.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from ..fusion.plan import KernelPlan
from ..ir.symbolic import floordiv, unravel_sym
from ..ir import dtypes as dt
from ..ir.expr import Const, Expr, Index, Load, Var, binary, cast, out_index, walk, where
from ..ir.graph import Graph
from ..ir.monoid import MAX, MIN, SUM
from .builder import KernelBuilder, land, tile_symbol
from .common import LoweringOptions, bound_check, needs_int64, pow2, static_int
from .ir import Assign, Arange, For, Full, KernelKind, ProgramId, ReduceTile, Scratch, TileKernel

@dataclass(frozen=True)
class BlockSummary:
    """What the pre-kernel computes for one flash plan, with the tiles it was lowered for."""

    cond: Expr  # where the scores are masked, in the output contraction's coordinates
    fallback: bool  # a row may have no live key (finite fill): record it per block of rows
    positions: tuple  # positions in the contraction's batch dims that the mask depends on
    batch: tuple  # the extents of the mask's own batch coordinates (one per position)
    rows: object  # M
    keys: object  # N
    bm: int
    bn: int
    plan_name: str
    #: with a fill that masks only under a bound on the scores: the bound, and the extents of
    #: every batch dim of the contraction (the norms are kept per flash program)
    guard: object = None
    all_batch: tuple = ()
    #: per position, c where the mask reads that batch coordinate only as floor(x / c): a
    #: mask broadcast over heads whose batch dim is (batch · heads) is summarised per batch
    #: element, not per head
    divisors: tuple = ()

    @property
    def names(self) -> tuple:
        """(tile classes, ranges per block of rows, per-row liveness per tile)."""
        return (f"{self.plan_name}_tile_class", f"{self.plan_name}_tile_ranges", f"{self.plan_name}_row_live")

    @property
    def nbatch(self):
        return sympy.Mul(*self.batch) if self.batch else sympy.Integer(1)

    def scratch(self) -> dict:
        nbatch = self.nbatch
        row_blocks = sympy.ceiling(sympy.sympify(self.rows) / self.bm)
        classes, ranges, rows = self.names
        out = {classes: Scratch(classes, (nbatch, row_blocks, self.key_tiles), dt.int8),
               ranges: Scratch(ranges, (nbatch, row_blocks, sympy.Integer(4)), dt.int32)}
        if self.fallback:
            out[rows] = Scratch(rows, (nbatch, sympy.sympify(self.rows), self.key_tiles), dt.int8)
        if self.guard is not None:
            out.update(self.guard.scratch(self))
        return out

    @property
    def key_tiles(self):
        return sympy.ceiling(sympy.sympify(self.keys) / self.bn)

    def batch_index(self, batch_vals) -> sympy.Expr:
        """The summary's batch row for a flash program whose batch coordinates are
        `batch_vals` (one per batch dim of the contraction): the mask's own dims, row-major."""
        flat = sympy.Integer(0)
        for p, extent, c in zip(self.positions, self.batch, self._divisors):
            value = sympy.sympify(batch_vals[p])
            flat = flat * sympy.sympify(extent) + floordiv(value, c)
        return flat

    @property
    def _divisors(self) -> tuple:
        return self.divisors or (1,) * len(self.positions)

    def mask_batch_values(self, flat, rank: int) -> list:
        """The contraction's batch coordinates (`rank` of them) at which the classify program
        whose batch row is `flat` evaluates the mask: each of the mask's own coordinates times
        its divisor, the others 0."""
        vals = [sympy.Integer(0)] * rank
        own = unravel_sym(flat, self.batch) if self.batch else ()
        for p, v, c in zip(self.positions, own, self._divisors):
            vals[p] = v * c
        return vals


def summary_for(graph: Graph, plan: KernelPlan, options: LoweringOptions, bm: int, bn: int,
                diagonal_live: bool) -> BlockSummary | None:
    """The block summary a flash kernel walks, or None: no mask, a mask that is an index
    formula only (its bounds are static: `fusion.masking.live_key_range`), some reduction
    that needs the masked keys (`FlashInfo.skippable`), or the `block_summary` knob off (a
    split kernel, decode, asks for none). `diagonal_live`: every row provably keeps a live key."""
    from ..fusion.masking import FILL_LIMIT, mask_and_fill
    from .score_guard import guard_for

    info = plan.flash
    if not options.block_summary or info.masked is None or not info.skippable:
        return None
    # every mask with a fill at or below SOFT_FILL_LIMIT: the wholly live tiles drop them all
    # (`fusion.masking.unmasked`), so all of them decide the classes
    cond, fill = mask_and_fill(info.masked, soft=True)
    if cond is None or not any(isinstance(e, Load) for e in walk(cond)):
        return None
    if info.scores and fill != float("-inf"):
        # a product over recomputed scores (the attention backward) with a finite fill: a query
        # row masked throughout weighs every key 1/T, and in dKᵀ and dV those rows lie along the
        # loop, where the forward's per-row fallback (walk every key) does not reach: no skipping
        return None
    guard = None
    if fill > FILL_LIMIT:  # a fill that masks only while the scores stay far above it
        guard = guard_for(graph, plan, fill)
        if guard is None:
            return None
    members = {st.node for st in plan.stages}
    if any(isinstance(e, Load) and e.buffer in members for e in walk(cond)):
        return None  # a mask computed from the scores (kept in registers, never in memory)
    con = plan.contraction
    o_node = graph[plan.contraction_stage.node]
    outs = out_index(o_node.rank)
    used = set()
    for e in walk(cond):
        if isinstance(e, Index):
            used |= sympy.sympify(e.expr).free_symbols
    positions = tuple(p for p, d in enumerate(con.batch_dims) if outs[d] in used)
    divisors = tuple(batch_divisor(cond, outs[con.batch_dims[p]], o_node.shape[con.batch_dims[p]])
                     for p in positions)
    batch = tuple(sympy.sympify(o_node.shape[con.batch_dims[p]]) / c for p, c in zip(positions, divisors))
    summary = BlockSummary(cond, fill != float("-inf") and not diagonal_live, positions, batch,
                           o_node.shape[con.m_dim], o_node.ranges[0], bm, bn, plan.name, guard,
                           tuple(o_node.shape[d] for d in con.batch_dims), divisors)
    if summary.fallback:  # a byte per (row, key tile): bounded, else the mask is read per tile
        rows = summary.nbatch * sympy.sympify(summary.rows) * summary.key_tiles
        if static_int(rows) is None or static_int(rows) > ROW_LIVENESS_LIMIT:
            return None
    return summary


def batch_divisor(cond: Expr, symbol, extent) -> int:
    """The c > 1 such that `cond` reads batch coordinate `symbol` only as floor(symbol / c),
    with c dividing its (static) `extent`, else 1. Attention over (batch · heads) flattened
    into one dim reads a mask broadcast over the heads this way: its summary then has one row
    per batch element."""
    size = static_int(extent)
    if size is None:
        return 1
    divisors = set()
    exprs = []
    for e in walk(cond):
        if isinstance(e, Index):
            expr = sympy.sympify(e.expr)
            if symbol in expr.free_symbols:
                exprs.append(expr)
                for f in expr.atoms(sympy.floor):
                    coeff, rest = f.args[0].as_coeff_Mul()
                    if rest == symbol and coeff.is_Rational and coeff.p == 1 and coeff.q > 1:
                        divisors.add(int(coeff.q))
    if len(divisors) != 1:
        return 1
    c = divisors.pop()
    if size % c:
        return 1
    placeholder = sympy.Dummy("outer", integer=True, nonnegative=True)

    def outer(expr):  # floor(symbol / c), as whichever floor class built it
        return expr.xreplace({f: placeholder for f in expr.atoms(sympy.floor) if f.args[0] == symbol / c})

    if any(symbol in outer(expr).free_symbols for expr in exprs):
        return 1  # the coordinate is read some other way too
    return c


#: the largest per-row liveness scratch (bytes) a summary under a finite fill may take
ROW_LIVENESS_LIMIT = 64 << 20


def _builder(graph, plan, options, summary: BlockSummary, name: str, symbols: set):
    b = KernelBuilder(graph, name, options.divisor_checks)
    b.scratch.update(summary.scratch())
    b.tile_symbols |= symbols | {"BLOCK_M", "BLOCK_N", "BLOCK_T"}
    for e in (summary.rows, summary.keys, *summary.batch):
        b.size_params(e)
    return b


#: tile classes
DEAD, PARTIAL, FULL = 0, 1, 2


def lower_classify(graph: Graph, plan: KernelPlan, options: LoweringOptions, summary: BlockSummary,
                   coordinates, bounds: tuple) -> TileKernel:
    """One program per (block of rows, key tile, batch element of the mask): the mask over the
    tile, reduced to the tile's class (tiles outside the static `bounds` — the flash kernel's
    key range of the block, over `pid` — are dead), and with a finite fill each row's liveness
    in the tile. `coordinates(con, o_node, batch_vals)` binds the flash plan's coordinates."""
    con = plan.contraction
    o_node = graph[plan.contraction_stage.node]
    M, N, bm, bn = summary.rows, summary.keys, summary.bm, summary.bn
    b = _builder(graph, plan, options, summary, f"{plan.name}_summary", {"pid", "pid_k", "pid_b", "rm", "rj"})
    wide = needs_int64(M, N, *summary.batch)
    for name, axis in (("pid", 0), ("pid_k", 1), ("pid_b", 2)):
        b.emit(ProgramId(name, axis, wide=wide))
    pid, pid_k, pid_b, rm, rj = (tile_symbol(n) for n in ("pid", "pid_k", "pid_b", "rm", "rj"))
    b.emit(Arange("rm", Index(pid * tile_symbol("BLOCK_M")), "BLOCK_M", 0, 2))
    b.emit(Arange("rj", Index(pid_k * tile_symbol("BLOCK_N")), "BLOCK_N", 1, 2))
    batch_vals = summary.mask_batch_values(pid_b, len(con.batch_dims))
    _, at = coordinates(con, o_node, tuple(batch_vals))
    m_ok = bound_check(b, rm, M, bm, "mmask")
    j_ok = bound_check(b, rj, N, bn, "jmask")
    start, stop = bounds
    first = pid_k * tile_symbol("BLOCK_N")
    static = None
    if start != 0 or stop != N:
        static = b.let(binary("logical_and", binary("ge", Index(first), Index(start)),
                              binary("lt", Index(first), Index(stop))), "bounds")
    inside = land(land(m_ok, j_ok), static)
    masked = b.value(at(summary.cond, rm, 0, rj), mask=inside)
    if not masked.dtype.is_bool:
        masked = b.let(binary("ne", masked, Const(0, masked.dtype)), "masked")

    # one sum tells both facts: masked scores count in units of 1, live ones in units of
    # `per_live`, more than the masked ones can add up to
    per_live = bm * bn + 1
    acc = dt.int32 if per_live * per_live < 2**31 else dt.int64
    unit = b.let(where(masked, Const(1, acc), Const(per_live, acc)), "unit")
    if inside is not None:
        unit = b.let(where(inside, unit, Const(0, acc)), "unit")
    per_row, total = b.fresh("per_row"), b.fresh("total")
    b.emit(ReduceTile(per_row, unit, SUM.tile, 1, acc))
    b.emit(ReduceTile(total, Var(per_row, acc), SUM.tile, 0, acc))
    total = Var(total, acc)
    live_any = binary("ge", total, Const(per_live, acc))
    dead_any = binary("gt", binary("mod", total, Const(per_live, acc)), Const(0, acc))
    i8 = dt.int8
    kind = where(live_any, where(dead_any, Const(PARTIAL, i8), Const(FULL, i8)), Const(DEAD, i8))
    classes, _, rows = summary.names
    b.store(classes, (Index(pid_b), Index(pid), Index(pid_k)), b.let(kind, "kind"), None)
    if summary.fallback:
        live = b.let(where(binary("ge", Var(per_row, acc), Const(per_live, acc)), Const(1, i8), Const(0, i8)), "live")
        b.store(rows, (Index(pid_b), Index(rm), Index(pid_k)), live, m_ok)
    nbatch = summary.nbatch
    return TileKernel(b.name, b.finish_params(), {"BLOCK_M": bm, "BLOCK_N": bn}, numel=M * N * nbatch,
                      grid=(sympy.ceiling(M / tile_symbol("BLOCK_M")), summary.key_tiles, nbatch), body=b.body,
                      num_warps=4, num_stages=1, reads=b.reads, writes=b.writes, kind=KernelKind.BLOCK_SUMMARY,
                      plan=plan, scratch=summary.scratch())


def lower_ranges(graph: Graph, plan: KernelPlan, options: LoweringOptions, summary: BlockSummary) -> TileKernel:
    """One program per (block of rows, batch element of the mask): its row of tile classes
    reduced to `lo <= flo <= fhi <= hi` (live tiles within [lo, hi), full ones in [flo, fhi)
    when they are contiguous, else flo = fhi = lo); a block with a row live nowhere (finite
    fill) gets [0, tiles) with no full range."""
    M, bm = summary.rows, summary.bm
    b = _builder(graph, plan, options, summary, f"{plan.name}_ranges", {"pid", "pid_b", "rm", "rt", "toff"})
    wide = needs_int64(M, summary.key_tiles, *summary.batch)
    b.emit(ProgramId("pid", 0, wide=wide))
    b.emit(ProgramId("pid_b", 1, wide=wide))
    pid, pid_b, rm, rt = (tile_symbol(n) for n in ("pid", "pid_b", "rm", "rt"))
    tiles = summary.key_tiles
    static_tiles = static_int(tiles)
    # (at least 16 lanes: with one key tile a 1-lane range would fold away, leaving 0-d values)
    bt = max(16, min(pow2(static_tiles), 256)) if static_tiles is not None else 64
    i32 = dt.int32
    big = Const(2**30, i32)
    state = {}
    for label, value in (("lo", 2**30), ("hi", 0), ("flo", 2**30), ("fhi", 0), ("nfull", 0)):
        state[label] = Var(b.fresh(label), i32)
        b.emit(Full(state[label].name, (1, 1), value, i32))
    if summary.fallback:
        b.emit(Arange("rm", Index(pid * tile_symbol("BLOCK_M")), "BLOCK_M", 0, 2))
        row_live = Var(b.fresh("rowlive"), i32)
        b.emit(Full(row_live.name, ("BLOCK_M", 1), 0, i32))
    loop = For("toff", Index(sympy.Integer(0)), Index(tiles), "BLOCK_T")
    b.emit(loop)
    b.push_block(loop.body)
    b.emit(Arange("rt", Index(tile_symbol("toff")), "BLOCK_T", 1, 2))
    t_ok = bound_check(b, rt, tiles, bt, "tmask")
    classes, ranges, rows = summary.names
    kind = b.value(Load(classes, (Index(pid_b), Index(pid), Index(rt)), dt.int8), mask=t_ok)
    if t_ok is not None:
        kind = b.let(where(t_ok, kind, Const(DEAD, dt.int8)), "kind")
    live = b.let(binary("ne", kind, Const(DEAD, dt.int8)), "live")
    full = b.let(binary("eq", kind, Const(FULL, dt.int8)), "full")
    index = cast(Index(rt), i32)

    def fold(label, combiner, value):
        red = b.fresh(label + "_tile")
        b.emit(ReduceTile(red, b.let(value, label), combiner.tile, 1, i32))
        op = "minimum" if combiner is MIN else "maximum" if combiner is MAX else "add"
        b.emit(Assign(state[label].name, binary(op, state[label], Var(red, i32))))

    fold("lo", MIN, where(live, index, big))
    fold("hi", MAX, where(live, binary("add", index, Const(1, i32)), Const(0, i32)))
    fold("flo", MIN, where(full, index, big))
    fold("fhi", MAX, where(full, binary("add", index, Const(1, i32)), Const(0, i32)))
    fold("nfull", SUM, where(full, Const(1, i32), Const(0, i32)))
    if summary.fallback:
        m_ok = bound_check(b, rm, M, bm, "mmask")
        seen = b.value(Load(rows, (Index(pid_b), Index(rm), Index(rt)), dt.int8), mask=land(m_ok, t_ok))
        seen = b.let(cast(seen, i32), "seen")
        if t_ok is not None:
            seen = b.let(where(t_ok, seen, Const(0, i32)), "seen")
        red = b.fresh("rowlive_tile")
        b.emit(ReduceTile(red, seen, MAX.tile, 1, i32))
        b.emit(Assign(row_live.name, binary("maximum", row_live, Var(red, i32))))
    b.pop_block()

    lo, hi, flo, fhi, nfull = (state[k] for k in ("lo", "hi", "flo", "fhi", "nfull"))
    none_live = b.let(binary("ge", lo, big), "none_live")
    lo = b.let(where(none_live, Const(0, i32), lo), "lo_tile")
    hi = b.let(where(none_live, Const(0, i32), hi), "hi_tile")
    contiguous = b.let(binary("logical_and", binary("lt", flo, big),
                              binary("eq", binary("sub", fhi, flo), nfull)), "contiguous")
    flo = b.let(where(contiguous, flo, lo), "flo_tile")
    fhi = b.let(where(contiguous, fhi, lo), "fhi_tile")
    if summary.fallback:
        m_ok = bound_check(b, rm, M, bm, "mmask")
        dark = where(m_ok, row_live, Const(1, i32)) if m_ok is not None else row_live
        fewest = b.fresh("fewest")
        b.emit(ReduceTile(fewest, b.let(dark, "dark"), MIN.tile, 0, i32))
        every = b.let(binary("eq", Var(fewest, i32), Const(0, i32)), "every")
        count = cast(Index(tiles), i32)
        lo, hi = b.let(where(every, Const(0, i32), lo), "lo_tile"), b.let(where(every, count, hi), "hi_tile")
        flo, fhi = b.let(where(every, Const(0, i32), flo), "flo_tile"), b.let(where(every, Const(0, i32), fhi), "fhi_tile")
    for k, value in enumerate((lo, flo, fhi, hi)):
        b.store(ranges, (Index(pid_b), Index(pid), Index(sympy.Integer(k))), value, None)
    nbatch = summary.nbatch
    return TileKernel(b.name, b.finish_params(), {"BLOCK_M": bm, "BLOCK_T": bt}, numel=M * nbatch,
                      grid=(sympy.ceiling(M / tile_symbol("BLOCK_M")), nbatch), body=b.body,
                      num_warps=4 if summary.fallback else 1, num_stages=1, reads=b.reads, writes=b.writes,
                      kind=KernelKind.BLOCK_SUMMARY, plan=plan, scratch=summary.scratch())


def lower_summary(graph: Graph, plan: KernelPlan, options: LoweringOptions, summary: BlockSummary,
                  coordinates, bounds: tuple) -> list:
    """The kernels that compute the summary, in order (`lower_classify` for the arguments)."""
    return [lower_classify(graph, plan, options, summary, coordinates, bounds),
            lower_ranges(graph, plan, options, summary)]


def key_ranges(b: KernelBuilder, summary: BlockSummary, batch_row) -> tuple:
    """(lo, flo, fhi, hi) of the flash program's block of rows, as first keys (int64)."""
    pid = tile_symbol("pid")
    ranges = summary.names[1]
    out = []
    for k in range(4):
        tile = b.value(Load(ranges, (Index(batch_row), Index(pid), Index(sympy.Integer(k))), dt.int32))
        out.append(binary("mul", cast(tile, dt.int64), Index(tile_symbol("BLOCK_N"))))
    return tuple(out)


__all__ = ["BlockSummary", "summary_for", "lower_summary", "lower_classify", "lower_ranges", "key_ranges",
           "DEAD", "PARTIAL", "FULL"]
