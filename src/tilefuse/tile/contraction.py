"""The contraction kernel family: a [BLOCK_M, BLOCK_N] output tile per program (grouped
ordering), a loop over K in BLOCK_K steps with `dot`, then the epilogue stages on the
accumulator. On Hopper the operands may come through TMA descriptors, optionally from one
persistent program per SM; a plain matmul (nothing fused) may run in the vendor library
instead (the `impl` knob, `fusion.matmul_views`), and a product with an epilogue may run in the
library with the epilogue as its own kernel (`impl=split`, `fusion.library.split_epilogue`).
"""
from __future__ import annotations

import math

import sympy

from ..fusion.plan import KernelPlan, PlanKind
from ..ir.expr import Cast, Const, Expr, Index, Load, Var, cast, out_index, red_index, where
from ..ir.graph import Graph
from ..ir.symbolic import contiguous_strides, floordiv, mod, smin, unravel_sym
from .builder import KernelBuilder, land
from .common import (LoweringOptions, bound_check, dot_accumulator, dot_operand, index_values, lane_ranges, mapped,
                     needs_int64, pow2, static_int, tile_symbol)
from .family import KernelFamily
from .ir import (Arange, DescriptorLoad, DotTile, For, Full, KernelKind, Let, MakeDescriptor, ProgramId,
                 TileKernel)
from .roofline import MEMORY_LATENCY, concurrency, tile_efficiency
from .schedule import Schedule, schedule_over
from .space import SMEM_PER_BLOCK, ScheduleSpace, shrink_dot_tiles


def _contraction_sizes(graph: Graph, plan: KernelPlan) -> tuple:
    c = plan.contraction
    node = graph[plan.stages[0].node]
    return node.shape[c.m_dim], node.shape[c.n_dim], node.ranges[0], tuple(node.shape[d] for d in c.batch_dims)


def contraction_rules(graph: Graph, plan: KernelPlan, options: LoweringOptions) -> Schedule:
    """The fixed rule's tiles: 128×128×64, 8 warps for bf16/fp16; 64×64×32 for fp32; clipped
    to small static extents."""
    c = plan.contraction
    M, N, K, _ = _contraction_sizes(graph, plan)
    low = all(dot_operand(f)[1].is_low_precision for f in (c.a, c.b))
    rows = static_int(M)
    if options.target.on_cpu and rows is not None and rows <= FEW_ROWS_CPU:
        # a vector-matrix loop (a MoE's gathered experts, a decode step): the accumulator is a
        # row, so long K steps (fewer per-step index computations) with a 32×128 B tile that
        # stays in L1 (MoE's gathered product at 16×128×512: 160 -> 121 µs per call)
        rules = Schedule(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, GROUP_M=8, warps=1, stages=1)
    elif options.target.on_cpu:  # acc, A and B tiles fit the L1 cache together
        rules = Schedule(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, warps=1, stages=1)
    elif options.target.interpret:
        rules = Schedule(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=8, warps=4, stages=1)
    elif low:
        rules = Schedule(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, warps=8, stages=3)
    else:
        rules = Schedule(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, warps=4, stages=3)
    for key, dim in (("BLOCK_M", M), ("BLOCK_N", N), ("BLOCK_K", K)):
        v = static_int(dim)
        if v is not None:
            rules = rules.replace(**{key: min(rules[key], max(_min_block(key, options), pow2(v)))})
    return rules


#: products of at most this many rows (static) get the narrow-tile space of a weight-streaming
#: kernel on a GPU
SKINNY_ROWS = 32
#: on a CPU, products of at most this many rows get long K steps (the dots that take a `b` tile
#: stored by columns, `backends.cpu.dot.NT_MAX_ROWS`)
FEW_ROWS_CPU = 4

#: the knobs that are not block sizes (the kernel's constants): the launch's, and the choices of
#: kind of kernel
NOT_BLOCKS = ("impl", "warps", "stages", "tma", "persistent")


def _min_block(key: str, options: LoweringOptions) -> int:
    """The smallest tile of a dot's dim: 16 where Triton's `tl.dot` runs; on CPU rows as few as
    the product has (a product of one row per batch — a MoE's gathered experts, a decode step —
    is a vector-matrix loop, not 16 rows of which 15 are masked)."""
    return 1 if options.target.on_cpu and key == "BLOCK_M" else 16


def contraction_space(graph: Graph, plan: KernelPlan, options: LoweringOptions):
    """Tiles, warps, pipeline stages and grouped ordering of a blocked `dot` kernel."""
    c = plan.contraction
    M, N, K, batch = _contraction_sizes(graph, plan)
    low = all(dot_operand(f)[1].is_low_precision for f in (c.a, c.b))
    item = 2 if low else dot_accumulator(c.a, c.b).itemsize
    statics = {n: static_int(v) for n, v in (("M", M), ("N", N), ("K", K))}
    caps = {"BLOCK_M": statics["M"], "BLOCK_N": statics["N"], "BLOCK_K": statics["K"]}
    if options.target.on_cpu:  # register/L1 blocking of the C++ loop nest
        few = statics["M"] is not None and pow2(statics["M"]) < 16  # (rows as few as the product has)
        knobs = {"BLOCK_M": ((pow2(statics["M"]),) if few else ()) + (16, 32, 64), "BLOCK_N": (32, 64, 128),
                 "BLOCK_K": (16, 32, 64) + ((128,) if few else ()), "GROUP_M": (8,), "warps": (1,), "stages": (1,)}
    elif low:
        knobs = {"BLOCK_M": (64, 128, 256), "BLOCK_N": (64, 128, 256), "BLOCK_K": (32, 64, 128),
                 "GROUP_M": (8,), "warps": (4, 8), "stages": (3, 4, 5)}
    else:
        knobs = {"BLOCK_M": (32, 64, 128), "BLOCK_N": (32, 64, 128), "BLOCK_K": (16, 32),
                 "GROUP_M": (8,), "warps": (4, 8), "stages": (2, 3, 4)}
    if not options.target.on_cpu and statics["M"] is not None and statics["M"] <= SKINNY_ROWS:
        # a decode step's product (a few rows against a large weight) is bound by reading the
        # weight: narrow column tiles give every SM a program, long K tiles and a deep pipeline
        # keep each one streaming
        knobs = {"BLOCK_M": (16, 32), "BLOCK_N": (16, 32, 64, 128), "BLOCK_K": (64, 128, 256, 512),
                 "GROUP_M": (8,), "warps": (2, 4), "stages": (3, 4, 5)}

    def valid(s: Schedule) -> bool:
        for key, cap in caps.items():
            if cap is not None and s[key] > max(_min_block(key, options), pow2(cap)):
                return False
        smem = s["stages"] * (s["BLOCK_M"] + s["BLOCK_N"]) * s["BLOCK_K"] * item
        acc_regs = s["BLOCK_M"] * s["BLOCK_N"] // (32 * s["warps"])  # fp32 accumulators per thread
        return smem <= SMEM_PER_BLOCK and acc_regs <= 128

    nbatch = static_int(sympy.Mul(*batch)) if batch else 1
    sizes = {k: v for k, v in statics.items()} | {"batch": nbatch}
    default = contraction_rules(graph, plan, options)
    if options.target.tma and not options.target.interpret and _described(graph, plan) is not None:
        # Hopper: operands through TMA descriptors, optionally one persistent program per SM
        # walking the output tiles (pointer loads gain nothing from persistence: not offered)
        knobs["tma"], knobs["persistent"] = (0, 1), ((0, 1) if options.target.sm_count else (0,))
        default = default.replace(tma=0, persistent=0)
        tiles_ok = valid

        def valid(s: Schedule) -> bool:
            return tiles_ok(s) and (s["tma"] or not s["persistent"])
    if options.matmul != "generated" and not options.target.interpret and \
            getattr(plan.library, "how", None) != "generated":  # (a small CPU product: generated, not measured)
        from ..fusion.matmul_views import matmul_views

        library = None
        if matmul_views(graph, plan) is not None:  # nothing fused: the library's matmul is a candidate
            library = "aten"
        elif getattr(plan.library, "split", None) is not None:  # the library's product, the epilogue after it
            library = "split"
        if library is not None:
            knobs["impl"], default = ("generated", library), default.replace(impl="generated")
            tiles = valid

            def valid(s: Schedule) -> bool:  # the library ignores the tile knobs: one such schedule
                if s["impl"] != "generated":
                    return all(s[k] == v for k, v in default.items() if k != "impl")
                return tiles(s)
    return ScheduleSpace("contraction", knobs, default, sizes=sizes, itemsize=item, valid=valid,
                         families=tuple(k for k in ("impl", "persistent") if k in knobs),
                         plan_kind=PlanKind.CONTRACTION)


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
    schedule = current_contraction_schedule(graph, plan, options)
    # ("impl=aten" never reaches a lowering: the driver runs ATen instead)
    use_tma, persistent = bool(schedule.get("tma", 0)), bool(schedule.get("persistent", 0))
    constexprs = schedule.without(*NOT_BLOCKS).as_dict()  # the block sizes are the kernel's constants
    BM, BN, BK, G = (tile_symbol(n) for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"))
    wide = any(needs_int64(*sizes) for sizes in ((M, K, *batch_shape), (K, N, *batch_shape), (M, N, *batch_shape)))
    described = _described(graph, plan) if use_tma and not wide else None
    persistent = persistent and described is not None and options.target.sm_count > 0
    num_m, num_n = sympy.ceiling(M / BM), sympy.ceiling(N / BN)
    b.tile_symbols |= {"pid_first", "tile", "desc_a", "desc_b"}
    if persistent:  # one program per SM walks the output tiles; its loads overlap the last epilogue
        constexprs["NUM_SMS"] = options.target.sm_count
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
    group = floordiv(pid, G * num_n)
    first_m = group * G
    # (GROUP_M and the block counts are launch constants: sympy could never order them, and
    # trying costs tens of milliseconds per shape)
    size_m = sympy.Min(num_m - first_m, G, evaluate=False)
    b.emit(Let("pid_m", Index(first_m + mod(pid, size_m))))
    b.emit(Let("pid_n", Index(floordiv(mod(pid, G * num_n), size_m))))
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

    m_ok = bound_check(b, rm, M, schedule["BLOCK_M"], "mmask")  # loop-invariant: before the K loop
    n_ok = bound_check(b, rn, N, schedule["BLOCK_N"], "nmask")
    acc, accd = b.fresh("acc"), dot_accumulator(c.a, c.b)
    b.emit(Full(acc, ("BLOCK_M", "BLOCK_N"), 0.0, accd))
    loop = For("koffset", Index(sympy.Integer(0)), Index(K), "BLOCK_K")
    b.emit(loop)
    b.push_block(loop.body)
    b.emit(Arange("rka", Index(tile_symbol("koffset")), "BLOCK_K", 1, 2))
    b.emit(Arange("rkb", Index(tile_symbol("koffset")), "BLOCK_K", 0, 2))
    rka, rkb = tile_symbol("rka"), tile_symbol("rkb")
    ka_ok = bound_check(b, rka, K, schedule["BLOCK_K"], "kamask")
    kb_ok = bound_check(b, rkb, K, schedule["BLOCK_K"], "kbmask")
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
    dot_dtype = a_dt if a_dt == b_dt and a_dt.is_low_precision and not options.target.interpret else accd
    b.emit(DotTile(acc, a_v, b_v, Var(acc, accd), dot_dtype))
    b.pop_block()

    omask = land(m_ok, n_ok)
    omask = b.let(omask, "omask") if omask is not None else None
    out_vals = dims(rm, rn)
    b.bound[node.name] = b.let(cast(Var(acc, accd), node.dtype), "mm")
    if main.store:
        b.store(node.name, tuple(Index(v) for v in out_vals), b.bound[node.name], omask)
    flat = sum((v * s for v, s in zip(out_vals, contiguous_strides(node.shape))), sympy.Integer(0))
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
    grid = (smin(tile_symbol("NUM_SMS"), num_m * num_n), 1) if persistent else (num_m * num_n, nbatch)
    return TileKernel(plan.name, b.finish_params(), constexprs, numel=M * N * nbatch, grid=grid, body=b.body,
                      num_warps=schedule.warps, num_stages=schedule.stages, reads=b.reads, writes=b.writes,
                      kind=KernelKind.CONTRACTION, plan=plan)


def _described(graph: Graph, plan: KernelPlan):
    """The operands as tensor-descriptor views, or None (see `tile.descriptors`)."""
    from .descriptors import describe_operands

    c = plan.contraction
    return describe_operands(graph, plan, dot_operand(c.a)[0], dot_operand(c.b)[0])


def _is_plain_load(e: Expr) -> bool:
    while isinstance(e, Cast):
        e = e.x
    return isinstance(e, Load)


def current_contraction_schedule(graph: Graph, plan: KernelPlan, options: LoweringOptions) -> Schedule:
    """The rules' schedule with `options.schedule`'s knobs over it: what the lowering uses."""
    return schedule_over(contraction_rules(graph, plan, options), options.schedule)


def shrink_contraction(plan: KernelPlan, schedule: Schedule, resource: str,
                       options: LoweringOptions) -> Schedule | None:
    return shrink_dot_tiles(schedule, resource, ("BLOCK_M", "BLOCK_N", "BLOCK_K"))


def contraction_time(space, schedule: Schedule, c) -> float:
    """A blocked `dot` kernel: the larger of its padded flops (waves of tiles at their
    efficiency) and its operand traffic (re-reads per output tile row and column), or the
    vendor library's roofline for `impl=aten`."""
    s = space.sizes
    M, N, K, batch = s.get("M"), s.get("N"), s.get("K"), s.get("batch") or 1
    if None in (M, N, K):
        return math.inf
    bm, bn, bk = schedule["BLOCK_M"], schedule["BLOCK_N"], schedule["BLOCK_K"]
    warps, stages = schedule["warps"], schedule["stages"]
    tm, tn = math.ceil(M / bm), math.ceil(N / bn)
    tiles = tm * tn * batch
    smem = stages * (bm + bn) * bk * space.itemsize
    slots = concurrency(smem, warps, c.sm_count)
    waves = math.ceil(tiles / slots)
    per_sm = slots // c.sm_count
    # padded work of one wave, spread over the SMs at the tile's efficiency
    flops_per_tile = 2.0 * bm * bn * math.ceil(K / bk) * bk
    sm_rate = c.matrix_flops / c.sm_count * tile_efficiency(bm, bn, warps) * (1.02 if schedule.get("tma") else 1.0)
    t_compute = waves * min(per_sm, math.ceil(tiles / c.sm_count)) * flops_per_tile / sm_rate
    persistent = bool(schedule.get("persistent"))
    if persistent:  # one program per SM, its tiles back to back
        t_compute = math.ceil(tiles / c.sm_count) * flops_per_tile / sm_rate
    if schedule.get("impl") in ("aten", "split"):  # the vendor library: the device's measured matrix rate
        library = max(2.0 * M * N * K * batch / c.matrix_flops, (M * K + K * N + M * N) * batch * space.itemsize
                      / c.bandwidth) + 3e-6
        if schedule["impl"] == "split":  # the epilogue's kernel reads the product and writes its result
            library += 2.0 * M * N * batch * space.itemsize / c.bandwidth + 3e-6
        return library
    # operands re-read once per output tile row/column; grouped ordering lets L2 serve most
    reread = (M * K * tn + K * N * tm) * batch * space.itemsize / max(1.0, min(schedule.get("GROUP_M", 1), tm) ** 0.5)
    # fewer programs than SMs pull only their share of the bandwidth (a skinny product's 16
    # column tiles read its weight at an eighth of it), and the resident programs reach it only
    # with enough bytes in flight (Little's law): each keeps its pipeline's next `stages - 1`
    # operand tiles loading, of which only the rows the product has are read
    busy = min(1.0, tiles / c.sm_count)
    in_flight = min(tiles, slots) * max(1, stages - 1) * (min(bm, M) + min(bn, N)) * bk * space.itemsize
    rate = min(c.bandwidth * busy, in_flight / MEMORY_LATENCY)
    t_memory = (reread + M * N * batch * space.itemsize) / rate
    # prologue/epilogue of the software pipeline, per program; a persistent program overlaps
    # the next tile's loads with this tile's epilogue
    pipeline = 1.0 + (0.05 if persistent else 0.15) / stages
    return max(t_compute, t_memory) * pipeline + 3e-6


def _kernels(graph: Graph, plan: KernelPlan, options: LoweringOptions) -> list[TileKernel]:
    return [lower_contraction(graph, plan, options)]


FAMILY = KernelFamily(PlanKind.CONTRACTION, lower=_kernels, space=contraction_space,
                      schedule=current_contraction_schedule, shrink=shrink_contraction, cost=contraction_time)

__all__ = ["FAMILY", "lower_contraction", "contraction_rules", "contraction_space", "current_contraction_schedule",
           "shrink_contraction", "contraction_time"]
