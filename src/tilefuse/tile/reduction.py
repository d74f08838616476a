"""The reduction kernel family (`FAMILY`): a [XBLOCK, RBLOCK] tile per program, priced as a
memory-bound kernel (`tile.roofline.memory_time`).

The reduction axis is held whole in the tile (persistent row) when it is static and at most
`persistent_reduction_limit`; every stage then runs once, in order, from registers. Otherwise
the kernel walks the axis in RBLOCK steps, in *passes*: a stage that needs a finished
reduction waits for the next pass — unless it carries a derived rolling update (`repair`),
in which case it runs in the same pass as its producer:

    per tile:  m_new = max(m, max_tile(c))
               t     = h(t, m, m_new) + sum_tile(g(m_new, c))      # h from fusion.repair
               m     = m_new

Reductions without repairs accumulate elementwise ([XBLOCK, RBLOCK] lanes, reduced once after
the loop); the producer and consumer of a repair keep one value per row, reduced per tile.

A stage with a moment expansion (`fusion.moments`) also runs in its producers' pass: before
the loop each expansion point is estimated from the axis's first tile, the loop carries one
lane accumulator per moment, and after the loop, once the producers are final (rows of that
pass included, in stage order), the stage is combined as Σ_α (r − s)^α · M_α.

A symbolic length gets both kinds of kernel: the looped one, and persistent alternatives for
rows of up to 4, 16, …, 4096 elements (`size_ladder`) that the launch chooses by the actual
length (`tile.variants`), so a short row is not walked in a tile sized for the longest.

A reduction that reads across its outputs (`reads_columns`: a bias gradient's sum over rows)
gets a column tile instead: many outputs wide and a few rows deep, walked down the reduced
axis, so that each step reads whole lines of memory (`_column_rules`, knob `column_tiles`).
"""
from __future__ import annotations

from dataclasses import replace

import sympy

from ..fusion.plan import KernelPlan, PlanKind, Stage, StageKind
from ..fusion.schedule import schedule_stages
from ..ir import dtypes as dt
from ..ir.expr import Const, Expr, Index, Load, Var, binary, cast, out_index, red_index, unary, walk, where
from ..ir.printer import format_expr
from ..ir.graph import Graph
from ..ir.monoid import SUM, Monoid
from .builder import KernelBuilder, known_strides, land
from .ir import (Arange, ArgReduceTile, Assign, For, Full, KernelKind, Let, LoadTile, ProgramId, ReduceTile, TileKernel,
                 expr_names, statements)
from .common import (LoweringOptions, bound_check, combine, full_tile, identity_const, index_values, mapped, masked,
                     needs_int64, pow2, rebase, static_int, tile_symbol)
from .family import KernelFamily
from .reduction_runs import run_length, run_offset
from .roofline import memory_time
from .schedule import Schedule, schedule_over
from .space import ScheduleSpace, halved, memory_bytes, warps_within
from .variants import SizeVariants


def _arg_better(m: Monoid, v: Expr, acc: Expr) -> Expr:
    strictly = binary(m.better, v, acc)
    if v.dtype.is_float:
        acc_ok = unary("logical_not", unary("isnan", acc))
        return binary("logical_and", binary("logical_or", strictly, unary("isnan", v)), acc_ok)
    return strictly


def reduction_rules(plan: KernelPlan, options: LoweringOptions, graph: Graph | None = None) -> Schedule:
    """The fixed rule: a persistent row of pow2(R) lanes with up to 4096 elements per program
    and warps by row length; a looped row walks 2048-wide tiles with 8 warps. A plan that
    reads across its outputs (`reads_columns`, given the graph) gets a column tile."""
    P, Rn = plan.parallel, sympy.Mul(*plan.reduction)
    rstatic = static_int(Rn)
    if graph is not None and _column_tiled(graph, plan, options):
        return _column_rules(rstatic, P, options)
    # a CPU walks an axis flattened over several dims (a batch norm's (N, H, W)) in tiles inside
    # its contiguous runs, held whole or not: contiguous reads instead of a gather per lane
    run = run_length(graph, plan, rstatic, P) if options.target.on_cpu and graph is not None and rstatic else None
    if run is not None:
        return Schedule(persistent=False, RBLOCK=run_tile(run), XBLOCK=1, warps=8, RUN=run)
    if rstatic is not None and rstatic <= options.persistent_reduction_limit:
        return _persistent_rules(pow2(rstatic), P, options)
    rblock, xblock, warps = (512 if options.target.interpret else 2048), 1, 8
    if options.target.on_cpu:
        rblock = CPU_LOOPED_BLOCK
    return Schedule(persistent=False, RBLOCK=rblock, XBLOCK=xblock, warps=warps)


#: the tile a CPU walks a long axis in
CPU_LOOPED_BLOCK = 4096
#: the widest tile of a run (`run_tile`): its lane accumulators stay in the L1 cache
CPU_RUN_BLOCK = 1024


def run_tile(run: int) -> int:
    """The tile a CPU walks a run of `run` elements in: the widest power of two (from 16 up to
    `CPU_RUN_BLOCK`) that masks at most a sixteenth of the run at its end, else the one that
    masks the fewest (3136 = 56·56 in tiles of 256; 784 in 64; 49 in one of 64)."""
    widths = [w for w in (1 << k for k in range(4, 11)) if w <= max(16, min(CPU_RUN_BLOCK, pow2(run)))]
    waste = {w: -(-run // w) * w - run for w in widths}
    fitting = [w for w in widths if 16 * waste[w] <= run]
    return max(fitting) if fitting else min(widths, key=lambda w: (waste[w], -w))


#: the GPU tile of a reduction that reads across its outputs: a coalesced row of 64 outputs,
#: 8 rows deep, walked down the reduced axis (Inductor's "outer" reduction tile)
COLUMN_TILE = {"XBLOCK": 64, "RBLOCK": 8, "warps": 4}
#: reduced axes up to this long are held whole in a column tile instead
COLUMN_HELD = 64
#: a CPU's column tile: outputs per program (four AVX-512 vectors of fp32), and rows per step
#: of the walk, each summed into its own lane (stored by columns, `backends.cpu.loop_plan`);
#: a long axis gets more lanes (`_cpu_column_rows`), so that no lane adds more than
#: CPU_COLUMN_CHAIN rows in one chain (one chain over 3001 rows was 9× further from fp64 than
#: eager's cascade sum)
CPU_COLUMN_WIDTH = 64
CPU_COLUMN_ROWS = 8
CPU_COLUMN_CHAIN = 1024
#: programs a CPU column tile keeps at least (down to 16 outputs each): one program of 64
#: features left the other threads idle, and the next kernels paid for waking them
CPU_COLUMN_PROGRAMS = 4
#: fewer outputs than this are no column: a tile that narrow walks the axis in tiny steps
#: (a sum of [4000001, 2] over its rows took 29 ms in a column tile, 1.6 ms in a row tile)
COLUMN_MIN_OUTPUTS = 16


def reads_columns(graph: Graph, plan: KernelPlan) -> bool:
    """Whether the plan's reductions read memory across their outputs, not along the reduced
    axis: a bias gradient `out[x] = Σ_r dy[r, x]` reads each row of `dy` contiguously along x.
    A [XBLOCK, RBLOCK] tile of one output and a long row then reads one element per row,
    each from another line of memory (the LM head's bias gradient of BERT, 8192 × 30522, ran
    at 0.3 TB/s on an H200); a tile many outputs wide and few rows deep reads whole lines.
    True when, of the loads of its reduce stages that move with the innermost output dim, none
    is contiguous along a reduced index and one at least, walking the reduced axis, is
    contiguous along that dim (addresses from the strides the compile knows; a load whose
    strides come only at run time, or a row's statistic read alike by every output, says
    nothing)."""
    across = False
    for st in plan.stages:
        if st.kind != StageKind.REDUCE:
            continue
        node = graph[st.node]
        reduced = red_index(len(node.ranges))
        outs = [i for i, n in zip(out_index(node.rank), node.shape) if sympy.sympify(n) != 1]
        for e in walk(st.body):
            if not (isinstance(e, Load) and e.buffer in graph.nodes and all(isinstance(c, Index) for c in e.index)):
                continue
            strides = known_strides(graph, e.buffer)
            if strides is None:
                continue
            address = sympy.expand(sum((sympy.sympify(c.expr) * st_ for c, st_ in zip(e.index, strides)),
                                       sympy.Integer(0)))
            inner = outs[-1] if outs else None
            if inner is None or not address.has(inner):
                continue  # (a row's statistic, mean[r]: the same for every output of the tile)
            if any(address.coeff(r) == 1 for r in reduced):
                return False
            if address.coeff(inner) == 1 and any(address.has(r) for r in reduced):
                across = True
    return across


def _column_tiled(graph: Graph, plan: KernelPlan, options: LoweringOptions) -> bool:
    """Whether the plan gets a column tile: knob `column_tiles` on, at least
    COLUMN_MIN_OUTPUTS outputs (or a number known at run time), `reads_columns`."""
    outputs = static_int(plan.parallel)
    return (options.column_tiles and (outputs is None or outputs >= COLUMN_MIN_OUTPUTS)
            and reads_columns(graph, plan))


def _cpu_column_rows(rstatic) -> int:
    """Lanes per output of a CPU column tile: CPU_COLUMN_ROWS, more for a long axis (a lane
    adds at most CPU_COLUMN_CHAIN rows of up to 64 × 1024), fewer for a shorter one (MoE's
    weighting of 2 experts: 2), 16 for a length known at run time."""
    if rstatic is None:
        return 16
    return min(pow2(rstatic), 64, max(CPU_COLUMN_ROWS, pow2(-(-rstatic // CPU_COLUMN_CHAIN))))


def _column_rules(rstatic, P, options: LoweringOptions) -> Schedule:
    """A column tile. GPU: a short reduced axis held whole under up to 4096 elements (64–256
    outputs wide), a longer one walked COLUMN_TILE's rows at a time. CPU: `_cpu_column_rows`
    rows per step of the walk, CPU_COLUMN_WIDTH outputs wide — vector loops over contiguous
    memory, the accumulators in the program's array."""
    pv = static_int(P)
    if options.target.on_cpu:  # (at least CPU_COLUMN_PROGRAMS programs, 16 outputs wide at least)
        width = CPU_COLUMN_WIDTH if pv is None else max(16, min(CPU_COLUMN_WIDTH, pow2(pv) // CPU_COLUMN_PROGRAMS))
        return Schedule(persistent=False, RBLOCK=_cpu_column_rows(rstatic), XBLOCK=width, warps=1)
    if rstatic is not None and rstatic <= COLUMN_HELD:
        rb = pow2(rstatic)
        xblock = min(256, max(64, 4096 // rb))
        if pv is not None:
            xblock = max(1, min(xblock, pow2(pv)))
        return Schedule(persistent=True, RBLOCK=rb, XBLOCK=xblock, warps=max(1, min(8, xblock * rb // 256)))
    xblock = COLUMN_TILE["XBLOCK"] if pv is None else max(1, min(COLUMN_TILE["XBLOCK"], pow2(pv)))
    return Schedule(persistent=False, RBLOCK=COLUMN_TILE["RBLOCK"], XBLOCK=xblock, warps=COLUMN_TILE["warps"])


#: on a CPU, rows held whole shorter than this many lanes share a program (see below)
SHORT_ROW = 16
SHORT_ROW_ELEMENTS = 512


def _persistent_rules(rblock: int, P, options: LoweringOptions) -> Schedule:
    xblock = max(1, min(64 if not options.target.interpret else 16, 4096 // rblock))
    if options.target.on_cpu:  # one row per program: the row is the vectorised loop; rows
        # shorter than a vector come SHORT_ROW_ELEMENTS elements to a program instead (a row
        # of 2 per program spends its time entering the program, not adding)
        xblock = 1 if rblock >= SHORT_ROW else SHORT_ROW_ELEMENTS // rblock
    pv = static_int(P)
    if pv is not None:
        xblock = min(xblock, pow2(pv))
    warps = 1 if rblock <= 128 else 2 if rblock <= 512 else 4 if rblock <= 2048 else 8 if rblock <= 4096 else 16
    return Schedule(persistent=True, RBLOCK=rblock, XBLOCK=xblock, warps=warps)


#: the rows held whole when the reduction's length is symbolic, chosen at launch by the actual
#: length (`tile.variants`): every other power of two, so a row of 3 or more elements gets at
#: most twice the lanes the static rule gives it, from six alternatives (one C++ library)
SIZE_LADDER = (4, 16, 64, 256, 1024, 4096)


def size_ladder(plan: KernelPlan, options: LoweringOptions, columns: bool = False) -> tuple:
    """The RBLOCKs of the persistent alternatives of a plan whose reduction length is symbolic
    (empty when it is static: the rules then fit the row already); for a column tile only
    those it holds whole (`COLUMN_HELD`), a longer axis being walked a few rows at a time."""
    if static_int(sympy.Mul(*plan.reduction)) is not None or columns and options.target.on_cpu:
        return ()  # (a CPU's column tile walks a few rows a step: any length alike)
    limit = min(COLUMN_HELD, options.persistent_reduction_limit) if columns else options.persistent_reduction_limit
    return tuple(b for b in SIZE_LADDER if b <= limit)


def reduction_space(graph: Graph, plan: KernelPlan, options: LoweringOptions):
    """Rows per program and warps (persistent rows); tile width and warps (looped rows);
    outputs per program, rows per step and warps (column tiles)."""
    rules = reduction_rules(plan, options, graph)
    P, R = static_int(plan.parallel), static_int(sympy.Mul(*plan.reduction))
    rows = pow2(P) if P is not None else 1 << 20
    families = ()
    sizes = {"programs": P, "rows": P, "R": R, "bytes": memory_bytes(graph, plan)}
    if _column_tiled(graph, plan, options):
        wide = tuple(x for x in (16, 32, 64, 128, 256) if x <= rows) or (1,)
        if options.target.on_cpu:  # (no fewer lanes than the rules': the chains' length)
            deeper = tuple(r for r in (16, 32, 64) if r > rules["RBLOCK"] and (R is None or r <= pow2(R)))
            knobs = {"XBLOCK": wide, "RBLOCK": (rules["RBLOCK"],) + deeper, "warps": (1,)}
            return ScheduleSpace("memory", knobs, rules.pick(knobs), sizes=sizes, plan_kind=PlanKind.REDUCTION)
        if rules["persistent"]:
            knobs = {"XBLOCK": wide, "RBLOCK": (rules["RBLOCK"],), "warps": (1, 2, 4, 8)}
        else:
            knobs = {"XBLOCK": wide, "RBLOCK": (4, 8, 16, 32, 64), "warps": (2, 4, 8)}

        def valid(s: Schedule) -> bool:
            tile = s["XBLOCK"] * s["RBLOCK"]
            return tile <= 8192 and 32 * s.warps <= max(32, tile // 2)
        return ScheduleSpace("memory", knobs, rules.pick(knobs), sizes=sizes, valid=valid,
                             plan_kind=PlanKind.REDUCTION)
    if options.target.on_cpu:  # rows per program (held whole) or tile width (looped); no warps
        if rules["persistent"]:
            rb = rules["RBLOCK"]
            many = (16, 32, 64, 128, 256, 512) if rb < SHORT_ROW else ()
            knobs = {"XBLOCK": tuple(x for x in (1, 2, 4, 8) + many if x <= rows and x * rb <= 65536) or (1,),
                     "warps": (1,)}
        else:
            knobs = {"RBLOCK": tuple(sorted({rules["RBLOCK"], 1024, 2048, 4096, 8192})), "warps": (1,)}
        return ScheduleSpace("memory", knobs, rules.pick(knobs), sizes=sizes, plan_kind=PlanKind.REDUCTION)
    if rules["persistent"]:
        rb = rules["RBLOCK"]
        # the row held whole, or (for long rows) walked in tiles with a second pass re-reading
        # it from L2: fewer registers per thread, more rows in flight
        looped = tuple(t for t in (1024, 2048, 4096) if t < rb) if not options.target.interpret else ()
        knobs = {"persistent": (True, False) if looped else (True,),
                 "XBLOCK": tuple(x for x in (1, 2, 4, 8, 16, 32, 64) if x <= rows and x * rb <= 32768),
                 "RBLOCK": (rb,) + looped, "warps": (1, 2, 4, 8, 16)}
        families = ("persistent",) if looped else ()

        def valid(s: Schedule) -> bool:
            if not s["persistent"]:
                return s["XBLOCK"] == 1 and s["RBLOCK"] < rb and s["RBLOCK"] >= 32 * s.warps >= 128
            return (s["RBLOCK"] == rb and s["XBLOCK"] * rb // (32 * s.warps) <= 128
                    and s.warps * 32 <= max(32, s["XBLOCK"] * rb))
    else:
        knobs = {"RBLOCK": (512, 1024, 2048, 4096), "warps": (4, 8, 16)}

        def valid(s: Schedule) -> bool:
            return s["RBLOCK"] >= 32 * s.warps
    return ScheduleSpace("memory", knobs, rules.pick(knobs), sizes=sizes, valid=valid, families=families,
                         plan_kind=PlanKind.REDUCTION)


def lower_reduction(graph: Graph, plan: KernelPlan, options: LoweringOptions) -> TileKernel:
    """The plan's kernel; for a symbolic reduction length walked in tiles, with persistent
    alternatives for short rows (`size_ladder`) that the launch chooses by the actual length.
    A schedule that says whether the row is held whole is taken as it is."""
    schedule = current_reduction_schedule(graph, plan, options)
    kernel = _lower(graph, plan, options, schedule)
    columns = _column_tiled(graph, plan, options)
    ladder = size_ladder(plan, options, columns)
    if schedule["persistent"] or not ladder or "persistent" in (options.schedule or {}):
        return kernel
    notes = list(plan.notes)
    alternatives = []
    for rblock in ladder:
        held = (_column_rules(rblock, plan.parallel, options) if columns
                else _persistent_rules(rblock, plan.parallel, options))
        k = _lower(graph, plan, options, held)
        k.name = f"{kernel.name}_r{rblock}"
        alternatives.append(k)
    plan.notes[:] = notes  # (the looped lowering's notes describe the repairs; rows held whole have none)
    Rn = sympy.Mul(*plan.reduction)
    kernel.variants = SizeVariants(Rn, ladder, tuple(alternatives))
    plan.notes.append(f"{plan.name}: reduction length {Rn} known at launch: a row of up to "
                      f"{'/'.join(map(str, ladder))} elements held whole in as many lanes, "
                      f"a longer one walked in RBLOCK={schedule['RBLOCK']} tiles")
    return kernel


def _lower(graph: Graph, plan: KernelPlan, options: LoweringOptions, schedule: Schedule) -> TileKernel:
    b = KernelBuilder(graph, plan.name, options.divisor_checks)
    b.tile_symbols |= {"pid", "xindex", "rindex", "roffset"}
    P = plan.parallel
    Rn = sympy.Mul(*plan.reduction)
    b.size_params(P)
    b.size_params(Rn)
    x, r = tile_symbol("xindex"), tile_symbol("rindex")
    persistent, rblock, xblock, warps = schedule["persistent"], schedule["RBLOCK"], schedule["XBLOCK"], schedule.warps
    run = 0 if persistent else schedule.get("RUN", 0)  # (`reduction_runs`: the axis walked run by run)
    b.emit(ProgramId("pid", 0, wide=needs_int64(P, Rn)))
    b.emit(Arange("xindex", Index(tile_symbol("pid") * tile_symbol("XBLOCK")), "XBLOCK", 0, 2))
    xmask = bound_check(b, x, P, xblock, "xmask")
    sym_ranges = {x: P, r: Rn}
    level, repaired, expanded = schedule_stages(plan, use_repairs=not persistent)
    for st in plan.stages:
        if st.repair is not None and (st.node in repaired or st.node in expanded):
            plan.notes.append(f"{st.node}: carried in pass {level[st.node]} with {st.repair.describe()}")
    reduces = [s for s in plan.stages if s.kind == StageKind.REDUCE]
    passes = 1 + max([level[s.node] for s in plan.stages if s.kind != StageKind.ROW], default=0)

    def body_of(st: Stage):
        node = graph[st.node]
        if st.kind == StageKind.REDUCE:
            xi = index_values(node.shape, x, sym_ranges)
            ri = index_values(node.ranges, r, sym_ranges)
            return mapped(mapped(st.body, out_index(node.rank), xi), red_index(len(node.ranges)), ri)
        flat = x if st.kind == StageKind.ROW else x * Rn + r
        return mapped(st.body, out_index(node.rank), index_values(node.shape, flat, sym_ranges))

    def out_index_of(st: Stage):
        node = graph[st.node]
        flat = x * Rn + r if st.kind == StageKind.FULL else x
        return tuple(Index(e) for e in index_values(node.shape, flat, sym_ranges))

    def finish(st: Stage, value: Var) -> None:
        node = graph[st.node]
        if node.combiner.logical:
            b.bound[st.node] = b.let(binary("ne", value, Const(0, value.dtype)), "red")
        else:
            b.bound[st.node] = b.let(cast(value, node.dtype), "red")

    def row_stages(after_pass: int) -> None:
        for st in plan.stages:
            if st.node in expanded and level[st.node] == after_pass:
                finish(st, moments.combine(st))
            elif st.kind == StageKind.ROW and level[st.node] == after_pass:
                v = b.value(body_of(st), mask=xmask)
                b.bound[st.node] = v
                if st.store:
                    b.store(st.node, out_index_of(st), v, xmask)

    def tile_reduce(st: Stage, mask, accd) -> Var:
        """The reduction of this tile's contribution to one value per row."""
        node = graph[st.node]
        v = cast(b.value(body_of(st), mask=mask), accd)
        contrib = full_tile(b, where(mask, v, identity_const(node.combiner, accd)) if mask is not None else v)
        name = b.fresh("red")
        if node.combiner.arg:
            b.emit(ArgReduceTile(name, contrib, b.let(Index(r), "ridx"), node.combiner, 1))
            return Var(name, dt.int64)
        b.emit(ReduceTile(name, contrib, node.combiner.tile, 1, accd))
        return Var(name, accd)

    moments = _Moments(b, graph, plan, level, repaired, expanded, (x, P), (Rn, rblock), xmask, body_of)
    row_stages(-1)
    for p in range(passes):
        if p > 0:
            row_stages(p - 1)
        in_pass = [s for s in reduces if level[s.node] == p]
        fulls = [s for s in plan.stages if s.kind == StageKind.FULL and level[s.node] == p]
        if persistent:
            if p == 0:
                b.emit(Arange("rindex", Index(sympy.Integer(0)), "RBLOCK", 1, 2))
                mask = land(xmask, bound_check(b, r, Rn, rblock, "rmask"))
                mask = b.let(mask, "mask") if mask is not None else None
            for st in in_pass:
                finish(st, tile_reduce(st, mask, graph[st.node].combiner.acc_dtype(st.body.dtype)))
            for st in fulls:
                b.store(st.node, out_index_of(st), b.value(body_of(st), mask=mask), mask)
            continue
        _looped_pass(b, graph, in_pass, fulls, repaired, Rn, rblock, xmask, r,
                     body_of, out_index_of, finish, tile_reduce, moments, run)
    row_stages(passes - 1)
    for st in reduces:
        if st.store:
            b.store(st.node, out_index_of(st), b.bound[st.node], xmask)
    if not persistent:
        _eviction_hints(b.body)
    constexprs = {"XBLOCK": xblock, "RBLOCK": rblock, **({"RUN": run} if run else {})}
    return TileKernel(plan.name, b.finish_params(), constexprs, numel=P,
                      grid=(sympy.ceiling(P / tile_symbol("XBLOCK")),), body=b.body, num_warps=warps,
                      reads=b.reads, writes=b.writes, kind=KernelKind.REDUCTION, plan=plan)


def _eviction_hints(body: list) -> None:
    """Cache hints for a looped row: a buffer that a later pass reads again stays in L2
    ("last") until its final pass, which lets it go ("first"); a buffer every row reads (a
    weight: its offset does not depend on the row) stays."""
    passes = [s for s in body if isinstance(s, For)]
    loads = [[t for t in statements(p.body) if isinstance(t, LoadTile)] for p in passes]
    final = {}
    for k, group in enumerate(loads):
        for t in group:
            final[t.buffer] = k
    for k, group in enumerate(loads):
        for t in group:
            if isinstance(t.offset, Index) and "xindex" not in expr_names(t.offset):
                t.eviction = "last"
            elif final[t.buffer] > k:
                t.eviction = "last"
            elif any(t.buffer in {u.buffer for u in g} for g in loads[:k]):
                t.eviction = "first"


def _looped_pass(b, graph, in_pass, fulls, repaired, Rn, rblock, xmask, r, body_of, out_index_of, finish,
                 tile_reduce, moments, run: int = 0):
    from .ir import For

    expanded = [s for s in in_pass if s.node in moments.expanded]
    in_pass = [s for s in in_pass if s.node not in moments.expanded]
    moments.before_loop(expanded)

    # stages that keep one value per row: repaired consumers and their producers
    per_row = {s.node for s in in_pass if s.node in repaired}
    per_row |= {s.repair.producer for s in in_pass if s.node in repaired}
    state = {}
    for st in in_pass:
        node = graph[st.node]
        accd = node.combiner.acc_dtype(st.body.dtype)
        shape = ("XBLOCK", 1) if st.node in per_row else ("XBLOCK", "RBLOCK")
        name = b.fresh("acc")
        b.emit(Full(name, shape, node.combiner.identity(accd), accd))
        idx = None
        if node.combiner.arg:
            idx = b.fresh("accidx")
            b.emit(Full(idx, shape, 0, dt.int64))
        state[st.node] = (Var(name, accd), idx)
    if run:  # run by run (`reduction_runs`): offsets a scalar per run plus the position in it
        rbase = tile_symbol("rbase")
        b.tile_symbols.add("rbase")
        outer = For("rbase", Index(sympy.Integer(0)), Index(Rn), "RUN")
        b.emit(outer)
        b.push_block(outer.body)
        loop = For("roffset", Index(sympy.Integer(0)), Index(sympy.Integer(run)), "RBLOCK")
        b.emit(loop)
        b.push_block(loop.body)
        b.offset_rewrite = lambda off: run_offset(off, r, rbase, run, Rn)
        b.emit(Arange("rindex", Index(rbase + tile_symbol("roffset")), "RBLOCK", 1, 2))
        # (a run that the tile does not divide: its last tile's lanes past the run's end)
        within = b.let(binary("lt", Index(r), Index(rbase + run)), "rmask") if run % rblock else None
        mask = land(xmask, within)
    else:
        loop = For("roffset", Index(sympy.Integer(0)), Index(Rn), "RBLOCK")
        b.emit(loop)
        b.push_block(loop.body)
        b.emit(Arange("rindex", Index(tile_symbol("roffset")), "RBLOCK", 1, 2))
        mask = land(xmask, bound_check(b, r, Rn, rblock, "rmask"))
    mask = b.let(mask, "mask") if mask is not None else None
    updates = []  # per-row states are assigned after every stage of the tile has read them
    running = {}  # producer -> (value before this tile, value after it)
    for st in in_pass:
        node = graph[st.node]
        acc, idx = state[st.node]
        if st.node in per_row:
            tile_value = tile_reduce(st, mask, acc.dtype)
            if st.node in repaired:
                value = b.let(binary("add", rebase(b, graph, acc, st.repair, running), tile_value), "carry")
            else:
                value = b.let(combine(b, node.combiner, acc, tile_value), "carry")
            # this tile's readers (and chained repairs) see the running value
            b.bound[st.node] = b.let(cast(value, node.dtype), "run")
            running[st.node] = (b.let(cast(acc, node.dtype), "prev"), b.bound[st.node])
            updates.append(Assign(acc.name, value))
            continue
        v = cast(b.value(body_of(st), mask=mask), acc.dtype)
        if idx is not None:
            v = full_tile(b, v)
            upd = b.let(land(mask, _arg_better(node.combiner, v, acc)))
            b.emit(Assign(idx, where(upd, Index(r), Var(idx, dt.int64))))
            b.emit(Assign(acc.name, where(upd, v, acc)))
        else:
            pad = identity_const(node.combiner, acc.dtype)
            b.emit(Assign(acc.name, combine(b, node.combiner, acc, full_tile(b, masked(b, mask, v, pad)))))
    moments.in_loop(expanded, mask)
    for u in updates:
        b.emit(u)
    for st in fulls:
        b.store(st.node, out_index_of(st), b.value(body_of(st), mask=mask), mask)
    b.offset_rewrite = None
    b.pop_block()
    if run:
        b.pop_block()
    moments.after_loop(expanded)
    for st in in_pass:
        node = graph[st.node]
        acc, idx = state[st.node]
        if st.node in per_row:
            finish(st, acc)
            continue
        out = b.fresh("red")
        if idx is not None:
            b.emit(ArgReduceTile(out, acc, Var(idx, dt.int64), node.combiner, 1))
            finish(st, Var(out, dt.int64))
        else:
            b.emit(ReduceTile(out, acc, node.combiner.tile, 1, acc.dtype))
            finish(st, Var(out, acc.dtype))


class _Moments:
    """Moment-expanded stages of a looped reduction (`fusion.moments`)."""

    def __init__(self, b, graph, plan, level, repaired, expanded, parallel, axis, xmask, body_of):
        self.b, self.graph, self.plan, self.level, self.repaired = b, graph, plan, level, repaired
        self.expanded = expanded
        (self.x, self.P), (self.Rn, self.rblock) = parallel, axis
        self.xmask, self.body_of = xmask, body_of
        self.acc: dict = {}  # (stage, α) -> lane accumulator
        self.sums: dict = {}  # (stage, α) -> its moment after the loop

    def n(self, dtype) -> Expr:
        """The axis length as a float."""
        rn = static_int(self.Rn)
        return Const(float(rn), dtype) if rn is not None else Index(self.Rn, dtype)

    def mapped(self, st: Stage, e: Expr, rsym) -> Expr:
        node = self.graph[st.node]
        ranges = {self.x: self.P, rsym: self.Rn}
        xi = index_values(node.shape, self.x, ranges)
        ri = index_values(node.ranges, rsym, ranges)
        return mapped(mapped(e, out_index(node.rank), xi), red_index(len(node.ranges)), ri)

    def before_loop(self, stages) -> None:
        b = self.b
        shifted = [(st, k) for st in stages for k, s in enumerate(st.repair.shifts) if s is not None]
        if shifted:
            self._shifts(shifted)
        for st in stages:
            for alpha, q in st.repair.terms:
                if st.repair.reads_axis(q):
                    name = b.fresh("macc")
                    b.emit(Full(name, ("XBLOCK", "RBLOCK"), 0.0, st.repair.dtype))
                    self.acc[(st.node, alpha)] = Var(name, st.repair.dtype)

    def in_loop(self, stages, mask) -> None:
        b, r = self.b, tile_symbol("rindex")
        for st in stages:
            for alpha, q in st.repair.terms:
                acc = self.acc.get((st.node, alpha))
                if acc is not None:
                    v = cast(b.value(self.mapped(st, q, r), mask=mask), acc.dtype)
                    b.emit(Assign(acc.name, binary("add", acc, full_tile(b, masked(b, mask, v, Const(0.0, acc.dtype))))))

    def after_loop(self, stages) -> None:
        for st in stages:
            for alpha, _ in st.repair.terms:
                acc = self.acc.get((st.node, alpha))
                if acc is not None:
                    name = self.b.fresh("moment")
                    self.b.emit(ReduceTile(name, acc, SUM, 1, acc.dtype))
                    self.sums[(st.node, alpha)] = Var(name, acc.dtype)

    def combine(self, st: Stage) -> Var:
        """The stage's value from its moments and its producers' final values."""
        b, rep, r = self.b, st.repair, tile_symbol("rindex")
        pivots = [b.value(self.mapped(st, p, r), mask=self.xmask) for p in rep.pivots]
        moments = []
        for alpha, q in rep.terms:
            if rep.reads_axis(q):
                moments.append(self.sums[(st.node, alpha)])
            elif isinstance(q, Const) and isinstance(self.n(rep.dtype), Const):
                moments.append(Const(self.n(rep.dtype).value * q.value, rep.dtype))
            else:  # constant along the axis: n·q, no accumulator
                moments.append(binary("mul", self.n(rep.dtype), b.value(self.mapped(st, q, r), mask=self.xmask)))
        return b.let(rep.combine(pivots, moments), "combined")

    def _shifts(self, shifted) -> None:
        """Each shift = its pivot evaluated on estimates of this pass's results from the first
        tile of the axis (a sum extrapolated to the whole axis): close to the final value, so
        r − s stays small. A pivot without an estimate, or a non-finite one, expands around 0."""
        b = self.b
        p = self.level[shifted[0][0].node]
        block: list = []
        saved = dict(b.bound)
        b.push_block(block)  # its own memo: the estimates must not stand in for the final values
        try:
            est = self._estimates(p, self._needed(p, [st.repair.pivots[k] for st, k in shifted]))
            b.bound.update(est)
            for st, k in shifted:
                shift = st.repair.shifts[k]
                pivot = st.repair.pivots[k]
                reads = {e.buffer for e in walk(pivot) if isinstance(e, Load)}
                if not all(d in est or self.level[d] < p for d in reads):
                    self.plan.notes.append(f"{st.node}: no first-tile estimate of {format_expr(pivot)}; "
                                           "expanded around 0")
                    b.emit(Full(shift.name, ("XBLOCK", 1), 0.0, shift.dtype))
                    continue
                s = b.let(cast(b.value(self.mapped(st, pivot, tile_symbol("rindex")), mask=self.xmask), shift.dtype))
                finite = binary("lt", unary("abs", s), Const(float("inf"), s.dtype))
                b.emit(Let(shift.name, where(finite, s, Const(0.0, s.dtype))))
        finally:
            b.pop_block()
            b.bound.clear()
            b.bound.update(saved)
            b.blocks[-1].extend(block)

    def _needed(self, p: int, pivots) -> set:
        """The results of pass `p` the pivots read, directly or through rows of that pass."""
        members = {s.node: s for s in self.plan.stages}
        todo = [e.buffer for piv in pivots for e in walk(piv) if isinstance(e, Load)]
        needed: set = set()
        while todo:
            name = todo.pop()
            if name in needed or name not in members or self.level[name] != p:
                continue
            needed.add(name)
            if members[name].kind == StageKind.ROW:
                todo += [e.buffer for e in walk(members[name].body) if isinstance(e, Load)]
        return needed

    def _estimates(self, p: int, needed: set) -> dict:
        """First-tile estimates of the `needed` results of pass `p`: its plain sums (scaled to
        the axis length), maxima and minima, and the rows computed from them."""
        b, graph = self.b, self.graph
        rf = tile_symbol("rfirst")
        b.tile_symbols.add("rfirst")
        b.emit(Arange("rfirst", Index(sympy.Integer(0)), "RBLOCK", 1, 2))
        rmask = bound_check(b, rf, self.Rn, self.rblock, "fmask")
        mask = land(self.xmask, rmask)
        mask = b.let(mask, "mask") if mask is not None else None
        count = None
        est: dict = {}
        for st in self.plan.stages:
            if st.node not in needed:
                continue
            node = graph[st.node]
            if st.kind == StageKind.ROW:
                reads = {e.buffer for e in walk(st.body) if isinstance(e, Load) and e.buffer in self.level}
                if all(d in est or self.level[d] < p for d in reads):
                    b.bound.update(est)
                    est[st.node] = b.value(self.body_of(st), mask=self.xmask)
                continue
            if (st.kind != StageKind.REDUCE or st.node in self.repaired or st.node in self.expanded
                    or not (node.combiner == SUM or node.combiner.extremum) or not st.body.dtype.is_float):
                continue
            v = b.value(self.mapped(st, st.body, rf), mask=mask)
            v = cast(v, dt.compute_dtype(v.dtype))
            contrib = full_tile(b, masked(b, mask, v, identity_const(node.combiner, v.dtype)))
            name = b.fresh("first")
            b.emit(ReduceTile(name, contrib, node.combiner.tile, 1, v.dtype))
            value = Var(name, v.dtype)
            if node.combiner == SUM:
                if count is None:
                    count = Const(float(self.rblock), v.dtype)
                    if rmask is not None:
                        ones = full_tile(b, where(rmask, Const(1.0, v.dtype), Const(0.0, v.dtype)))
                        count = Var(b.fresh("count"), v.dtype)
                        b.emit(ReduceTile(count.name, ones, SUM, 1, v.dtype))
                value = binary("mul", value, binary("truediv", self.n(v.dtype), count))
            est[st.node] = b.let(cast(value, node.dtype), "first")
        return est


def current_reduction_schedule(graph: Graph, plan: KernelPlan, options: LoweringOptions) -> Schedule:
    """The rules' schedule with `options.schedule`'s knobs over it: what the lowering uses."""
    return schedule_over(reduction_rules(plan, options, graph), options.schedule)


def shrink_reduction(plan: KernelPlan, schedule: Schedule, resource: str,
                     options: LoweringOptions) -> Schedule | None:
    """Fewer rows per program; then a persistent row walked in tiles instead of held whole;
    then narrower tiles."""
    if schedule.get("XBLOCK", 1) > 1:
        return schedule.replace(XBLOCK=schedule["XBLOCK"] // 2)
    if schedule.get("persistent"):  # the row walked in tiles instead of held whole
        looped = reduction_rules(plan, replace(options, persistent_reduction_limit=0, schedule=None))
        return looped.replace(warps=min(schedule.warps, looped.warps), persistent=False)
    smaller = halved(schedule, ("RBLOCK",))
    return warps_within(smaller, "RBLOCK") if smaller else None


def _kernels(graph: Graph, plan: KernelPlan, options: LoweringOptions) -> list[TileKernel]:
    return [lower_reduction(graph, plan, options)]


FAMILY = KernelFamily(PlanKind.REDUCTION, lower=_kernels, space=reduction_space,
                      schedule=current_reduction_schedule, shrink=shrink_reduction, cost=memory_time)

__all__ = ["FAMILY", "lower_reduction", "reduction_rules", "reduction_space", "current_reduction_schedule",
           "shrink_reduction", "size_ladder", "SIZE_LADDER", "reads_columns", "COLUMN_TILE", "COLUMN_HELD",
           "COLUMN_MIN_OUTPUTS", "CPU_COLUMN_WIDTH", "CPU_COLUMN_ROWS", "CPU_COLUMN_CHAIN", "CPU_COLUMN_PROGRAMS"]
