"""The flash kernel family (`FAMILY`): attention-shaped plans, one program per block of query
rows.

    Q = q[rows, :]                                  loaded once, [BLOCK_M, D]
    for each block of key positions:
        S   = dot(Q, k[:, keys])                    the score tile, [BLOCK_M, BLOCK_N]
        m.. = carried row reductions of S           (with their rolling updates)
        acc = h(acc, old, new) + dot(P(S, m..), v[keys, :])
    out = epilogue(acc)

Every member's body comes from the planner already expressed in the output contraction's
coordinates (`fusion.flash.FlashInfo`), so this lowering only binds those coordinates to tiles.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import sympy

from ..fusion.finite_base import finite_bases
from ..fusion.flash import K0
from ..fusion.masking import diagonal_keeps_rows_live, without_mask
from ..fusion.plan import KernelPlan, PlanKind, StageKind
from ..fusion.recompute import MIN_ROW_BLOCK
from ..ir import dtypes as dt
from ..ir.expr import Const, Expr, Index, Load, Var, binary, cast, free_symbols, out_index, red_index, walk, where
from ..ir.graph import Graph
from ..ir.monoid import SUM
from ..ir.symbolic import contiguous_strides, floordiv, smax, smin, unravel_sym
from .builder import KernelBuilder, land
from .block_summary import key_ranges, lower_summary, summary_for
from .score_guard import guarded_ranges, lower_guard
from .ir import (Arange, Assign, DotTile, For, Full, KernelKind, Let, ProgramId, ReduceTile, Scratch, TileKernel,
                 TransposeTile)
from .family import KernelFamily
from .common import (LoweringOptions, bound_check, combine, dot_accumulator, dot_operand, full_tile, identity_const,
                     index_values, lane_ranges, mapped, needs_int64, pow2, rebase, static_int, tile_symbol)
from .roofline import concurrency, tile_efficiency
from .index_width import narrowed
from .row_tiles import jam_rows
from .score_rewrites import exp_as_exp2, positive_scale, pull_scales, relax_for_low_precision
from .schedule import Schedule, schedule_over
from .space import SMEM_PER_BLOCK, ScheduleSpace, shrink_dot_tiles


def lower_flash_kernels(graph: Graph, plan: KernelPlan, options: LoweringOptions) -> list[TileKernel]:
    """The flash kernel, or (split and merge) a partial kernel over `splits` ranges of keys per
    block of rows plus a merge kernel that combines the partial states with the same derived
    rolling updates (FlashDecoding's log-sum-exp merge, derived rather than written)."""
    splits = split_factor(graph, plan, options)
    if splits <= 1:
        summary = _block_summary(graph, plan, options)
        flash = lower_flash(graph, plan, options, summary=summary)
        if summary is None:
            return [flash]
        o_node = graph[plan.contraction_stage.node]
        row, (key,) = out_index(o_node.rank)[plan.contraction.m_dim], red_index(1)
        bounds = live_keys(plan.flash, row, key, summary.rows, summary.keys)
        guard = lower_guard(graph, plan, options, summary, coordinates) if summary.guard is not None else []
        return [*lower_summary(graph, plan, options, summary, coordinates, bounds), *guard, flash]
    partial = lower_flash(graph, plan, options, splits=splits)
    return [partial, lower_flash_merge(graph, plan, options, splits, partial)]


def _block_summary(graph: Graph, plan: KernelPlan, options: LoweringOptions):
    """The run-time block summary of an unsplit flash kernel whose mask reads data, or None."""
    info = plan.flash
    if info.masked is None:
        return None
    schedule = _tiles_schedule(graph, plan, options)
    M, N, _, _, _ = _flash_sizes(graph, plan)
    o_node = graph[plan.contraction_stage.node]
    row, (key,) = out_index(o_node.rank)[plan.contraction.m_dim], red_index(1)
    rows_live = diagonal_keeps_rows_live(info.masked, row, key, _diagonal_exists(info, M, N))
    return summary_for(graph, plan, options, schedule["BLOCK_M"], schedule["BLOCK_N"], rows_live)


def lower_flash(graph: Graph, plan: KernelPlan, options: LoweringOptions, splits: int = 1,
                summary=None, copies: int | None = None) -> TileKernel:
    """The flash kernel; `copies`, the row tiles one program carries (default: the schedule's)."""
    info = plan.flash
    notes = len(plan.notes)  # (a kernel lowered again with one row tile notes its plan once)
    con = plan.contraction
    reduces = [st for st in plan.stages if st.kind == StageKind.REDUCE]
    o_stage = plan.contraction_stage
    o_node = graph[o_stage.node]
    M, DN, N = o_node.shape[con.m_dim], o_node.shape[con.n_dim], o_node.ranges[0]
    scores = score_products(plan)
    batch_shape = tuple(o_node.shape[d] for d in con.batch_dims)
    dn = max(16, pow2(static_int(DN)))
    schedule = _tiles_schedule(graph, plan, options)
    bm, bn, warps, stages = schedule["BLOCK_M"], schedule["BLOCK_N"], schedule.warps, schedule.stages
    copies = schedule.get("row_tiles", 1) if copies is None else copies
    constexprs = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_DN": dn}
    constexprs.update({sc.block: sc.width for sc in scores})

    kname = plan.name if splits == 1 else f"{plan.name}_partial"
    b = KernelBuilder(graph, kname, options.divisor_checks)
    b.tile_symbols |= {"pid", "pid_b", "pid_s", "rm", "rn", "rj", "rjb", "joffset"}
    b.tile_symbols |= {x for sc in scores for x in (sc.kq, sc.kk)}
    for e in (M, DN, N, *(sc.extent for sc in scores), *batch_shape):
        b.size_params(e)
    wide = needs_int64(M, N, DN, *batch_shape) or any(needs_int64(M, sc.extent, *batch_shape) for sc in scores)
    outs = out_index(o_node.rank)
    (r0,) = red_index(1)
    start, stop = live_keys(info, outs[con.m_dim], r0, M, N)
    trend = _work_trend(start, stop, M, bm, bn) if splits == 1 and summary is None else 0
    reverse = trend > 0
    group = _launch_group(N, DN, scores, batch_shape) if trend and options.flash_launch_groups else 0
    if trend:
        plan.notes.append(f"{o_node.name}: row blocks visit unequal numbers of key tiles: programs launch "
                          f"{'last' if reverse else 'first'} block first"
                          + (f", by groups of {group} batch elements" if group else ""))
    b.emit(ProgramId("pid", 0, wide=wide, reverse=reverse, group=group))
    b.emit(ProgramId("pid_b", 1, wide=wide, group=group))
    b.coordinate_extents[tile_symbol("pid_b")] = sympy.Mul(*batch_shape)  # (the grid's second dim)
    if splits > 1:
        b.emit(ProgramId("pid_s", 2))
    b.emit(Arange("rm", Index(tile_symbol("pid") * tile_symbol("BLOCK_M")), "BLOCK_M", 0, 2))
    b.emit(Arange("rn", Index(sympy.Integer(0)), "BLOCK_DN", 1, 2))
    for sc in scores:
        b.emit(Arange(sc.kq, Index(sympy.Integer(0)), sc.block, 1, 2))
        b.emit(Arange(sc.kk, Index(sympy.Integer(0)), sc.block, 0, 2))
    rm, rn, rj, rjb = (tile_symbol(n) for n in ("rm", "rn", "rj", "rjb"))
    batch_vals = unravel_sym(tile_symbol("pid_b"), batch_shape) if batch_shape else ()

    coords, at = coordinates(con, o_node, batch_vals)

    # (rows per program: with row tiles a program's last tile may pass M even where BLOCK_M divides it)
    m_ok = bound_check(b, rm, M, bm * copies, "mmask")
    n_ok = bound_check(b, rn, DN, dn, "nmask")
    q_tiles, kk_oks = [], []
    for sc in scores:
        kq, kk = tile_symbol(sc.kq), tile_symbol(sc.kk)
        kq_ok = bound_check(b, kq, sc.extent, sc.width, f"{sc.kq}mask")
        kk_oks.append(bound_check(b, kk, sc.extent, sc.width, f"{sc.kk}mask"))
        q_expr, q_dtype = dot_operand(sc.q)
        q_mask = land(m_ok, kq_ok)
        q_at = at(q_expr, rm, 0, 0, kq)
        q_tile = _zero_masked(b, b.value(q_at, mask=q_mask), q_mask, "q")  # loaded once
        if rm not in free_symbols(q_at) and (q_mask is None or rm not in free_symbols(q_mask)):
            # one query row broadcast to every row (scores a bias with rows of its own varies)
            q_tile = full_tile(b, q_tile, ("BLOCK_M", sc.block))
        q_tiles.append((q_tile, q_dtype))
    q_dtype = q_tiles[0][1]

    finite = finite_bases(graph, plan)  # (maxima whose terms take base 0 while they are -inf)
    for name in sorted(finite):
        note = (f"{name}: terms take base 0 while a row has seen only {identity_const(graph[name].combiner, dt.float32).value}"
                f" (re-based by a product, no select per element; rows that never leave it are NaN, as written)")
        if note not in plan.notes:  # (tuning lowers the plan once per candidate)
            plan.notes.append(note)
    state = {}
    for st in reduces:
        node = graph[st.node]
        name = b.fresh("acc")
        accd = node.combiner.acc_dtype(st.body.dtype)
        b.emit(Full(name, ("BLOCK_M", 1), node.combiner.identity(accd), accd))
        state[st.node] = Var(name, accd)
    accd = _accumulator(plan)
    acc = Var(b.fresh("acc"), accd)
    b.emit(Full(acc.name, ("BLOCK_M", "BLOCK_DN"), 0.0, accd))
    sibling_accs = []  # (a product over the same score tiles: `FlashInfo.siblings`)
    for _ in info.siblings:
        sibling_accs.append(Var(b.fresh("acc"), accd))
        b.emit(Full(sibling_accs[-1].name, ("BLOCK_M", "BLOCK_DN"), 0.0, accd))

    b.tile_symbols |= {"BLOCK_N"}
    if (start != 0 or stop != N) and splits == 1 and summary is None:
        shown = [sympy.sympify(x).xreplace(_program_rows(copies)) for x in (start, stop)]
        plan.notes.append(f"{o_node.name}: key tiles outside [{shown[0]}, {shown[1]}) are fully masked for the "
                          f"row block and skipped")
    if splits > 1:
        # split s walks its own whole number of key tiles: [s·chunk, (s+1)·chunk)
        chunk = floordiv(N + splits * bn - 1, splits * bn) * bn
        start = smax(start, tile_symbol("pid_s") * chunk)
        stop = smin(stop, (tile_symbol("pid_s") + 1) * chunk)
    row_values = {st.node for st in reduces}
    low_inputs = all(dot_operand(sc.q)[1].is_low_precision and dot_operand(sc.k)[1].is_low_precision
                     for sc in scores)
    relax = relax_for_low_precision if low_inputs else (lambda e: e)

    def key_loop(lo, hi, edit):
        """One loop over key tiles [lo, hi) (index bounds, or first keys loaded from the block
        summary); `edit` rewrites the bodies (removes the mask)."""
        loop = For("joffset", *(x if isinstance(x, Expr) else Index(x) for x in (lo, hi)), "BLOCK_N")
        b.emit(loop)
        b.push_block(loop.body)
        b.emit(Arange("rj", Index(tile_symbol("joffset")), "BLOCK_N", 1, 2))
        b.emit(Arange("rjb", Index(tile_symbol("joffset")), "BLOCK_N", 0, 2))
        j_ok = bound_check(b, rj, N, bn, "jmask")
        jb_ok = bound_check(b, rjb, N, bn, "jbmask")
        key_tiles = {}  # what each score's key tile reads, at a value tile's coordinates -> the tile
        for sc, (q_tile, q_dtype), kk_ok in zip(scores, q_tiles, kk_oks):
            k_expr, k_dtype = dot_operand(sc.k)
            k_mask = land(kk_ok, j_ok)
            k_tile = _zero_masked(b, b.value(at(k_expr, 0, 0, rj, tile_symbol(sc.kk)), mask=k_mask), k_mask, "k")
            if options.target.transposes_tiles and sc.width == dn and sympy.sympify(sc.extent - DN) == 0:
                read = _plain_read(b, at(k_expr, 0, 0, rjb, rn))
                if read is not None:
                    key_tiles.setdefault(read, k_tile)
            # the scores stay in fp32 (fp64) registers (never rounded to the graph's dtype: they never reach memory)
            b.bound[sc.name] = _dot(b, "s", ("BLOCK_M", "BLOCK_N"), q_tile, k_tile, accd,
                                    q_dtype if q_dtype == k_dtype and not options.target.interpret else accd)
        tile_mask = land(m_ok, j_ok)
        tile_mask = b.let(tile_mask, "tmask") if tile_mask is not None else None
        # a value per row (a logsumexp) or per key (a bias) is loaded as a [rows, 1] or [1, keys] tile
        b.restrict_masks(tile_mask, {"rm": m_ok, "rj": j_ok, "pid": None, "pid_b": None, "pid_s": None})

        running, updates = {}, []
        for st in reduces:
            node = graph[st.node]
            carried = state[st.node]
            body, scale = pull_scales(relax(edit(st.body))), None
            if node.combiner.extremum and positive_scale(body) and body.dtype == carried.dtype:
                # max_j(x_j·c) = c·max_j(x_j) for c > 0 (rounding is monotonic: exactly equal)
                body, scale = body.a, body
            v = cast(b.value(at(exp_as_exp2(body, row_values), rm, 0, rj), mask=tile_mask), carried.dtype)
            ident = identity_const(node.combiner, carried.dtype)
            contrib = full_tile(b, where(tile_mask, v, ident) if tile_mask is not None else v, ("BLOCK_M", "BLOCK_N"))
            red = b.fresh("red")
            comb = node.combiner.tile
            b.emit(ReduceTile(red, contrib, comb, 1, carried.dtype))
            red_v = Var(red, carried.dtype)
            if scale is not None:
                red_v = b.let(binary(scale.op, red_v, scale.b), "scaled")
            if st.repair is not None:
                value = b.let(binary("add", rebase(b, graph, carried, st.repair, running,
                                                   _on_finite(st.repair, finite)), red_v), "carry")
            else:
                value = b.let(combine(b, comb, carried, red_v), "carry")
            running[st.node] = (b.let(_finished(carried, node), "prev"), b.let(_finished(value, node), "run"))
            b.bound[st.node] = running[st.node][1]
            if st.node in finite:  # the terms' base: 0 while the row has seen only the identity
                run = running[st.node][1]
                b.bound[st.node] = b.let(where(binary("eq", run, identity_const(node.combiner, run.dtype)),
                                               Const(0.0, run.dtype), run), "base")
            updates.append(Assign(carried.name, value))

        def product(weights, values, onto):
            """onto + dot(weights, values) of this key tile, its operands rounded as eager rounds
            them. On a GPU the product accumulates into `onto` itself, as a flash kernel's P·V
            does (a product tile beside the accumulator would hold a second accumulator's
            registers); the C++ backend finds `onto + dot(...)` from a zero tile and accumulates
            in place itself."""
            a_expr, a_dtype = dot_operand(relax(edit(weights)))
            v_expr, v_dtype = dot_operand(values)
            if info.post is not None and v_dtype.is_low_precision:
                a_dtype = v_dtype  # unnormalised weights are rounded for the tensor-core dot
            p_tile = b.value(at(exp_as_exp2(pull_scales(a_expr), row_values), rm, 0, rj), mask=tile_mask)
            p_tile = _zero_masked(b, p_tile, tile_mask, "p")
            v_mask = land(jb_ok, n_ok)
            v_read = at(v_expr, 0, rn, rjb)
            same = key_tiles.get(_plain_read(b, v_read)) if key_tiles else None
            if same is not None:
                # a score's key tile reads these values the other way round (the backward's
                # Qᵀ for `K·Qᵀ` and Q for `dSᵀ·Q`): one load, transposed, as FlashAttention does
                v_tile = Var(b.fresh("vt"), same.dtype)
                b.emit(TransposeTile(v_tile.name, same))
            else:
                v_tile = _zero_masked(b, b.value(v_read, mask=v_mask), v_mask, "v")
            operands = a_dtype if a_dtype == v_dtype and not options.target.interpret else accd
            if options.target.on_cpu:
                return binary("add", onto, _dot(b, "pv", ("BLOCK_M", "BLOCK_DN"), p_tile, v_tile, accd, operands))
            return _dot(b, "pv", ("BLOCK_M", "BLOCK_DN"), p_tile, v_tile, accd, operands, onto=onto)

        rebased = (rebase(b, graph, acc, o_stage.repair, running, _on_finite(o_stage.repair, finite))
                   if o_stage.repair is not None else acc)
        updates.append(Assign(acc.name, product(info.a, info.b, rebased)))
        for sib, sib_acc in zip(info.siblings, sibling_accs):
            updates.append(Assign(sib_acc.name, product(sib.a, sib.b, sib_acc)))
        for u in updates:
            b.emit(u)
        b.restrict_masks(None, {})
        b.pop_block()

    interior = _interior_keys(info, outs[con.m_dim], r0, start, stop, bn)
    if copies > 1:
        # the key ranges of the program's rows, all its row tiles together: the union of their
        # live keys, and keys unmasked for every one of them (`jam_rows` leaves the loops be)
        rows = _program_rows(copies)
        start, stop = (sympy.sympify(x).xreplace(rows) for x in (start, stop))
        if interior is not None:
            interior = (*(sympy.sympify(x).xreplace(rows) for x in interior[:2]), interior[2])
    if summary is not None:
        b.scratch.update(summary.scratch())
        lo, flo, fhi, hi = key_ranges(b, summary, summary.batch_index(batch_vals))
        if summary.guard is not None:
            lo, flo, fhi, hi = guarded_ranges(b, summary, (lo, flo, fhi, hi), N)
        key_loop(lo, flo, lambda e: e)
        key_loop(flo, fhi, without_mask(info.masked))
        key_loop(fhi, hi, lambda e: e)
        plan.notes.append(f"{o_node.name}: the mask reads tensor data: {plan.name}_summary classifies each tile "
                          f"once per call, {plan.name}_ranges gives each block of rows its live keys (masked) and "
                          f"wholly live keys (no mask); the rest are skipped"
                          + (f" — where {plan.name}_row_norms and {plan.name}_key_norms bound every score "
                             f"within |fill|/4 = {abs(summary.guard.fill) / 4:g} (the fill is finite), else "
                             f"every key is visited" if summary.guard is not None else ""))
    elif interior is None:
        key_loop(start, stop, lambda e: e)
    else:
        first, last, edit = interior
        if first != start:
            key_loop(start, first, lambda e: e)
        key_loop(first, last, edit)
        if last != stop:
            key_loop(last, stop, lambda e: e)
        plan.notes.append(f"{o_node.name}: key tiles in [{first}, {last}) are unmasked for the whole row block: "
                          f"their loop evaluates no mask")

    if finite:
        for st in reduces:
            if st.repair is not None and set(st.repair.producers) & finite:
                state[st.node] = _undefined_rows(b, graph, state, st.repair, finite, state[st.node])
        if o_stage.repair is not None and set(o_stage.repair.producers) & finite:
            acc = _undefined_rows(b, graph, state, o_stage.repair, finite, acc)
    omask = land(m_ok, n_ok)
    omask = b.let(omask, "omask") if omask is not None else None
    nbatch = sympy.Mul(*batch_shape) if batch_shape else sympy.Integer(1)
    if splits > 1:
        scratch = _scratch_buffers(plan, reduces, graph, splits, nbatch, M, DN)
        b.scratch.update(scratch)
        for st in reduces:
            part = scratch[_part_name(plan, st.node)]
            b.store(part.name, (Index(tile_symbol("pid_s")), Index(tile_symbol("pid_b")), Index(rm)), state[st.node], m_ok)
        b.store(_part_name(plan, "acc"), (Index(tile_symbol("pid_s")), Index(tile_symbol("pid_b")), Index(rm), Index(rn)), acc, omask)
        plan.notes.append(f"{o_node.name}: split into {splits} ranges of keys per block of rows; partial "
                          f"states merged by {plan.name}_merge with the same rolling updates")
        return _in_row_tiles(TileKernel(
            kname, b.finish_params(), constexprs, numel=M * DN * nbatch,
            grid=(sympy.ceiling(M / tile_symbol("BLOCK_M")), nbatch, splits), body=b.body, num_warps=warps,
            num_stages=stages, reads=b.reads, writes=b.writes, kind=KernelKind.FLASH,
            plan=plan, scratch=dict(b.scratch)), copies, plan,  # its partial states and any block summary
            lambda: _again(notes, graph, plan, options, splits, summary))
    for st in reduces:
        b.bound[st.node] = b.let(_finished(state[st.node], graph[st.node]), "red")
    for sib, sib_acc in zip(info.siblings, sibling_accs):
        b.bound[sib.node] = b.let(cast(sib_acc, graph[sib.node].dtype), "out")
    _finish(b, graph, plan, acc, rm, rn, m_ok, omask, coords, at)
    return _in_row_tiles(TileKernel(
        plan.name, b.finish_params(), constexprs, numel=M * DN * nbatch,
        grid=(sympy.ceiling(M / tile_symbol("BLOCK_M")), nbatch), body=b.body, num_warps=warps,
        num_stages=stages, reads=b.reads, writes=b.writes, kind=KernelKind.FLASH,
        plan=plan, scratch=summary.scratch() if summary is not None else {}), copies, plan,
        lambda: _again(notes, graph, plan, options, splits, summary))


def _program_rows(copies: int) -> dict:
    """BLOCK_M as the rows of a program of `copies` row tiles, for the key-range formulas (which
    are written for a block of BLOCK_M rows)."""
    return {tile_symbol("BLOCK_M"): copies * tile_symbol("BLOCK_M")} if copies > 1 else {}


def _on_finite(repair, finite: frozenset) -> bool:
    """Whether a sum is re-based by the product alone: it reads one producer, which gave its
    terms a finite base. (A factor over two maxima, `exp(r0 - r0' + r1 - r1')`, is NaN while one
    of them stays -inf and the other moves: the select, which drops the sum when the first
    leaves -inf, stays there.)"""
    return len(repair.producers) == 1 and repair.producers[0] in finite


def _undefined_rows(b: KernelBuilder, graph: Graph, state: dict, repair, finite: frozenset, carried: Var) -> Var:
    """A partial sum built on finite bases, NaN in rows whose max never left its identity: the
    program as written forms exp(-inf - -inf) there (`fusion.finite_base` checked that its
    terms are NaN at that base)."""
    dead = None
    for p in repair.producers:
        if p in finite:
            unseen = binary("eq", state[p], identity_const(graph[p].combiner, state[p].dtype))
            dead = unseen if dead is None else binary("logical_or", dead, unseen)
    return b.let(where(dead, Const(float("nan"), carried.dtype), carried), "defined")


def _again(notes: int, graph: Graph, plan: KernelPlan, options: LoweringOptions, splits: int, summary) -> TileKernel:
    """The kernel lowered again with one row tile, its plan's notes as they were before the first
    lowering (whose notes spoke of the rows of two tiles)."""
    del plan.notes[notes:]
    return lower_flash(graph, plan, options, splits, summary, copies=1)


def _in_row_tiles(kernel: TileKernel, copies: int, plan: KernelPlan, one_tile) -> TileKernel:
    """The kernel with `copies` row tiles per program (`tile.row_tiles`; its key ranges were
    computed for all of them), or when its rows do not enter its loop the same way (the plan's
    notes say why) `one_tile()`, the kernel lowered for one; with 32-bit program ids where its
    index arithmetic provably fits them (`tile.index_width`: the width rule above multiplies
    rows, keys, head dim and batch, far more than any offset)."""
    if copies <= 1:
        return narrowed(kernel)
    jammed, why = jam_rows(kernel, copies, program_bounds=True)
    if jammed is None:
        kernel = one_tile()
    note = (f"{kernel.name}: one row tile per program, not {copies}: {why}" if jammed is None else
            f"{kernel.name}: each program carries {copies} row tiles of {kernel.constexprs['BLOCK_M']} rows "
            f"through one key loop (one tile's exponentials overlap the other's products)")
    if note not in plan.notes:  # (tuning lowers the plan once per candidate)
        plan.notes.append(note)
    return kernel if jammed is None else narrowed(jammed)


def _plain_read(b: KernelBuilder, e: Expr):
    """(buffer, dtype, element offset) of a load at an index formula, else None: two such
    reads are the same elements when these are equal (offsets simplified, so that
    `view[3*floor(p/3) + Mod(p, 3), ...]` and `view[p, ...]` compare equal)."""
    if not (isinstance(e, Load) and all(isinstance(c, Index) for c in e.index)):
        return None
    return e.buffer, e.dtype, b.offset(e.buffer, e.index).expr


def _zero_masked(b: KernelBuilder, tile, mask, prefix: str):
    """A dot operand's tile with its masked-off lanes 0."""
    return tile if mask is None else b.let(where(mask, tile, Const(0.0, tile.dtype)), prefix)


def _dot(b: KernelBuilder, prefix: str, shape: tuple, x, y, accd, operand_dtype, onto=None) -> Var:
    """A fresh accumulator tile of `shape` holding dot(x, y) (`onto` + dot(x, y) when given),
    its operands in `operand_dtype` (the tensor cores' bf16/fp16 when both are, else the
    accumulator's dtype)."""
    name = b.fresh(prefix)
    b.emit(Full(name, shape, 0.0, accd) if onto is None else Let(name, onto))
    b.emit(DotTile(name, x, y, Var(name, accd), operand_dtype if operand_dtype.is_low_precision else accd))
    return Var(name, accd)


@dataclass(frozen=True)
class ScoreProduct:
    """One score product of a flash plan, as the lowering names it: `name` (the node bound to
    its tile), its row and key factors in the output's coordinates, its axis's extent, and
    the constexpr and aranges of that axis (the first keeps the attention kernel's names)."""

    name: str
    q: Expr
    k: Expr
    extent: object
    block: str
    kq: str
    kk: str

    @property
    def width(self) -> int:
        return max(16, pow2(static_int(self.extent)))


def score_products(plan: KernelPlan) -> list[ScoreProduct]:
    """The plan's score products: an attention plan's one (`q`, `k`), or a recomputing plan's
    (`FlashInfo.scores`, `fusion.recompute`)."""
    info = plan.flash
    found = info.scores or ((next(st.node for st in plan.stages if st.kind == StageKind.SCORE),
                             info.q, info.k, info.score_extent),)
    return [ScoreProduct(name, q, k, extent, "BLOCK_DK" + (str(i) if i else ""), "kq" + (str(i) if i else ""),
                         "kk" + (str(i) if i else "")) for i, (name, q, k, extent) in enumerate(found)]


def _accumulator(plan: KernelPlan):
    """The dtype of the score and output accumulators: fp64 for double attention, else fp32."""
    info = plan.flash
    return dot_accumulator(info.q, info.k, info.a, info.b, *(x for sib in info.siblings for x in (sib.a, sib.b)))


def _flash_sizes(graph: Graph, plan: KernelPlan) -> tuple:
    con = plan.contraction
    o_node = graph[plan.contraction_stage.node]
    M, DN, N = o_node.shape[con.m_dim], o_node.shape[con.n_dim], o_node.ranges[0]
    DK = plan.flash.score_extent
    batch = tuple(o_node.shape[d] for d in con.batch_dims)
    return M, N, DN, DK, batch


#: the knobs of the flash kernel's tiles (the split is `split_factor`'s); `row_tiles`: how many
#: independent BLOCK_M-row tiles one program carries through its key loop (`tile.row_tiles`)
TILE_KNOBS = ("BLOCK_M", "BLOCK_N", "warps", "stages", "row_tiles")


def _rows_independent(plan: KernelPlan) -> bool:
    """The plan's rows enter its key loop only through index formulas (no mask, or a mask such
    as causal's written over positions), so a program may carry several row tiles through one
    loop over their keys together (`tile.row_tiles`); a mask read from tensor data takes its
    key ranges from a block summary per block of rows. Forward kernels only (the backward's
    recomputing plans keep one row tile)."""
    from ..fusion.masking import masked_condition

    info = plan.flash
    if info.scores:
        return False
    condition = masked_condition(info.masked) if info.masked is not None else None
    return condition is None or not any(isinstance(n, Load) for n in walk(condition))


def _first_key_moves(graph: Graph, plan: KernelPlan) -> bool:
    """Whether a block of rows' first live key depends on the rows (a sliding window's)."""
    con = plan.contraction
    o_node = graph[plan.contraction_stage.node]
    M, N = o_node.shape[con.m_dim], o_node.ranges[0]
    (key,) = red_index(1)
    start, _ = live_keys(plan.flash, out_index(o_node.rank)[con.m_dim], key, M, N)
    return tile_symbol("pid") in sympy.sympify(start).free_symbols


def _masks(plan: KernelPlan) -> bool:
    """Whether the plan masks any score (by an index formula or by tensor data)."""
    from ..fusion.masking import masked_condition

    return plan.flash.masked is not None and masked_condition(plan.flash.masked) is not None


def _row_tiles_apply(plan: KernelPlan, options: LoweringOptions, low: bool, head: int) -> bool:
    """Whether the rules and the search consider two row tiles per program: a GPU's forward
    kernel over tensor-core operands whose two accumulators fit the registers (head dim <= 128)."""
    return low and head <= 128 and not options.target.on_cpu and not options.target.interpret \
        and _rows_independent(plan)


def _tiles_schedule(graph: Graph, plan: KernelPlan, options: LoweringOptions) -> Schedule:
    """BLOCK_M, BLOCK_N, warps, stages and row tiles: a tuned schedule's, else
    TILEFUSE_FLASH_CONFIG's, else the rules'."""
    M, N, DN, DK, batch = _flash_sizes(graph, plan)
    head = max(16, pow2(static_int(DN)), pow2(static_int(DK)))
    low = dot_operand(plan.flash.q)[1].is_low_precision
    bm, bn, warps, stages = _default_tiles(low, head, static_int(M), options, static_int(N))
    if options.target.on_cpu:
        bm = _rows_for_threads(bm, static_int(M), static_int(sympy.Mul(*batch)) if batch else 1, options.target.threads)
    if plan.flash.scores and low and not options.target.on_cpu and not options.target.interpret:
        # products over recomputed scores (the attention backward), the best of a sweep on an
        # H100 (docs/benchmarks.md, twenty-eighth section): 128 rows of 64 keys with 8 warps,
        # except two accumulators (dK and dV) of a narrow head, which take 64 rows of 4 warps
        two_accumulators = bool(plan.flash.siblings)
        if head >= 256:  # (wider heads: the earlier rule, which their registers allow)
            bm, bn, warps, stages = 64, 32, 4, 3
        else:
            bm, bn, warps, stages = (64, 64, 4, 3) if two_accumulators and head < 128 else (128, 64, 8, 3)
        if static_int(M) is not None:
            bm = min(bm, max(16, pow2(static_int(M))))
    row_tiles = 1
    if _row_tiles_apply(plan, options, low, head) and (static_int(M) or 0) >= 1024:
        # two row tiles per program, the best of sweeps on an H100 (docs/benchmarks.md,
        # forty-third and forty-fourth sections): at head dim 64 unmasked, 2×64 rows of 128
        # keys with 4 warps (448 TFLOP/s against 429 for one tile; cuDNN 451); at head dim 128,
        # 2×128 rows of 64 keys with 8 warps, unmasked (518 against 495; cuDNN 604) and causal
        # (456 against 425). A causal mask at head dim 64 ran best with one tile (388 against 355).
        # Not where the first live key moves with the rows (a sliding window): the program visits
        # the union of its tiles' keys, for a window of w keys w + 2·BLOCK_M of them per tile
        # instead of w + BLOCK_M
        if head <= 64 and not _masks(plan):
            bm, bn, warps, stages, row_tiles = 64, 128, 4, 2, 2
        elif head == 128 and not _first_key_moves(graph, plan):
            bm, bn, warps, stages, row_tiles = 128, 64, 8, 3, 2
    if options.flash_config:
        from ..config import knob

        # the knob's own check (a caller may build LoweringOptions by hand); whether the
        # blocks fit this kernel on its target is tile.fit's question, after lowering
        value = knob("flash_config").parse(options.flash_config, "flash_config")
        bm, bn, warps, stages, *more = (int(v) for v in value.split(","))
        row_tiles = more[0] if more else 1
    rules = Schedule(zip(TILE_KNOBS, (bm, bn, warps, stages, row_tiles)))
    chosen = schedule_over(rules, options.schedule)
    if options.schedule and "row_tiles" not in options.schedule:
        chosen = chosen.replace(row_tiles=1)  # a schedule tuned before the knob existed: one row tile
    return chosen.pick(TILE_KNOBS)


def flash_space(graph: Graph, plan: KernelPlan, options: LoweringOptions):
    """Row and key tiles, warps, pipeline stages and (few rows: decode) the split factor."""
    M, N, DN, DK, batch = _flash_sizes(graph, plan)
    dn = max(16, pow2(static_int(DN)))
    dk = sum(sc.width for sc in score_products(plan))  # every score product's key tile is pipelined
    products = 1 + len(plan.flash.siblings)  # (and every product's value tile)
    # value tiles a score's key tile already holds (taken transposed: the backward's Q and dO)
    # take no buffers of their own; tile.fit checks the lowered kernel's exact count
    staged = products - _values_shared_with_keys(plan, options)
    # fp32 score tiles alive at once: Triton reuses the registers of a tile once the next one
    # (the probabilities from the scores, dS from dP) is made from it
    tiles = min(2, 1 + len(plan.flash.scores)) if plan.flash.scores else 1
    low = dot_operand(plan.flash.q)[1].is_low_precision
    item = 2 if low else 4
    rows = static_int(M)
    default = _tiles_schedule(graph, plan, options)
    if rows is not None and rows <= 16:
        auto = split_factor(graph, plan, options)
        default = default.replace(split=auto)
        knobs = {"BLOCK_M": (pow2(rows) if options.target.on_cpu else 16,), "BLOCK_N": (64, 128, 256),
                 "warps": (4, 8), "stages": (2, 3, 4), "split": tuple(sorted({1, auto, max(1, auto // 2), 2 * auto}))}
    elif low:
        knobs = {"BLOCK_M": (64, 128), "BLOCK_N": (32, 64, 128), "warps": (4, 8), "stages": (2, 3, 4)}
        head = max(16, pow2(static_int(DN)), pow2(static_int(DK)))
        if _row_tiles_apply(plan, options, low, head):
            knobs["row_tiles"] = (1, 2)
    else:
        knobs = {"BLOCK_M": (32, 64), "BLOCK_N": (32, 64), "warps": (4, 8), "stages": (2, 3)}

    if "row_tiles" not in knobs and default.get("row_tiles") == 1:
        default = default.pick(k for k in default if k != "row_tiles")  # (a knob the search does not turn)
    smem_limit = getattr(options.target.limits, "shared_memory", None) or SMEM_PER_BLOCK

    def valid(s: Schedule) -> bool:
        row_tiles = s.get("row_tiles", 1)
        if rows is not None and s["BLOCK_M"] * row_tiles > max(1 if options.target.on_cpu else 16, pow2(rows)):
            return False
        # K and V tiles pipelined over the stages, the Q tiles once (tile.limits measures the same)
        smem = s["stages"] * s["BLOCK_N"] * (dk + dn * staged) * item + row_tiles * s["BLOCK_M"] * dk * item
        # fp32 values per thread: the accumulators and the score tiles alive at once, per row tile
        regs = row_tiles * s["BLOCK_M"] * (dn * products + s["BLOCK_N"] * tiles) // (32 * s["warps"])
        # score tiles over 128×64 spill in the backward's kernels (128×128: 2–3× slower on the
        # H200, docs/benchmarks.md, twentieth section), whatever the count above says
        small_scores = not plan.flash.scores or s["BLOCK_M"] * s["BLOCK_N"] <= 128 * 64
        return smem <= smem_limit and regs <= 192 and small_scores

    nbatch = static_int(sympy.Mul(*batch)) if batch else 1
    sizes = {"M": rows, "N": static_int(N), "D": max(dn, dk), "batch": nbatch,
             "dots": len(score_products(plan)) + products}
    # (one row tile or two: the model cannot rank the overlap reliably; the best of each is measured)
    return ScheduleSpace("flash", knobs, default, sizes=sizes, itemsize=item, valid=valid,
                         families=("row_tiles",) if "row_tiles" in knobs else (), plan_kind=PlanKind.FLASH)


def _values_shared_with_keys(plan: KernelPlan, options: LoweringOptions) -> int:
    """How many of the plan's products read their values from a buffer that a score's key
    operand reads too (the lowering then transposes the key tile where the reads agree)."""
    if not options.target.transposes_tiles or not plan.flash.scores:
        return 0
    keys = {e.buffer for e in (dot_operand(sc.k)[0] for sc in score_products(plan)) if isinstance(e, Load)}
    values = [plan.flash.b, *(sib.b for sib in plan.flash.siblings)]
    return sum(1 for v in values if isinstance(dot_operand(v)[0], Load) and dot_operand(v)[0].buffer in keys)


def _default_tiles(low_precision: bool, head_block: int, rows, options: LoweringOptions, keys=None) -> tuple:
    """(BLOCK_M, BLOCK_N, warps, stages) until the autotuner chooses: the best of a sweep on the
    H200 (docs/benchmarks.md) — 128×128 tiles for head dim 128, 128×64 below, 8 warps; 16 rows (the smallest `dot`) when there are at most 16 (decode).
    On a CPU the key tile is no wider than the keys (`keys`, when static): a 64-wide tile over
    32 keys computes and masks as many scores again."""
    if options.target.on_cpu:  # score tile and operands stay in the L1/L2 caches
        bm, bn, warps, stages = 64, 64, 1, 1
        if keys is not None:
            bn = min(bn, max(32, pow2(keys)))  # (32: the smallest of the space's key tiles)
    elif options.target.interpret:
        bm, bn, warps, stages = 32, 32, 4, 1
    elif not low_precision:
        bm, bn, warps, stages = 64, 32, 4, 3
    elif head_block >= 128:
        bm, bn, warps, stages = 128, 128, 8, 3
    else:
        bm, bn, warps, stages = 128, 64, 8, 3
    if rows is not None and rows <= 16 and options.target.on_cpu:
        bm = pow2(rows)  # the C++ dots take any rows: no masked row is computed (decode: one)
    elif rows is not None and rows <= 16:
        bm, bn, warps = 16, max(bn, 64) if not options.target.interpret else bn, 4
    elif rows is not None:
        bm = min(bm, max(16, pow2(rows)))
    return bm, bn, warps, stages


def _rows_for_threads(bm: int, rows, nbatch, threads: int) -> int:
    """A CPU's row tile, halved (down to 16 rows) while the programs are fewer than the threads:
    one program runs on one thread, and a SwiGLU over 64 rows in one 64-row program left the
    second core idle (1.6× slower than the three products unfused)."""
    if rows is None or nbatch is None:
        return bm
    while bm > MIN_ROW_BLOCK and nbatch * -(-rows // bm) < threads:
        bm //= 2
    return bm


def coordinates(con, o_node, batch_vals):
    """`coords(m, n, key, k0)`: the output contraction's symbols and the tile values bound to
    them (batch dims from the program id); `at(expr, ...)`: an expression with them bound."""
    outs = out_index(o_node.rank)
    (r0,) = red_index(1)

    def coords(m_val, n_val, key_val, k0_val=None):
        vals = {outs[d]: v for d, v in zip(con.batch_dims, batch_vals)}
        vals[outs[con.m_dim]], vals[outs[con.n_dim]], vals[r0] = m_val, n_val, key_val
        if k0_val is not None:
            vals[K0] = k0_val
        return list(vals), list(vals.values())

    def at(expr, m_val, n_val, key_val, k0_val=None):
        return mapped(expr, *coords(m_val, n_val, key_val, k0_val))

    return coords, at


def _finish(b: KernelBuilder, graph: Graph, plan: KernelPlan, acc, rm, rn, m_ok, omask, coords, at) -> None:
    """After the key loop: the deferred row factor and guards, the output store, epilogues."""
    info = plan.flash
    o_stage = plan.contraction_stage
    o_node = graph[o_stage.node]
    epilogues = [st for st in plan.stages if st.kind == StageKind.ROW and st.node not in info.row_stats]
    outs = out_index(o_node.rank)
    total = acc
    if info.post is not None:
        post = b.value(at(info.post, rm, 0, 0), mask=m_ok)
        total = b.let(binary("mul", acc, cast(post, acc.dtype)), "normalised")
        for guard in info.guards:
            g = b.value(at(guard, rm, 0, 0), mask=m_ok)
            total = b.let(where(g, Const(0.0, acc.dtype), total), "guarded")
    b.bound[o_node.name] = b.let(cast(total, o_node.dtype), "out")
    syms, vals = coords(rm, rn, 0)
    _store_row_stats(b, plan, dict(zip(syms, vals)), at, rm, m_ok)
    bound = dict(zip(syms, vals))
    o_index = tuple(Index(v) if not isinstance(v, Index) else v for v in (bound[s] for s in outs))
    # each product with its epilogues, at its own index (a sibling's: `FlashInfo.siblings`,
    # bound by the caller)
    of_siblings = {name for sib in info.siblings for name in sib.epilogues}
    anchors = [(o_stage, o_index, [st for st in epilogues if st.node not in of_siblings])]
    for sib in info.siblings:
        at_tile = {s: v.expr if isinstance(v, Index) else sympy.sympify(v) for s, v in bound.items()}
        index = tuple(Index(sympy.sympify(e).xreplace(at_tile)) for e in sib.index)
        anchors.append((plan.stage(sib.node), index, [st for st in epilogues if st.node in sib.epilogues]))
    for stage, index, own in anchors:
        anchor = graph[stage.node]
        if stage.store:
            b.store(anchor.name, index, b.bound[anchor.name], omask)
        flat = sum((c.expr * st_ for c, st_ in zip(index, contiguous_strides(anchor.shape))), sympy.Integer(0))
        for st in own:
            enode = graph[st.node]
            vals = [c.expr for c in index] if tuple(enode.shape) == tuple(anchor.shape) \
                else list(index_values(enode.shape, flat, lane_ranges([c.expr for c in index], anchor.shape)))
            v = b.value(mapped(st.body, out_index(enode.rank), vals), mask=omask)
            b.bound[st.node] = v
            b.store(st.node, tuple(Index(e) for e in vals), v, omask)


def _store_row_stats(b: KernelBuilder, plan: KernelPlan, bound: dict, at, rm, m_ok) -> None:
    """Each row statistic (`FlashInfo.row_stats`, a logsumexp) from the finished reductions,
    stored once per query row."""
    for st in plan.stages:
        if st.node in plan.flash.row_stats:
            # a stored reduction is its finished value; a statistic is computed from them
            value = b.bound[st.node] if st.kind == StageKind.REDUCE else b.value(at(st.body, rm, 0, 0), mask=m_ok)
            b.bound[st.node] = value
            index = tuple(Index(sympy.sympify(c.expr).subs(bound)) for c in plan.flash.row_stats[st.node])
            b.store(st.node, index, value, m_ok)


def split_factor(graph: Graph, plan: KernelPlan, options: LoweringOptions) -> int:
    """How many ranges of keys each block of rows is split into: `options.flash_split` when
    set, else `choose_splits` on static sizes (symbolic sizes and the interpreter: 1)."""
    if plan.flash.scores:
        return 1  # (a product over recomputed scores: its rows are many, its keys few)
    if options.schedule and "split" in options.schedule:
        return int(options.schedule["split"])
    if options.flash_split > 0:
        return options.flash_split
    if options.target.interpret or options.target.sm_count <= 0:
        return 1
    con = plan.contraction
    o_node = graph[plan.contraction_stage.node]
    M, N = static_int(o_node.shape[con.m_dim]), static_int(o_node.ranges[0])
    nbatch = static_int(sympy.Mul(*(o_node.shape[d] for d in con.batch_dims)))
    if None in (M, N, nbatch):
        return 1
    return choose_splits(-(-M // 64) * nbatch, -(-N // 64), options.target.sm_count)


def choose_splits(programs: int, key_tiles: int, sm_count: int) -> int:
    """Split only when the blocks of rows alone cannot fill the device twice over (decode: one
    query row per head), keeping at least four key tiles per split."""
    target = 2 * sm_count
    if programs <= 0 or programs >= target:  # no rows (an empty batch) or enough programs
        return 1
    return max(1, min(-(-target // programs), key_tiles // 4, 64))


def _part_name(plan: KernelPlan, what: str) -> str:
    return f"{plan.name}_part_{what}"


def _scratch_buffers(plan, reduces, graph, splits, nbatch, M, DN) -> dict:
    """Partial states of a split flash kernel: each carried reduction per (split, batch, row)
    and the unnormalised output accumulator per (split, batch, row, column), in the kernel's
    accumulator dtype."""
    out = {}
    for st in reduces:
        node = graph[st.node]
        name = _part_name(plan, st.node)
        out[name] = Scratch(name, (sympy.Integer(splits), nbatch, M), node.combiner.acc_dtype(st.body.dtype))
    name = _part_name(plan, "acc")
    out[name] = Scratch(name, (sympy.Integer(splits), nbatch, M, DN), _accumulator(plan))
    return out


def lower_flash_merge(graph: Graph, plan: KernelPlan, options: LoweringOptions, splits: int,
                      partial: TileKernel) -> TileKernel:
    """One program per (row, batch): load the `splits` partial states as a [BLOCK_S, ·] tile,
    combine the producers (max ...), re-base every repaired partial sum onto the combined
    values with its derived h, sum over the splits, then finish as the flash kernel does."""
    con = plan.contraction
    reduces = [st for st in plan.stages if st.kind == StageKind.REDUCE]
    o_stage = plan.contraction_stage
    o_node = graph[o_stage.node]
    M, DN = o_node.shape[con.m_dim], o_node.shape[con.n_dim]
    batch_shape = tuple(o_node.shape[d] for d in con.batch_dims)
    nbatch = sympy.Mul(*batch_shape) if batch_shape else sympy.Integer(1)
    bs, dn = pow2(splits), max(16, pow2(static_int(DN)))
    b = KernelBuilder(graph, f"{plan.name}_merge", options.divisor_checks)
    b.scratch.update(partial.scratch)
    b.tile_symbols |= {"pid", "pid_b", "rs", "rn"}
    for e in (M, DN, *batch_shape):
        b.size_params(e)
    wide = needs_int64(M, DN, *batch_shape, splits)
    b.emit(ProgramId("pid", 0, wide=wide))
    b.emit(ProgramId("pid_b", 1, wide=wide))
    b.emit(Arange("rs", Index(sympy.Integer(0)), "BLOCK_S", 0, 2))
    b.emit(Arange("rn", Index(sympy.Integer(0)), "BLOCK_DN", 1, 2))
    rm, rs, rn, pid_b = tile_symbol("pid"), tile_symbol("rs"), tile_symbol("rn"), tile_symbol("pid_b")
    s_ok = bound_check(b, rs, splits, bs, "smask")
    n_ok = bound_check(b, rn, DN, dn, "nmask")
    running = {}
    for st in reduces:
        node = graph[st.node]
        part = b.scratch[_part_name(plan, st.node)]
        ident = identity_const(node.combiner, part.dtype)
        v = b.value(Load(part.name, (Index(rs), Index(pid_b), Index(rm)), part.dtype), mask=s_ok)
        if s_ok is not None:
            v = b.let(where(s_ok, v, ident), "part")
        raw = v  # a producer's per-split value is the base its consumers' partial sums were built on
        if st.repair is not None:
            v = rebase(b, graph, v, st.repair, running)
        comb = SUM if st.repair is not None else node.combiner.tile
        red = b.fresh("red")
        b.emit(ReduceTile(red, v, comb, 0, part.dtype))
        total = Var(red, part.dtype)
        running[st.node] = (b.let(_finished(raw, node), "prev"), b.let(_finished(total, node), "run"))
        b.bound[st.node] = running[st.node][1]
    part_acc = b.scratch[_part_name(plan, "acc")]
    a_mask = land(s_ok, n_ok)
    accd = part_acc.dtype
    acc = b.value(Load(part_acc.name, (Index(rs), Index(pid_b), Index(rm), Index(rn)), accd), mask=a_mask)
    if a_mask is not None:
        acc = b.let(where(a_mask, acc, Const(0.0, accd)), "part")
    if o_stage.repair is not None:
        acc = rebase(b, graph, acc, o_stage.repair, running)
    red = b.fresh("out")
    b.emit(ReduceTile(red, acc, SUM, 0, accd))
    acc = Var(red, accd)
    coords, at = coordinates(con, o_node, unravel_sym(pid_b, batch_shape) if batch_shape else ())
    _finish(b, graph, plan, acc, rm, rn, None, n_ok, coords, at)
    return TileKernel(f"{plan.name}_merge", b.finish_params(), {"BLOCK_S": bs, "BLOCK_DN": dn}, numel=M * DN * nbatch,
                      grid=(M, nbatch), body=b.body, num_warps=4 if dn >= 128 else 2, num_stages=1,
                      reads=b.reads, writes=b.writes, kind=KernelKind.FLASH_MERGE, plan=plan,
                      scratch=dict(partial.scratch))


def _interior_keys(info, row, key, start, stop, bn):
    """(first, last, edit): the tile-aligned key range [first, last) inside [start, stop) where
    the program's mask holds for no row of the block, and the rewrite that drops the mask from
    the bodies there — or None when the mask is not exactly a set of unit-linear bounds."""
    from ..fusion.masking import HI, LO, full_key_range

    masked = info.masked
    if masked is None:
        return None
    full = full_key_range(masked, row, key)
    if full is None:
        return None
    lower, upper = full
    lo = tile_symbol("pid") * tile_symbol("BLOCK_M")
    first, last = start, stop
    if lower is not None:
        ceil_tile = floordiv(lower.subs(HI, lo + tile_symbol("BLOCK_M") - 1) + bn - 1, bn) * bn
        first = smin(stop, smax(start, ceil_tile))
    if upper is not None:
        floor_tile = floordiv(upper.subs(LO, lo) + 1, bn) * bn
        last = smax(first, smin(stop, floor_tile))
    return first, last, without_mask(masked)


def _finished(value, node):
    """A carried value as the reduction's result dtype (any/all accumulate as int32)."""
    if node.combiner.logical:
        return binary("ne", value, Const(0, value.dtype))
    return cast(value, node.dtype)


def _work_trend(start, stop, M, bm: int, bn: int) -> int:
    """+1 where the last block of rows visits more key tiles than the first (a causal mask's
    forward and dQ kernels), -1 where fewer (its dK/dV kernel), 0 where as many or unknown.
    Launched in the natural order, the longest programs of the first kind would start last,
    and the grid's last wave would wait on them."""
    if not sympy.sympify(M).is_Integer:
        return 0
    blocks = -(-int(M) // bm)
    if blocks < 2:
        return 0
    sizes = {tile_symbol("BLOCK_M"): bm, tile_symbol("BLOCK_N"): bn}
    work = [sympy.sympify(stop - start).subs({**sizes, tile_symbol("pid"): p}) for p in (0, blocks - 1)]
    if not all(w.is_Integer for w in work) or int(work[0]) == int(work[1]):
        return 0
    return 1 if int(work[1]) > int(work[0]) else -1


#: the bytes of streamed operands (keys and values of a batch element) that the programs
#: running at once may share through the L2 cache (a fraction of a data-centre GPU's 40-60 MB)
L2_SHARE = 8 << 20


def _launch_group(N, DN, scores, batch_shape) -> int:
    """How many batch elements launch together (`ProgramId.group`): as many as keep their
    streamed operands within L2_SHARE, at least 1 (the natural order: one batch element's
    blocks after another's), 0 for one batch element or symbolic sizes."""
    nbatch = sympy.Mul(*batch_shape) if batch_shape else sympy.Integer(1)
    widths = [sympy.sympify(sc.extent) for sc in scores] + [sympy.sympify(DN)]
    if not (nbatch.is_Integer and int(nbatch) > 1 and sympy.sympify(N).is_Integer
            and all(w.is_Integer for w in widths)):
        return 0
    streamed = int(N) * sum(int(w) for w in widths) * 2  # (bf16/fp16: the operands that matter here)
    return max(1, min(int(nbatch), L2_SHARE // max(streamed, 1)))


def _diagonal_exists(info, M, N) -> bool:
    """Whether every softmax row i has a key j = i: there are at least as many keys as rows.
    An attention kernel's rows are the queries; a recomputing plan's (the attention backward)
    may be the keys — dK/dV walks the queries — so there both counts must be equal."""
    keys_cover = sympy.sympify(N - M).is_nonnegative is True
    if info.scores:
        return keys_cover and sympy.sympify(M - N).is_nonnegative is True
    return keys_cover


def live_keys(info, row, key, M, N):
    """The key range a block of query rows must visit (block skipping of masked tiles)."""
    from ..fusion.masking import HI, LO, live_key_range

    start, stop = sympy.Integer(0), N
    masked = info.masked
    if masked is None or not info.skippable:
        return start, stop  # no mask, or some reduction still needs the masked keys: skip nothing
    lower, upper = live_key_range(masked, row, key, diagonal_exists=_diagonal_exists(info, M, N))
    lo = tile_symbol("pid") * tile_symbol("BLOCK_M")
    if lower is not None:
        first = smax(0, lower.subs(LO, lo))
        start = floordiv(first, tile_symbol("BLOCK_N")) * tile_symbol("BLOCK_N")
    if upper is not None:
        stop = smin(N, upper.subs(HI, lo + tile_symbol("BLOCK_M") - 1) + 1)
    return start, stop


def current_flash_schedule(graph: Graph, plan: KernelPlan, options: LoweringOptions) -> Schedule:
    """The tiles, warps, stages and split the lowering uses: a tuned schedule, else the
    `flash_config` knob, else the rules."""
    return _tiles_schedule(graph, plan, options).replace(split=split_factor(graph, plan, options))


def shrink_flash(plan: KernelPlan, schedule: Schedule, resource: str, options: LoweringOptions) -> Schedule | None:
    if schedule.get("row_tiles", 1) > 1:  # one row tile per program before smaller tiles
        return schedule.replace(row_tiles=1)
    return shrink_dot_tiles(schedule, resource, ("BLOCK_M", "BLOCK_N"))


def flash_time(space, schedule: Schedule, c) -> float:
    """The dots per key tile (two for attention) against the exp/max/sum per score, or the K
    and V traffic of every block of rows, whichever is larger; a split adds its merge kernel.
    Row tiles change only the rows per program: whether one tile's exponentials overlap the
    other's products is measured (the space's `families`), not predicted."""
    s = space.sizes
    M, N, D, batch = s.get("M"), s.get("N"), s.get("D"), s.get("batch") or 1
    if None in (M, N, D):
        return math.inf
    bm, bn, warps, stages = schedule["BLOCK_M"], schedule["BLOCK_N"], schedule["warps"], schedule["stages"]
    split, row_tiles = schedule.get("split", 1), schedule.get("row_tiles", 1)
    rows = bm * row_tiles  # a program's rows
    programs = math.ceil(M / rows) * batch * split
    smem = stages * bn * 2 * D * space.itemsize + rows * D * space.itemsize
    slots = concurrency(smem, warps, c.sm_count)
    waves = math.ceil(programs / slots)
    keys = math.ceil(N / split / bn) * bn
    flops = 2.0 * (s.get("dots") or 2) * rows * keys * D  # score and output dots per key tile
    vector = 10.0 * rows * keys  # exp2, max, sum, scale per score
    per_sm = min(slots // c.sm_count, math.ceil(programs / c.sm_count))
    sm_rate = c.matrix_flops / c.sm_count * tile_efficiency(bm, min(bn, D), warps)
    t_compute = waves * per_sm * max(flops / sm_rate, vector / (c.vector_flops / c.sm_count))
    kv_bytes = math.ceil(M / rows) * batch * N * 2 * D * space.itemsize
    t_memory = kv_bytes / c.bandwidth
    merge = 4e-6 if split > 1 else 0.0
    return max(t_compute, t_memory) * (1.0 + 0.15 / stages) + 3e-6 + merge


FAMILY = KernelFamily(PlanKind.FLASH, lower=lower_flash_kernels, space=flash_space,
                      schedule=current_flash_schedule, shrink=shrink_flash, cost=flash_time, tuned_on_cpu=False)

__all__ = ["FAMILY", "lower_flash", "lower_flash_kernels", "lower_flash_merge", "split_factor", "choose_splits",
           "flash_space", "current_flash_schedule", "shrink_flash", "flash_time"]
