"""A run-time bound on attention scores, so that a mask with a finite fill skips what it masks.

A fill that is finite and not extreme — PyTorch's CUDA attention adds -65504 where a boolean
mask is false, older code fills with -1e4 or -1e9 — masks a key only while the scores stay
far above it: a live score 65 000 below a masked one leaves eager weighting the masked key. A
block summary (`tile.block_summary`) may still skip the key tiles such a mask kills when, at
run time, every score of the flash program's rows provably lies within |fill| / 4 of zero:

    |c · q_i · k_j|  ≤  |c| · ‖q_i‖ · ‖k_j‖  ≤  |fill| / 4          (c: the scores' scale)

Then a masked score lies at least |fill| / 2 below every live score of its row (rounding to
bf16 included), its `exp` is 0 in fp32 (and in fp64, for fills at or below -2048), and the
running max never comes from it: the skipped keys contribute exactly what the unskipped
kernel adds for them, nothing — unless V holds NaN or inf there (0 · NaN), which a skip
leaves out, as it does under a -inf mask. A row with no live
key is the summary's own case (the block walks every key). Two small kernels compute the norms
as the flash kernel's products see the operands (prologues included, rounded as they are):

- `<plan>_key_norms`: one program per chunk of KEY_CHUNK keys and batch element, the largest
  ‖k_j‖² of its keys;
- `<plan>_row_norms`: one program per flash program (block of query rows, batch element), the
  largest ‖q_i‖² of its rows times the largest ‖k_j‖² of its batch element's chunks.

The flash program compares that product with the bound; where it fails, or a norm is NaN or
infinite, the program walks every key with the mask, as without a summary.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from ..fusion.masking import score_scale
from ..fusion.plan import KernelPlan, StageKind
from ..ir.symbolic import smin, unravel_sym
from ..ir import dtypes as dt
from ..ir.expr import Const, Index, Load, Var, binary, cast, where
from ..ir.graph import Graph
from ..ir.monoid import MAX, SUM
from .builder import KernelBuilder, land, tile_symbol
from .common import LoweringOptions, bound_check, dot_accumulator, dot_operand, needs_int64, pow2, static_int
from .ir import Assign, Arange, For, Full, KernelKind, ProgramId, ReduceTile, Scratch, TileKernel

#: operands may reach the product rounded (bf16, tf32) and the product accumulates in fp32:
#: the bound is taken with the norms this much larger
ROUNDING = 1.0 + 1.0 / 16
#: attention in fp64 keeps skipping for fills at or below this (a masked score's exp is 0 in
#: fp64 only below -745)
FP64_FILL_LIMIT = -2048.0
#: a bound on the product of the squared norms beyond this is no bound (fp32 overflow)
_FP32_LIMIT = 1.0e38
#: keys per program of `<plan>_key_norms`: small enough that a batch of a few sequences still
#: fills the GPU (GPT-2 at B8 with 12 heads and 1024 keys: 384 programs, 96 with 1024 per chunk)
KEY_CHUNK = 256
#: chunks of keys the row norms kernel reduces per step
_CHUNKS_PER_STEP = 64


@dataclass(frozen=True)
class ScoreGuard:
    """Skipping is exact where `max‖q‖² · max‖k‖² · factor <= limit`."""

    fill: float
    scale: float

    @property
    def factor(self) -> float:
        return 16.0 * self.scale * self.scale * ROUNDING * ROUNDING

    @property
    def limit(self) -> float:
        return min(self.fill * self.fill, _FP32_LIMIT)

    @staticmethod
    def names(plan_name: str) -> tuple:
        """(per flash program: its largest squared query norm times the largest squared key
        norm of its batch element; largest squared key norm per batch element and chunk)."""
        return f"{plan_name}_row_norm", f"{plan_name}_key_norm"

    def scratch(self, summary) -> dict:
        rows, keys = self.names(summary.plan_name)
        nbatch = sympy.Mul(*summary.all_batch) if summary.all_batch else sympy.Integer(1)
        row_blocks = sympy.ceiling(sympy.sympify(summary.rows) / summary.bm)
        return {rows: Scratch(rows, (nbatch, row_blocks), dt.float32),
                keys: Scratch(keys, (nbatch, key_chunks(summary)), dt.float32)}


def key_chunks(summary):
    return sympy.ceiling(sympy.sympify(summary.keys) / KEY_CHUNK)


def guard_for(graph: Graph, plan: KernelPlan, fill: float) -> ScoreGuard | None:
    """The guard of a flash plan whose mask fills with `fill`, or None when no bound on the
    operands bounds the scores (the masked body is not the mask applied to c · q·kᵀ)."""
    scores = next((st.node for st in plan.stages if st.kind == StageKind.SCORE), None)
    if scores is None or plan.flash.masked is None:
        return None
    c = score_scale(plan.flash.masked, scores)
    if c is None or fill >= 0:
        return None
    if dot_accumulator(plan.flash.q, plan.flash.k) == dt.float64 and fill > FP64_FILL_LIMIT:
        return None  # (fp64's exp underflows only below -745: the gap of |fill|/2 must exceed it)
    guard = ScoreGuard(fill, abs(c))
    if not guard.factor < _FP32_LIMIT:
        return None
    return guard


def _squared_norms(b: KernelBuilder, value, mask, rows_ok, name: str) -> Var:
    """The largest squared norm over the rows of a [rows, depth] tile (NaN counts as inf)."""
    x = cast(value, dt.float32)
    sq = b.let(binary("mul", x, x), "sq")
    if mask is not None:
        sq = b.let(where(mask, sq, Const(0.0, dt.float32)), "sq")
    per_row = b.fresh("ss")
    b.emit(ReduceTile(per_row, sq, SUM.tile, 1, dt.float32))
    ss = Var(per_row, dt.float32)
    ss = b.let(where(binary("eq", ss, ss), ss, Const(float("inf"), dt.float32)), "ss")
    if rows_ok is not None:
        ss = b.let(where(rows_ok, ss, Const(0.0, dt.float32)), "ss")
    out = b.fresh(name)
    b.emit(ReduceTile(out, ss, MAX.tile, 0, dt.float32))
    return Var(out, dt.float32)


def _builder(graph, plan, summary, options, name: str, symbols: set, sizes) -> KernelBuilder:
    b = KernelBuilder(graph, name, options.divisor_checks)
    b.scratch.update(summary.scratch())
    b.tile_symbols |= symbols | {"BLOCK_M", "BLOCK_N", "BLOCK_DK", "BLOCK_T"}
    for e in sizes:
        b.size_params(e)
    return b


def lower_guard(graph: Graph, plan: KernelPlan, options: LoweringOptions, summary, coordinates) -> list:
    """The two norm kernels of a summary with a guard, in launch order (`coordinates` as in
    `tile.flash`)."""
    info, con = plan.flash, plan.contraction
    o_node = graph[plan.contraction_stage.node]
    M, N, bm, bn = summary.rows, summary.keys, summary.bm, summary.bn
    DK = info.score_extent
    dk = max(16, pow2(static_int(DK)))
    batch = summary.all_batch
    nbatch = sympy.Mul(*batch) if batch else sympy.Integer(1)
    row_norms, key_norms = ScoreGuard.names(plan.name)
    chunks = key_chunks(summary)
    wide = needs_int64(M, N, DK, *batch)

    # the largest ‖k_j‖² of each chunk of each batch element's keys
    b = _builder(graph, plan, summary, options, f"{plan.name}_key_norms", {"pid_k", "pid_b", "rj", "kk", "joffset"},
                 (M, N, DK, *batch))
    b.emit(ProgramId("pid_k", 0, wide=wide))
    b.emit(ProgramId("pid_b", 1, wide=wide))
    pid_k, pid_b, rj, kk = (tile_symbol(n) for n in ("pid_k", "pid_b", "rj", "kk"))
    _, at = coordinates(con, o_node, unravel_sym(pid_b, batch) if batch else ())
    b.emit(Arange("kk", Index(sympy.Integer(0)), "BLOCK_DK", 1, 2))
    kk_ok = bound_check(b, kk, DK, dk, "kkmask")
    running = Var(b.fresh("kmax"), dt.float32)
    b.emit(Full(running.name, (1, 1), 0.0, dt.float32))
    loop = For("joffset", Index(pid_k * KEY_CHUNK), Index(smin(sympy.sympify(N), (pid_k + 1) * KEY_CHUNK)),
               "BLOCK_N")
    b.emit(loop)
    b.push_block(loop.body)
    b.emit(Arange("rj", Index(tile_symbol("joffset")), "BLOCK_N", 0, 2))
    j_ok = bound_check(b, rj, N, bn, "jmask")
    k_expr, _ = dot_operand(info.k)
    mask = land(j_ok, kk_ok)
    k = b.value(at(k_expr, 0, 0, rj, kk), mask=mask)
    tile_max = _squared_norms(b, k, mask, j_ok, "ktile")
    b.emit(Assign(running.name, binary("maximum", running, tile_max)))
    b.pop_block()
    b.store(key_norms, (Index(pid_b), Index(pid_k)), running, None)
    keys_kernel = TileKernel(b.name, b.finish_params(), {"BLOCK_N": bn, "BLOCK_DK": dk}, numel=N * DK * nbatch,
                             grid=(chunks, nbatch), body=b.body, num_warps=4, num_stages=1, reads=b.reads,
                             writes=b.writes, kind=KernelKind.BLOCK_SUMMARY, plan=plan, scratch=summary.scratch())

    # the largest ‖q_i‖² of each flash program's rows, times its batch element's largest ‖k_j‖²
    b = _builder(graph, plan, summary, options, f"{plan.name}_row_norms", {"pid", "pid_b", "rm", "kq", "rt", "toff"},
                 (M, N, DK, *batch))
    b.emit(ProgramId("pid", 0, wide=wide))
    b.emit(ProgramId("pid_b", 1, wide=wide))
    pid, pid_b, rm, kq, rt = (tile_symbol(n) for n in ("pid", "pid_b", "rm", "kq", "rt"))
    b.emit(Arange("rm", Index(pid * tile_symbol("BLOCK_M")), "BLOCK_M", 0, 2))
    b.emit(Arange("kq", Index(sympy.Integer(0)), "BLOCK_DK", 1, 2))
    _, at = coordinates(con, o_node, unravel_sym(pid_b, batch) if batch else ())
    m_ok = bound_check(b, rm, M, bm, "mmask")
    kq_ok = bound_check(b, kq, DK, dk, "kqmask")
    q_expr, _ = dot_operand(info.q)
    mask = land(m_ok, kq_ok)
    q = b.value(at(q_expr, rm, 0, 0, kq), mask=mask)
    largest = _squared_norms(b, q, mask, m_ok, "qmax")
    kmax = Var(b.fresh("kmax"), dt.float32)
    b.emit(Full(kmax.name, (1, 1), 0.0, dt.float32))
    static_chunks = static_int(chunks)
    bt = max(16, min(pow2(static_chunks), _CHUNKS_PER_STEP)) if static_chunks is not None else _CHUNKS_PER_STEP
    loop = For("toff", Index(sympy.Integer(0)), Index(chunks), "BLOCK_T")
    b.emit(loop)
    b.push_block(loop.body)
    b.emit(Arange("rt", Index(tile_symbol("toff")), "BLOCK_T", 1, 2))
    t_ok = bound_check(b, rt, chunks, bt, "tmask")
    part = b.value(Load(key_norms, (Index(pid_b), Index(rt)), dt.float32), mask=t_ok)
    if t_ok is not None:
        part = b.let(where(t_ok, part, Const(0.0, dt.float32)), "part")
    red = b.fresh("kpart")
    b.emit(ReduceTile(red, part, MAX.tile, 1, dt.float32))
    b.emit(Assign(kmax.name, binary("maximum", kmax, Var(red, dt.float32))))
    b.pop_block()
    b.store(row_norms, (Index(pid_b), Index(pid)), b.let(binary("mul", largest, kmax), "bound"), None)
    rows_kernel = TileKernel(b.name, b.finish_params(), {"BLOCK_M": bm, "BLOCK_DK": dk, "BLOCK_T": bt},
                             numel=M * DK * nbatch, grid=(sympy.ceiling(M / tile_symbol("BLOCK_M")), nbatch),
                             body=b.body, num_warps=4, num_stages=1, reads=b.reads, writes=b.writes,
                             kind=KernelKind.BLOCK_SUMMARY, plan=plan, scratch=summary.scratch())
    return [keys_kernel, rows_kernel]


def guarded_ranges(b: KernelBuilder, summary, ranges: tuple, keys) -> tuple:
    """The flash program's (lo, flo, fhi, hi) where its scores are bounded, else every key
    with the mask: (0, 0, 0, keys)."""
    guard = summary.guard
    row_norms, _ = ScoreGuard.names(summary.plan_name)
    pid, pid_b = tile_symbol("pid"), tile_symbol("pid_b")
    norms = b.value(Load(row_norms, (Index(pid_b), Index(pid)), dt.float32))
    bound = binary("mul", norms, Const(guard.factor, dt.float32))
    ok = b.let(binary("le", bound, Const(guard.limit, dt.float32)), "bounded")
    lo, flo, fhi, hi = ranges
    zero = Const(0, dt.int64)
    return (b.let(where(ok, lo, zero), "lo"), b.let(where(ok, flo, zero), "flo"),
            b.let(where(ok, fhi, zero), "fhi"), b.let(where(ok, hi, cast(Index(keys), dt.int64)), "hi"))


__all__ = ["ScoreGuard", "guard_for", "lower_guard", "guarded_ranges", "key_chunks", "ROUNDING", "KEY_CHUNK"]
