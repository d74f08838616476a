"""Lowering of kernel plans to tile IR: pointwise, reduction and contraction kernels.

* pointwise: a 1-D tile of XBLOCK elements per program;
* reduction: a [XBLOCK, RBLOCK] tile; the reduction axis is held whole (persistent row) when
  it is static and at most `persistent_reduction_limit`, otherwise walked in RBLOCK steps with
  elementwise accumulators, one pass per dependency level of the plan's reductions (a
  symbolic length: both, chosen at launch by the actual length, `tile.variants`);
* contraction: a [BLOCK_M, BLOCK_N] output tile per program (grouped ordering), a loop over
  K in BLOCK_K steps with `dot`, then the epilogue stages on the accumulator.
"""
from __future__ import annotations

import sympy

from ..fusion.plan import KernelPlan
from ..fusion.planner import unravel_sym
from ..ir.expr import Cast, Const, Expr, Index, Var, binary, cast, out_index, red_index, where
from ..ir.graph import Graph
from .builder import KernelBuilder, land
from .common import (LoweringOptions, bound_check, dot_accumulator, dot_operand, index_values, lane_ranges, mapped,
                     needs_int64, pow2, static_int, tile_symbol)
from .flash import flash_space, lower_flash, lower_flash_kernels
from .ir import Arange, DescriptorLoad, DotTile, For, Full, Let, MakeDescriptor, ProgramId, TileKernel
from .reduction import lower_reduction, reduction_space


def lower_plan_kernels(graph: Graph, plan: KernelPlan, options: LoweringOptions) -> list[TileKernel]:
    """The kernels implementing one plan: one, or a split flash kernel and its merge."""
    if plan.kind == "flash":
        return lower_flash_kernels(graph, plan, options)
    return [lower_plan(graph, plan, options)]


def schedule_space(graph: Graph, plan: KernelPlan, options: LoweringOptions):
    """The plan's tunable space (None: nothing to tune, the rules decide)."""
    if plan.kind == "contraction":
        return contraction_space(graph, plan, options)
    if plan.kind == "flash":
        return flash_space(graph, plan, options)
    if plan.kind == "reduction":
        return reduction_space(graph, plan, options)
    if plan.kind == "pointwise":
        return pointwise_space(graph, plan, options)
    return None


def lower_plan(graph: Graph, plan: KernelPlan, options: LoweringOptions) -> TileKernel:
    if plan.kind == "pointwise":
        return lower_pointwise(graph, plan, options)
    if plan.kind == "reduction":
        return lower_reduction(graph, plan, options)
    if plan.kind == "contraction":
        return lower_contraction(graph, plan, options)
    if plan.kind == "flash":
        return lower_flash(graph, plan, options)
    raise ValueError(plan.kind)


# ------------------------------------------------------------------------------ pointwise
def pointwise_rules(plan: KernelPlan, options: LoweringOptions) -> dict:
    block = 1024 if not options.interpret else 256
    if options.target == "cpu":  # one program is a vectorised loop: amortise its start
        block = 2048
    nv = static_int(plan.parallel)
    if nv is not None:
        block = min(block, max(16, pow2(nv)))
    return {"XBLOCK": block, "warps": 4 if block >= 512 else 2}


def pointwise_space(graph: Graph, plan: KernelPlan, options: LoweringOptions):
    """Elements per program and warps."""
    from .space import ScheduleSpace, memory_bytes

    n = static_int(plan.parallel)
    cap = max(16, pow2(n)) if n is not None else 1 << 30
    if options.target == "cpu":  # elements per program (one OpenMP task, one vectorised loop)
        knobs = {"XBLOCK": tuple(x for x in (512, 1024, 2048, 4096, 8192) if x <= cap) or (cap,), "warps": (1,)}
        return ScheduleSpace("memory", knobs, pointwise_rules(plan, options),
                             sizes={"programs": n, "rows": n, "R": 1, "bytes": memory_bytes(graph, plan)})
    knobs = {"XBLOCK": tuple(x for x in (256, 512, 1024, 2048, 4096) if x <= cap) or (cap,), "warps": (2, 4, 8)}
    return ScheduleSpace("memory", knobs, pointwise_rules(plan, options),
                         sizes={"programs": n, "rows": n, "R": 1, "bytes": memory_bytes(graph, plan)},
                         valid=lambda cfg: cfg["XBLOCK"] >= 32 * cfg["warps"])


def lower_pointwise(graph: Graph, plan: KernelPlan, options: LoweringOptions) -> TileKernel:
    b = KernelBuilder(graph, plan.name, options.divisor_checks)
    b.tile_symbols |= {"pid", "xindex"}
    n = plan.parallel
    b.size_params(n)
    b.emit(ProgramId("pid", 0, wide=needs_int64(n)))
    x = tile_symbol("xindex")
    b.emit(Arange("xindex", Index(tile_symbol("pid") * tile_symbol("XBLOCK")), "XBLOCK", 0, 1))
    rules = pointwise_rules(plan, options)
    if options.schedule:
        rules.update(options.schedule)
    block, warps = rules["XBLOCK"], rules["warps"]
    xmask = bound_check(b, x, n, block, "xmask")
    for st in plan.stages:
        node = graph[st.node]
        if st.kind == "scatter":
            _store_scattered(b, graph, st, x, n, xmask)
            continue
        vals = index_values(node.shape, x, {x: n})
        v = b.value(mapped(st.body, out_index(node.rank), vals), mask=xmask)
        b.store(node.name, tuple(Index(e) for e in vals), v, xmask)
    return TileKernel(plan.name, b.finish_params(), {"XBLOCK": block}, numel=n,
                      grid=(sympy.ceiling(n / tile_symbol("XBLOCK")),), body=b.body, num_warps=warps,
                      reads=b.reads, writes=b.writes, kind="pointwise", plan=plan)


def _store_scattered(b: KernelBuilder, graph: Graph, st, x, n, xmask) -> None:
    """A scatter stage: each value of the written space goes to its (data-dependent) position
    in the target input; a position outside the target is not written."""
    node = graph[st.node]
    target, index = st.scatter
    symbols = out_index(len(node.space))
    vals = index_values(node.space, x, {x: n})
    v = b.value(mapped(st.body, symbols, vals), mask=xmask)
    where, inside = [], xmask
    for comp, extent in zip(index, graph[target].shape):
        comp = mapped(comp, symbols, vals)
        if not isinstance(comp, Index):
            comp = b.value(comp, mask=xmask)
            ok = binary("logical_and", binary("ge", comp, Const(0, comp.dtype)), binary("lt", comp, Index(extent)))
            inside = land(inside, b.let(ok, "inside"))
            b.size_params(extent)
        where.append(comp)
    b.store(target, tuple(where), v, inside)


# ------------------------------------------------------------------------------ contraction


def _contraction_sizes(graph: Graph, plan: KernelPlan) -> tuple:
    c = plan.contraction
    node = graph[plan.stages[0].node]
    return node.shape[c.m_dim], node.shape[c.n_dim], node.ranges[0], tuple(node.shape[d] for d in c.batch_dims)


def contraction_rules(graph: Graph, plan: KernelPlan, options: LoweringOptions) -> dict:
    """The fixed rule's tiles: 128×128×64, 8 warps for bf16/fp16; 64×64×32 for fp32; clipped
    to small static extents."""
    c = plan.contraction
    M, N, K, _ = _contraction_sizes(graph, plan)
    low = all(dot_operand(f)[1].is_low_precision for f in (c.a, c.b))
    if options.target == "cpu":  # acc, A and B tiles fit the L1 cache together
        cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "warps": 1, "stages": 1}
    elif options.interpret:
        cfg = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "warps": 4, "stages": 1}
    elif low:
        cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "warps": 8, "stages": 3}
    else:
        cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "warps": 4, "stages": 3}
    for key, dim in (("BLOCK_M", M), ("BLOCK_N", N), ("BLOCK_K", K)):
        v = static_int(dim)
        if v is not None:
            cfg[key] = min(cfg[key], max(16, pow2(v)))
    return cfg


def contraction_space(graph: Graph, plan: KernelPlan, options: LoweringOptions):
    """Tiles, warps, pipeline stages and grouped ordering of a blocked `dot` kernel."""
    from .space import SMEM_PER_BLOCK, ScheduleSpace

    c = plan.contraction
    M, N, K, batch = _contraction_sizes(graph, plan)
    low = all(dot_operand(f)[1].is_low_precision for f in (c.a, c.b))
    item = 2 if low else dot_accumulator(c.a, c.b).itemsize
    statics = {n: static_int(v) for n, v in (("M", M), ("N", N), ("K", K))}
    caps = {"BLOCK_M": statics["M"], "BLOCK_N": statics["N"], "BLOCK_K": statics["K"]}
    if options.target == "cpu":  # register/L1 blocking of the C++ loop nest
        knobs = {"BLOCK_M": (16, 32, 64), "BLOCK_N": (32, 64, 128), "BLOCK_K": (16, 32, 64),
                 "GROUP_M": (8,), "warps": (1,), "stages": (1,)}
    elif low:
        knobs = {"BLOCK_M": (64, 128, 256), "BLOCK_N": (64, 128, 256), "BLOCK_K": (32, 64, 128),
                 "GROUP_M": (8,), "warps": (4, 8), "stages": (3, 4, 5)}
    else:
        knobs = {"BLOCK_M": (32, 64, 128), "BLOCK_N": (32, 64, 128), "BLOCK_K": (16, 32),
                 "GROUP_M": (8,), "warps": (4, 8), "stages": (2, 3, 4)}

    def valid(cfg):
        for key, cap in caps.items():
            if cap is not None and cfg[key] > max(16, pow2(cap)):
                return False
        smem = cfg["stages"] * (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * item
        acc_regs = cfg["BLOCK_M"] * cfg["BLOCK_N"] // (32 * cfg["warps"])  # fp32 accumulators per thread
        return smem <= SMEM_PER_BLOCK and acc_regs <= 128

    nbatch = static_int(sympy.Mul(*batch)) if batch else 1
    sizes = {k: v for k, v in statics.items()} | {"batch": nbatch}
    default = contraction_rules(graph, plan, options)
    if options.tma and not options.interpret and _described(graph, plan) is not None:
        # Hopper: operands through TMA descriptors, optionally one persistent program per SM
        # walking the output tiles (pointer loads gain nothing from persistence: not offered)
        knobs["tma"], knobs["persistent"] = (0, 1), ((0, 1) if options.sm_count else (0,))
        default["tma"] = default["persistent"] = 0
        tiles_ok = valid

        def valid(cfg):
            return tiles_ok(cfg) and (cfg["tma"] or not cfg["persistent"])
    if options.matmul != "generated" and not options.interpret:
        from .matmul_views import matmul_views

        if matmul_views(graph, plan) is not None:  # nothing fused: the library's matmul is a candidate
            knobs["impl"], default["impl"] = ("generated", "aten"), "generated"
            tiles = valid

            def valid(cfg):  # the library ignores the tile knobs: one "aten" configuration
                if cfg["impl"] == "aten":
                    return all(cfg[k] == v for k, v in default.items() if k != "impl")
                return tiles(cfg)
    return ScheduleSpace("contraction", knobs, default, sizes=sizes, itemsize=item, valid=valid,
                         families=tuple(k for k in ("impl", "persistent") if k in knobs))


def lower_contraction(graph: Graph, plan: KernelPlan, options: LoweringOptions) -> TileKernel:
    b = KernelBuilder(graph, plan.name, options.divisor_checks)
    c = plan.contraction
    main = plan.stages[0]
    node = graph[main.node]
    M, N, K = node.shape[c.m_dim], node.shape[c.n_dim], node.ranges[0]
    batch_shape = tuple(node.shape[d] for d in c.batch_dims)
    for e in (M, N, K, *batch_shape):
        b.size_params(e)
    b.tile_symbols |= {"pid", "pid_b", "rm", "rn", "rka", "rkb", "koffset", "pid_m", "pid_n"}
    chosen = contraction_rules(graph, plan, options)
    if options.schedule:
        chosen.update(options.schedule)
    chosen.pop("impl", None)  # "aten" never reaches a lowering (the driver runs ATen instead)
    warps, stages = chosen.pop("warps"), chosen.pop("stages")
    use_tma, persistent = bool(chosen.pop("tma", 0)), bool(chosen.pop("persistent", 0))
    cfg = chosen
    BM, BN, BK, G = (tile_symbol(n) for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"))
    wide = any(needs_int64(*sizes) for sizes in ((M, K, *batch_shape), (K, N, *batch_shape), (M, N, *batch_shape)))
    described = _described(graph, plan) if use_tma and not wide else None
    persistent = persistent and described is not None and options.sm_count > 0
    num_m, num_n = sympy.ceiling(M / BM), sympy.ceiling(N / BN)
    b.tile_symbols |= {"pid_first", "tile", "desc_a", "desc_b"}
    if persistent:  # one program per SM walks the output tiles; its loads overlap the last epilogue
        cfg["NUM_SMS"] = options.sm_count
        b.emit(ProgramId("pid_first", 0))
    else:
        b.emit(ProgramId("pid", 0, wide=wide))
        b.emit(ProgramId("pid_b", 1, wide=wide))
    for name, d in zip(("desc_a", "desc_b"), described or ()):
        b.buffer(d.buffer)
        b.size_params(d.base)
        for e in (*d.shape, d.row_stride):
            b.size_params(e)
        b.emit(MakeDescriptor(name, d.buffer, Index(d.base), tuple(Index(e) for e in d.shape),
                              (Index(d.row_stride), Index(sympy.Integer(1))), d.block))
    if persistent:
        tiles = For("tile", Index(tile_symbol("pid_first")), Index(num_m * num_n), "NUM_SMS", flatten=True)
        b.emit(tiles)
        b.push_block(tiles.body)
        b.emit(Let("pid", Index(tile_symbol("tile"))))
    pid, pid_b = tile_symbol("pid"), tile_symbol("pid_b")
    group = sympy.floor(pid / (G * num_n))
    first_m = group * G
    size_m = sympy.Min(num_m - first_m, G)
    b.emit(Let("pid_m", Index(first_m + sympy.Mod(pid, size_m))))
    b.emit(Let("pid_n", Index(sympy.floor(sympy.Mod(pid, G * num_n) / size_m))))
    b.emit(Arange("rm", Index(tile_symbol("pid_m") * BM), "BLOCK_M", 0, 2))
    b.emit(Arange("rn", Index(tile_symbol("pid_n") * BN), "BLOCK_N", 1, 2))
    rm, rn = tile_symbol("rm"), tile_symbol("rn")
    batch_vals = unravel_sym(pid_b, batch_shape) if batch_shape else ()
    outs = out_index(node.rank)
    (r0,) = red_index(1)

    def dims(m_val, n_val):
        vals = [None] * node.rank
        vals[c.m_dim], vals[c.n_dim] = m_val, n_val
        for d, v in zip(c.batch_dims, batch_vals):
            vals[d] = v
        return vals

    m_ok = bound_check(b, rm, M, cfg["BLOCK_M"], "mmask")  # loop-invariant: before the K loop
    n_ok = bound_check(b, rn, N, cfg["BLOCK_N"], "nmask")
    acc, accd = b.fresh("acc"), dot_accumulator(c.a, c.b)
    b.emit(Full(acc, ("BLOCK_M", "BLOCK_N"), 0.0, accd))
    loop = For("koffset", Index(sympy.Integer(0)), Index(K), "BLOCK_K")
    b.emit(loop)
    b.push_block(loop.body)
    b.emit(Arange("rka", Index(tile_symbol("koffset")), "BLOCK_K", 1, 2))
    b.emit(Arange("rkb", Index(tile_symbol("koffset")), "BLOCK_K", 0, 2))
    rka, rkb = tile_symbol("rka"), tile_symbol("rkb")
    ka_ok = bound_check(b, rka, K, cfg["BLOCK_K"], "kamask")
    kb_ok = bound_check(b, rkb, K, cfg["BLOCK_K"], "kbmask")
    mask_a = land(m_ok, ka_ok)
    mask_b = land(kb_ok, n_ok)
    operands = []
    coords = {"BLOCK_M": tile_symbol("pid_m") * BM, "BLOCK_N": tile_symbol("pid_n") * BN, "BLOCK_K": tile_symbol("koffset")}
    for k, (factor, m_val, n_val, k_val, mask) in enumerate(((c.a, rm, 0, rka, mask_a), (c.b, 0, rn, rkb, mask_b))):
        expr, in_dtype = dot_operand(factor)
        if described is not None:  # a block through the descriptor: out-of-range elements read 0
            d, name = described[k], b.fresh("blk")
            b.emit(DescriptorLoad(name, ("desc_a", "desc_b")[k], tuple(Index(coords[n]) for n in d.block),
                                  graph[d.buffer].dtype, d.transpose))
            operands.append((Var(name, graph[d.buffer].dtype), in_dtype))
            continue
        expr = mapped(expr, outs, dims(m_val, n_val))
        expr = mapped(expr, (r0,), (k_val,))
        v = b.value(expr, mask=mask)
        if mask is not None and not _is_plain_load(expr):
            v = b.let(where(mask, v, Const(0.0, v.dtype)), "op")  # a prologue may map 0 to non-0
        operands.append((v, in_dtype))
    (a_v, a_dt), (b_v, b_dt) = operands
    dot_dtype = a_dt if a_dt == b_dt and a_dt.is_low_precision and not options.interpret else accd
    b.emit(DotTile(acc, a_v, b_v, Var(acc, accd), dot_dtype))
    b.pop_block()

    omask = land(m_ok, n_ok)
    omask = b.let(omask, "omask") if omask is not None else None
    out_vals = dims(rm, rn)
    b.bound[node.name] = b.let(cast(Var(acc, accd), node.dtype), "mm")
    if main.store:
        b.store(node.name, tuple(Index(v) for v in out_vals), b.bound[node.name], omask)
    flat = sum((v * s for v, s in zip(out_vals, _contig(node.shape))), sympy.Integer(0))
    for st in plan.stages[1:]:
        enode = graph[st.node]
        if tuple(enode.shape) == tuple(node.shape):
            vals = out_vals
        else:
            ranges = lane_ranges(out_vals, node.shape)
            if batch_shape:
                ranges[pid_b] = sympy.Mul(*batch_shape)
            vals = index_values(enode.shape, flat, ranges)
        v = b.value(mapped(st.body, out_index(enode.rank), vals), mask=omask)
        b.bound[enode.name] = v  # later epilogues read it from registers
        b.store(enode.name, tuple(Index(e) for e in vals), v, omask)

    if persistent:
        b.pop_block()
    nbatch = sympy.Mul(*batch_shape) if batch_shape else sympy.Integer(1)
    grid = (sympy.Min(tile_symbol("NUM_SMS"), num_m * num_n), 1) if persistent else (num_m * num_n, nbatch)
    return TileKernel(plan.name, b.finish_params(), cfg, numel=M * N * nbatch, grid=grid, body=b.body,
                      num_warps=warps, num_stages=stages, reads=b.reads, writes=b.writes,
                      kind="contraction", plan=plan)


def _described(graph: Graph, plan: KernelPlan):
    """The operands as tensor-descriptor views, or None (see `tile.descriptors`)."""
    from .descriptors import describe_operands

    c = plan.contraction
    return describe_operands(graph, plan, dot_operand(c.a)[0], dot_operand(c.b)[0])


def _is_plain_load(e: Expr) -> bool:
    from ..ir.expr import Load

    while isinstance(e, Cast):
        e = e.x
    return isinstance(e, Load)


def _contig(shape):
    from .builder import contiguous_strides

    return contiguous_strides(shape)


__all__ = ["lower_plan", "lower_plan_kernels", "schedule_space", "LoweringOptions", "land", "lane_ranges"]
