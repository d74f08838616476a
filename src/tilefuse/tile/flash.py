"""Lowering of attention-shaped ("flash") plans: one program per block of query rows.

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

import sympy

from ..fusion.flash import K0
from ..fusion.plan import KernelPlan
from ..fusion.planner import unravel_sym
from ..ir import dtypes as dt
from ..ir.expr import Const, Index, Var, binary, cast, out_index, red_index, where
from ..ir.graph import Graph
from .builder import KernelBuilder, contiguous_strides, land
from .ir import Arange, Assign, DotTile, For, Full, ProgramId, ReduceTile, TileKernel
from .lower import (LoweringOptions, _dot_operand, _index_values, _mapped, _needs_int64, _pow2, _static, _sym, bound_check,
                    full_tile, identity)
from .reduction import _TILE_COMBINER, _acc_dtype, _combine, rebase


def lower_flash(graph: Graph, plan: KernelPlan, options: LoweringOptions) -> TileKernel:
    info = plan.flash
    con = plan.contraction
    stages = {st.kind: st for st in plan.stages if st.kind in ("score", "contraction")}
    reduces = [st for st in plan.stages if st.kind == "reduce"]
    epilogues = [st for st in plan.stages if st.kind == "row"]
    o_stage = stages["contraction"]
    o_node = graph[o_stage.node]
    s_node = graph[stages["score"].node]
    M, DN, N = o_node.shape[con.m_dim], o_node.shape[con.n_dim], o_node.ranges[0]
    DK = info.score_extent
    batch_shape = tuple(o_node.shape[d] for d in con.batch_dims)
    low = _dot_operand(info.q)[1].is_low_precision
    # 64×64, 4 warps, 3 stages measured best of a small sweep on the H200 (docs/benchmarks.md)
    bm, bn = (32, 32) if options.interpret else ((64, 64) if low else (64, 32))
    mv = _static(M)
    if mv is not None:
        bm = min(bm, max(16, _pow2(mv)))
    warps = 4
    stages = 1 if options.interpret else 3
    if options.flash_config:
        bm, bn, warps, stages = (int(v) for v in options.flash_config.split(","))
    dn, dk = max(16, _pow2(_static(DN))), max(16, _pow2(_static(DK)))
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_DN": dn, "BLOCK_DK": dk}

    b = KernelBuilder(graph, plan.name)
    b.tile_symbols |= {"pid", "pid_b", "rm", "rn", "rj", "rjb", "kq", "kk", "joffset"}
    for e in (M, DN, N, DK, *batch_shape):
        b.size_params(e)
    wide = _needs_int64(M, N, DN, *batch_shape) or _needs_int64(M, DK, *batch_shape)
    b.emit(ProgramId("pid", 0, wide=wide))
    b.emit(ProgramId("pid_b", 1, wide=wide))
    b.emit(Arange("rm", Index(_sym("pid") * _sym("BLOCK_M")), "BLOCK_M", 0, 2))
    b.emit(Arange("rn", Index(sympy.Integer(0)), "BLOCK_DN", 1, 2))
    b.emit(Arange("kq", Index(sympy.Integer(0)), "BLOCK_DK", 1, 2))
    b.emit(Arange("kk", Index(sympy.Integer(0)), "BLOCK_DK", 0, 2))
    rm, rn, kq, kk, rj, rjb = (_sym(n) for n in ("rm", "rn", "kq", "kk", "rj", "rjb"))
    batch_vals = unravel_sym(_sym("pid_b"), batch_shape) if batch_shape else ()
    outs = out_index(o_node.rank)
    (r0,) = red_index(1)

    def coords(m_val, n_val, key_val, k0_val=None):
        vals = {}
        for d, v in zip(con.batch_dims, batch_vals):
            vals[outs[d]] = v
        vals[outs[con.m_dim]], vals[outs[con.n_dim]], vals[r0] = m_val, n_val, key_val
        if k0_val is not None:
            vals[K0] = k0_val
        return list(vals), list(vals.values())

    def at(expr, m_val, n_val, key_val, k0_val=None):
        syms, vals = coords(m_val, n_val, key_val, k0_val)
        return _mapped(expr, syms, vals)

    m_ok = bound_check(b, rm, M, bm, "mmask")
    n_ok = bound_check(b, rn, DN, dn, "nmask")
    kq_ok = bound_check(b, kq, DK, dk, "kqmask")
    kk_ok = bound_check(b, kk, DK, dk, "kkmask")
    q_expr, q_dtype = _dot_operand(info.q)
    q_mask = land(m_ok, kq_ok)
    q_tile = b.value(at(q_expr, rm, 0, 0, kq), mask=q_mask)  # loop-invariant: loaded once
    if q_mask is not None:
        q_tile = b.let(where(q_mask, q_tile, Const(0.0, q_tile.dtype)), "q")

    state = {}
    for st in reduces:
        node = graph[st.node]
        name = b.fresh("acc")
        accd = _acc_dtype(node.combiner, st.body.dtype)
        b.emit(Full(name, ("BLOCK_M", 1), identity(node.combiner, accd), accd))
        state[st.node] = Var(name, accd)
    acc = Var(b.fresh("acc"), dt.float32)
    b.emit(Full(acc.name, ("BLOCK_M", "BLOCK_DN"), 0.0, dt.float32))

    start, stop = _live_keys(info, reduces, graph, outs[con.m_dim], r0, N)
    if start != 0 or stop != N:
        plan.notes.append(f"{o_node.name}: key tiles outside [{start}, {stop}) are fully masked for the "
                          f"row block and skipped")
    loop = For("joffset", Index(start), Index(stop), "BLOCK_N")
    b.emit(loop)
    b.push_block(loop.body)
    b.emit(Arange("rj", Index(_sym("joffset")), "BLOCK_N", 1, 2))
    b.emit(Arange("rjb", Index(_sym("joffset")), "BLOCK_N", 0, 2))
    j_ok = bound_check(b, rj, N, bn, "jmask")
    jb_ok = bound_check(b, rjb, N, bn, "jbmask")
    k_expr, k_dtype = _dot_operand(info.k)
    k_mask = land(kk_ok, j_ok)
    k_tile = b.value(at(k_expr, 0, 0, rj, kk), mask=k_mask)
    if k_mask is not None:
        k_tile = b.let(where(k_mask, k_tile, Const(0.0, k_tile.dtype)), "k")
    s_acc = b.fresh("s")
    b.emit(Full(s_acc, ("BLOCK_M", "BLOCK_N"), 0.0, dt.float32))
    dot_dtype = q_dtype if q_dtype == k_dtype and q_dtype.is_low_precision and not options.interpret else dt.float32
    b.emit(DotTile(s_acc, q_tile, k_tile, Var(s_acc, dt.float32), dot_dtype))
    b.bound[s_node.name] = b.let(cast(Var(s_acc, dt.float32), s_node.dtype), "score")
    tile_mask = land(m_ok, j_ok)
    tile_mask = b.let(tile_mask, "tmask") if tile_mask is not None else None

    running, updates = {}, []
    for st in reduces:
        node = graph[st.node]
        carried = state[st.node]
        v = cast(b.value(at(st.body, rm, 0, rj), mask=tile_mask), carried.dtype)
        ident = Const(identity(node.combiner, carried.dtype), carried.dtype) if not carried.dtype.is_float \
            else Const(float(identity(node.combiner, carried.dtype)), carried.dtype)
        contrib = full_tile(b, where(tile_mask, v, ident) if tile_mask is not None else v, ("BLOCK_M", "BLOCK_N"))
        red = b.fresh("red")
        comb = _TILE_COMBINER.get(node.combiner, node.combiner)
        if comb != "sum":
            b.helpers.add(comb)
        b.emit(ReduceTile(red, contrib, comb, 1, carried.dtype))
        red_v = Var(red, carried.dtype)
        if st.repair is not None:
            value = b.let(binary("add", rebase(b, graph, carried, st.repair, running), red_v), "carry")
        else:
            value = b.let(_combine(b, comb, carried, red_v), "carry")
        running[st.node] = (b.let(_finished(carried, node), "prev"), b.let(_finished(value, node), "run"))
        b.bound[st.node] = running[st.node][1]
        updates.append(Assign(carried.name, value))

    a_expr, a_dtype = _dot_operand(info.a)
    v_expr, v_dtype = _dot_operand(info.b)
    if info.post is not None and v_dtype.is_low_precision:
        a_dtype = v_dtype  # unnormalised weights are rounded for the tensor-core dot
    p_tile = b.value(at(a_expr, rm, 0, rj), mask=tile_mask)
    if tile_mask is not None:
        p_tile = b.let(where(tile_mask, p_tile, Const(0.0, p_tile.dtype)), "p")
    v_mask = land(jb_ok, n_ok)
    v_tile = b.value(at(v_expr, 0, rn, rjb), mask=v_mask)
    if v_mask is not None:
        v_tile = b.let(where(v_mask, v_tile, Const(0.0, v_tile.dtype)), "v")
    rebased = rebase(b, graph, acc, o_stage.repair, running)
    pv = b.fresh("pv")
    b.emit(Full(pv, ("BLOCK_M", "BLOCK_DN"), 0.0, dt.float32))
    pv_dtype = a_dtype if a_dtype == v_dtype and a_dtype.is_low_precision and not options.interpret else dt.float32
    b.emit(DotTile(pv, p_tile, v_tile, Var(pv, dt.float32), pv_dtype))
    updates.append(Assign(acc.name, binary("add", rebased, Var(pv, dt.float32))))
    for u in updates:
        b.emit(u)
    b.pop_block()

    omask = land(m_ok, n_ok)
    omask = b.let(omask, "omask") if omask is not None else None
    for st in reduces:
        b.bound[st.node] = b.let(_finished(state[st.node], graph[st.node]), "red")
    total = acc
    if info.post is not None:
        post = b.value(at(info.post, rm, 0, 0), mask=m_ok)
        total = b.let(binary("mul", acc, cast(post, dt.float32)), "normalised")
        for guard in info.guards:
            g = b.value(at(guard, rm, 0, 0), mask=m_ok)
            total = b.let(where(g, Const(0.0, dt.float32), total), "guarded")
    b.bound[o_node.name] = b.let(cast(total, o_node.dtype), "out")
    syms, vals = coords(rm, rn, 0)
    o_index = tuple(Index(v) if not isinstance(v, Index) else v for v in (dict(zip(syms, vals))[s] for s in outs))
    if o_stage.store:
        b.store(o_node.name, o_index, b.bound[o_node.name], omask)
    flat = sum((c.expr * st_ for c, st_ in zip(o_index, contiguous_strides(o_node.shape))), sympy.Integer(0))
    for st in epilogues:
        enode = graph[st.node]
        vals = [c.expr for c in o_index] if tuple(enode.shape) == tuple(o_node.shape) \
            else list(_index_values(enode.shape, flat, {}))
        v = b.value(_mapped(st.body, out_index(enode.rank), vals), mask=omask)
        b.bound[st.node] = v
        b.store(st.node, tuple(Index(e) for e in vals), v, omask)
    nbatch = sympy.Mul(*batch_shape) if batch_shape else sympy.Integer(1)
    return TileKernel(plan.name, b.finish_params(), cfg, numel=M * DN * nbatch,
                      grid=(sympy.ceiling(M / _sym("BLOCK_M")), nbatch), body=b.body, num_warps=warps,
                      num_stages=stages, reads=b.reads, writes=b.writes, kind="flash",
                      plan=plan, helpers=b.helpers)


def _vanishes_when_masked(body, masked, combiner: str) -> bool:
    """A skipped key tile must contribute the combiner's identity to `body`: the body reads the
    scores only through the masked score expression, and where that is -inf it evaluates to
    the identity (checked on random values of everything else, e.g. exp(-inf - m) == 0)."""
    import random

    import torch

    from ..ir.expr import Load, transform, walk
    from ..ir.interpret import Evaluator

    scores = {e.buffer for e in walk(masked) if isinstance(e, Load)}
    placeholder = Var("__masked__", masked.dtype)
    hidden = transform(body, lambda e: placeholder if e == masked else None)
    if any(isinstance(e, Load) and e.buffer in scores for e in walk(hidden)):
        return False
    ident = {"sum": 0.0, "any": 0.0, "max": float("-inf"), "min": float("inf")}.get(combiner)
    if ident is None:
        return False
    rng = random.Random(0)
    for _ in range(3):
        def leaf(e):
            if e is placeholder or e == placeholder:
                return Const(float("-inf"), e.dtype)
            if isinstance(e, (Load, Index)) and not isinstance(e, Var):
                v = rng.uniform(-4, 4)
                return Const(v if e.dtype.is_float else int(v), e.dtype) if not e.dtype.is_bool else Const(v > 0, e.dtype)
            return None

        value = Evaluator({}, {})(transform(hidden, leaf))
        if float(torch.as_tensor(value).double()) != ident:
            return False
    return True


def _finished(value, node):
    """A carried value as the reduction's result dtype (any/all accumulate as int32)."""
    if node.combiner in ("any", "all"):
        return binary("ne", value, Const(0, value.dtype))
    return cast(value, node.dtype)


def _live_keys(info, reduces, graph, row, key, N):
    """The key range a block of query rows must visit (block skipping of masked tiles)."""
    from .masking import HI, LO, live_key_range

    start, stop = sympy.Integer(0), N
    maxes = [st for st in reduces if graph[st.node].combiner == "max"]
    if not maxes:
        return start, stop
    masked = info.reduce_bodies[maxes[0].node]
    others = [(info.reduce_bodies[st.node], graph[st.node].combiner) for st in reduces if st is not maxes[0]]
    if not all(_vanishes_when_masked(body, masked, combiner) for body, combiner in others + [(info.a, "sum")]):
        return start, stop  # some reduction still needs the masked keys: skip nothing
    lower, upper = live_key_range(masked, row, key)
    lo = _sym("pid") * _sym("BLOCK_M")
    if lower is not None:
        first = sympy.Max(0, lower.subs(LO, lo))
        start = sympy.floor(first / _sym("BLOCK_N")) * _sym("BLOCK_N")
    if upper is not None:
        stop = sympy.Min(N, upper.subs(HI, lo + _sym("BLOCK_M") - 1) + 1)
    return start, stop


__all__ = ["lower_flash"]
