"""The pointwise kernel family: a 1-D tile of XBLOCK elements per program, or, when an operand
is broadcast along the rows or the columns of the output, a 2-D tile of rows × columns
(`_row_tiles`): whole rows on a CPU, a block of columns per program on a GPU.

Each stage's value is computed at the program's elements and stored; a scatter stage (an
in-place indexed write, `index_put_`/`index_copy_` after re-inplacing) stores its values at the
data-dependent positions of its target instead, skipping positions outside it. Priced as a
memory-bound kernel (`tile.roofline.memory_time`).
"""
from __future__ import annotations

import sympy

from ..fusion.plan import KernelPlan, PlanKind, StageKind
from ..ir.expr import Const, Index, Load, Var, binary, out_index, walk
from ..ir.graph import Graph
from ..ir.storage import dense_order
from ..ir.symbolic import simplify_index, unravel_sym
from .builder import KernelBuilder, land
from .column_runs import column_runs, lower_column_runs
from .common import (LoweringOptions, bound_check, index_values, mapped, needs_int64, pow2, static_int, tile_symbol,
                     uniform_layout)
from .family import KernelFamily
from .ir import Arange, KernelKind, ProgramId, TileKernel
from .roofline import memory_time
from .schedule import Schedule, schedule_over
from .space import ScheduleSpace, halved, memory_bytes, warps_within


def pointwise_rules(plan: KernelPlan, options: LoweringOptions) -> Schedule:
    block = 1024 if not options.target.interpret else 256
    if options.target.on_cpu:  # one program is a vectorised loop: amortise its start
        block = 2048
    nv = static_int(plan.parallel)
    if nv is not None:
        block = min(block, max(16, pow2(nv)))
    return Schedule(XBLOCK=block, warps=4 if block >= 512 else 2)


def pointwise_space(graph: Graph, plan: KernelPlan, options: LoweringOptions):
    """Elements per program and warps."""
    n = static_int(plan.parallel)
    cap = max(16, pow2(n)) if n is not None else 1 << 30
    if options.target.on_cpu:  # elements per program (one OpenMP task, one vectorised loop)
        knobs = {"XBLOCK": tuple(x for x in (512, 1024, 2048, 4096, 8192) if x <= cap) or (cap,), "warps": (1,)}
        return ScheduleSpace("memory", knobs, pointwise_rules(plan, options),
                             sizes={"programs": n, "rows": n, "R": 1, "bytes": memory_bytes(graph, plan)},
                             plan_kind=PlanKind.POINTWISE)
    knobs = {"XBLOCK": tuple(x for x in (256, 512, 1024, 2048, 4096) if x <= cap) or (cap,), "warps": (2, 4, 8)}
    return ScheduleSpace("memory", knobs, pointwise_rules(plan, options),
                         sizes={"programs": n, "rows": n, "R": 1, "bytes": memory_bytes(graph, plan)},
                         valid=lambda schedule: schedule["XBLOCK"] >= 32 * schedule.warps,
                         plan_kind=PlanKind.POINTWISE)


#: a CPU kernel walks whole rows (`_row_tiles`) of at least this many elements (a batch norm
#: over channels-last images of 8 channels reads its per-channel terms contiguously, not
#: gathered at `x % 8` lane by lane: 7% faster at 32 channels, as fast at 8)
ROW_MIN = 8
#: the column block of a CPU row that no power of two from 64 divides: its last block is masked,
#: the others run whole (rows of 1000 in blocks of 1024 ran 1.2× slower than in 64s, 197 in 256s
#: 1.15×; 16 or 32 pay the loop's overhead)
CPU_RAGGED_COLUMNS = 64
#: the shortest row of several dims a CPU walks in ragged blocks (`_ragged_rows_pay`): a 3×3
#: plane's per-channel value (a `silu(x + b[:, None, None])`) was 1.4× slower tiled than flat
CPU_PLANE_MIN = 16
#: a GPU kernel walks rows × columns tiles only for rows of at least this many elements (shorter
#: rows would leave most of a tile's columns masked; the flat walk packs them)
GPU_ROW_MIN = 256
#: the most column blocks of a row (a CUDA grid's second axis)
_MAX_COLUMN_BLOCKS = 65535


def _row_tiles(graph: Graph, plan: KernelPlan, options: LoweringOptions, block: int):
    """(tile, shape, order, k) when a pointwise kernel should walk its output as 2-D tiles
    instead of flat runs, else None: `tile` the (rows, columns) per program, `shape` the shape
    of the stages that read memory (a fill beside them may have another shape of the same
    size), `order` its dims in storage order, `order[k:]` the dims that make one row.

    The row is the innermost storage dims over which every operand is uniform: each one reads
    all of them or none. So a bias per column is read at the column index, contiguously, not
    gathered at `x % row` lane by lane; a value per row — a row's log-sum-exp, a target class,
    a batch norm's per-channel scale over NCHW's H·W — is read once per row of the tile, with
    no index division per element. On a CPU a tile holds whole rows (the row is the vectorised
    inner loop, a power of two up to `block`), or a block of columns of a few rows (any row
    length from ROW_MIN up: blocks of 64 where no power of two from 64 divides it); on a GPU a
    program takes a block of columns of a few rows, any row length from GPU_ROW_MIN up."""
    if any(st.kind != StageKind.POINTWISE or not st.store for st in plan.stages):
        return None
    shaped = _shaped_stages(graph, plan)
    layout = uniform_layout(graph, shaped, plan.parallel)
    if layout is None or len(layout[0]) < 2:
        return None
    shape, order = layout
    if any(not _flat_fill(graph, st) for st in plan.stages if st not in shaped):
        return None
    uses = _dims_read(graph, plan, shape)
    if not any(len(u) < len(shape) for u in uses):
        # nothing broadcast: the flat walk, unless on a CPU an operand is read at other
        # positions than the output's own (a padded or shifted read, a transposed one): walked
        # flat, each lane divides its position into coordinates and gathers; by rows of the
        # innermost dim, its index is affine along the row (padding reads contiguously)
        how = _reads_elsewhere(graph, plan, shape, order) if options.target.on_cpu else None
        if how == "transposed":
            row = static_int(shape[order[-1]])
            # (the widest of 64, 32, 16 that divides the row: a masked tile is not copied)
            columns = next((w for w in (TRANSPOSED_TILE[1], 32, 16) if row is not None and row % w == 0), None)
            return ((TRANSPOSED_TILE[0], columns), shape, order, len(order) - 1) if columns else None
        if how == "shifted":
            row = static_int(shape[order[-1]])
            if row is not None and row >= ROW_MIN:
                # (any length: blocks of columns wasting the fewest lanes where no power of two fits)
                tile = _tile_for(row, block, options)
                if tile is None:
                    columns = _column_block(row, block)
                    tile = (max(1, block // columns), columns) if columns is not None else None
                if tile is not None:
                    return tile, shape, order, len(order) - 1
        return None
    unit = {d for d, ext in enumerate(shape) if sympy.sympify(ext) == 1}  # (read by all or none alike)
    uses = [u - unit for u in uses]
    best = None
    for k in range(len(order) - 1, 0, -1):
        group = set(order[k:]) - unit
        if not group:
            continue
        if any(u & group and not group <= u for u in uses):
            break  # an operand reads part of the row: no wider row either
        rest = set(order[:k]) - unit
        if not any(not u & group or not rest <= u for u in uses):
            continue  # (no operand is a value per row or per column of this split)
        row = static_int(sympy.Mul(*(shape[d] for d in order[k:])))
        if row is None:
            break
        tile = _tile_for(row, block, options, spans_dims=len(group) > 1)
        if tile is not None:
            best = (tile, shape, order, k)
    return best


def _reads_elsewhere(graph: Graph, plan: KernelPlan, shape, order) -> str | None:
    """How the stages read operands at other positions than the output's own flat walk would
    (another index than the output's coordinates, or a buffer of another shape or storage
    order): "transposed" where a load moves along the output's innermost dim in another of
    its own dims than its innermost one (`a + b.t()`), else "shifted" (a padded or shifted
    read, an interpolation's gather), or None where every load reads at the output's own
    positions."""
    own = tuple(out_index(len(shape)))
    along = own[order[-1]]
    how = None
    for st in plan.stages:
        for e in walk(st.body):
            if not (isinstance(e, Load) and e.buffer in graph.nodes and graph[e.buffer].rank > 0):
                continue
            source = graph[e.buffer]
            identity = tuple(range(source.rank))
            source_order = dense_order(source.shape, graph.output_strides.get(e.buffer)) or identity
            index = tuple(getattr(c, "expr", None) for c in e.index)
            if tuple(source.shape) == tuple(shape) and source_order == order and index == own:
                continue
            if len(e.index) != source.rank:
                return None
            how = how or "shifted"
            for d, c in enumerate(e.index):
                if d != source_order[-1] and any(isinstance(n, Index) and sympy.sympify(n.expr).has(along)
                                                 for n in walk(c)):
                    how = "transposed"
    return how


#: a CPU tile of a pointwise kernel with a transposed read: rows × columns, both multiples of
#: 16, so that the C++ printer copies the operand's tile by register transposes
#: (`backends.cpu.loop_plan.transposed_load`) instead of gathering it lane by lane
TRANSPOSED_TILE = (16, 64)


def _shaped_stages(graph: Graph, plan: KernelPlan) -> list:
    """The stages whose shape decides the tiles: those that read memory (a fill fused beside
    them, such as the zeros an embedding's gradient accumulates into, may have any shape of
    the same size), or all of them when none reads."""
    reading = [st for st in plan.stages if any(isinstance(e, Load) for e in walk(st.body))]
    return reading or list(plan.stages)


def _flat_fill(graph: Graph, st) -> bool:
    """A stage that reads nothing and is stored densely in its dims' order: written at the
    tile's flat position, whatever its shape."""
    node = graph[st.node]
    order = dense_order(node.shape, graph.output_strides.get(st.node))
    return order is None or order == tuple(range(node.rank))


def _dims_read(graph: Graph, plan: KernelPlan, shape) -> list:
    """For each load of a buffer with elements in the stages' bodies, the output dims (of
    `shape`, with extent > 1) its index reads."""
    symbols = {str(s): d for d, s in enumerate(out_index(len(shape))) if sympy.sympify(shape[d]) != 1}
    out = []
    for st in plan.stages:
        for e in walk(st.body):
            if isinstance(e, Load) and e.buffer in graph.nodes and graph[e.buffer].rank > 0:
                used = set()
                for c in e.index:
                    for n in walk(c):
                        if isinstance(n, Index):
                            used |= {symbols[str(x)] for x in sympy.sympify(n.expr).free_symbols if str(x) in symbols}
                out.append(used | {d for d, ext in enumerate(shape) if sympy.sympify(ext) == 1})
    return out


def _tile_for(row: int, block: int, options: LoweringOptions, spans_dims: bool = False):
    """(rows, columns) per program for rows of `row` elements, or None where the target walks
    such rows flat; `spans_dims`: the row is made of several dims (a plane's H·W)."""
    if options.target.on_cpu:
        if row < ROW_MIN:
            return None
        if not row & (row - 1) and row <= block:  # whole rows, a power of two of them
            return 1 << ((block // row).bit_length() - 1), row
        # blocks of columns (powers of two: tile extents are): one that divides the row (768 by
        # 256), or any row longer than a block (a vocabulary's 32000 logits: walked flat, each
        # element divided its index by 32000 to read its row's values — four 64-bit divisions a
        # vector loop cannot do, 6.2 ms for 64 rows)
        columns = _dividing_block(row, block)
        if columns is None and row > block:
            columns = _column_block(row, block)
        if columns is None and _ragged_rows_pay(row, spans_dims):
            columns = min(CPU_RAGGED_COLUMNS, pow2(row))  # (only the last block of a row masked)
        if columns is None:
            return None
        return max(1, block // columns), columns
    columns = _column_block(row, block)
    if row < GPU_ROW_MIN or columns is None:
        return None
    return max(1, block // columns), columns


def _ragged_rows_pay(row: int, spans_dims: bool) -> bool:
    """Whether a CPU row of `row` elements within a block, no power of two from 64 dividing it,
    walks blocks of `CPU_RAGGED_COLUMNS` columns rather than flat. A row of several dims (NCHW's
    H·W) of at least `CPU_PLANE_MIN` elements does: walked flat, a value per row is read at
    `floor(floor(x / W) / H) % C`, nested 64-bit divisions per lane (a batch norm over 28×28
    planes took 1.9 ms against Inductor's 67 µs; 7×7, 171 against 32). A row of one dim does
    where its last block masks at most an eighth of it (1000 in 64s: 393 → 245 µs for 512
    rows): its flat walk divides in 32 bits, and a row of 65 or 129 in masked blocks of 64 ran
    1.4–2.4× slower than flat under `tanh`."""
    if spans_dims:
        return row >= CPU_PLANE_MIN
    return 8 * (-(-row // CPU_RAGGED_COLUMNS) * CPU_RAGGED_COLUMNS - row) <= row


def _dividing_block(row: int, block: int) -> int | None:
    """The widest power of two from 64 up to `block` that divides `row`, or None."""
    width = min(block, pow2(row))
    while width >= 64:
        if row % width == 0:
            return width
        width //= 2
    return None


def _column_block(row: int, block: int) -> int | None:
    """The columns of a GPU tile: the power of two up to `block` that wastes the fewest masked
    lanes at the row's end (the widest of those), or None when a row needs too many blocks."""
    best = None
    width = max(16, min(block, pow2(row)))
    while width >= 64 or best is None:
        blocks = -(-row // width)
        waste = blocks * width - row
        if blocks <= _MAX_COLUMN_BLOCKS and (best is None or waste < best[0]):
            best = (waste, width)
        if width <= 16:
            break
        width //= 2
    return best[1] if best is not None else None


def _lower_rows(graph: Graph, plan: KernelPlan, options: LoweringOptions, tiling: tuple, warps: int) -> TileKernel:
    """`lower_pointwise` over [YBLOCK rows, CBLOCK columns] tiles (`_row_tiles`): one program
    per block of rows, and on a GPU per block of columns too (the grid's second axis)."""
    (per_program, columns), shape, order, k = tiling
    b = KernelBuilder(graph, plan.name, options.divisor_checks)
    b.tile_symbols |= {"pid", "pid_c", "yindex", "cindex"}
    n = plan.parallel
    row = static_int(sympy.Mul(*(shape[d] for d in order[k:])))
    rows = sympy.sympify(n) / row
    b.size_params(n)
    b.emit(ProgramId("pid", 0, wide=needs_int64(n)))
    y, c = tile_symbol("yindex"), tile_symbol("cindex")
    b.emit(Arange("yindex", Index(tile_symbol("pid") * tile_symbol("YBLOCK")), "YBLOCK", 0, 2))
    first_column = sympy.Integer(0)
    if columns < row:
        b.emit(ProgramId("pid_c", 1))
        first_column = tile_symbol("pid_c") * tile_symbol("CBLOCK")
    b.emit(Arange("cindex", Index(first_column), "CBLOCK", 1, 2))
    ymask, cmask = bound_check(b, y, rows, per_program, "ymask"), bound_check(b, c, row, columns, "cmask")
    mask = land(ymask, cmask)
    mask = b.let(mask, "tmask") if mask is not None and not isinstance(mask, Var) else mask
    b.restrict_masks(mask, {"yindex": ymask, "cindex": cmask})  # a value per row: loaded once per row
    outer = index_values(tuple(shape[d] for d in order[:k]), y, {y: rows})
    inner = index_values(tuple(shape[d] for d in order[k:]), c, {c: row})
    vals = [None] * len(shape)
    for d, v in zip(order, (*outer, *inner)):
        vals[d] = v
    flat = None
    for st in plan.stages:
        node = graph[st.node]
        at = vals
        if tuple(node.shape) != tuple(shape):  # a fill of another shape (`_flat_fill`)
            if flat is None:
                flat = y * row + c
            at = tuple(simplify_index(v, {y: rows, c: row}) for v in unravel_sym(flat, node.shape))
        v = b.value(mapped(st.body, out_index(node.rank), at), mask=mask)
        b.store(node.name, tuple(Index(e) for e in at), v, mask)
    grid = (sympy.ceiling(rows / tile_symbol("YBLOCK")),)
    if columns < row:
        grid += (sympy.ceiling(sympy.Integer(row) / tile_symbol("CBLOCK")),)
    return TileKernel(plan.name, b.finish_params(), {"YBLOCK": per_program, "CBLOCK": columns}, numel=n,
                      grid=grid, body=b.body, num_warps=warps, reads=b.reads, writes=b.writes,
                      kind=KernelKind.POINTWISE, plan=plan)


def lower_pointwise(graph: Graph, plan: KernelPlan, options: LoweringOptions) -> TileKernel:
    schedule = current_pointwise_schedule(graph, plan, options)
    runs = column_runs(graph, plan, options)
    if runs is not None:
        return lower_column_runs(graph, plan, options, runs, schedule["XBLOCK"])
    tiling = _row_tiles(graph, plan, options, schedule["XBLOCK"])
    if tiling is not None:
        return _lower_rows(graph, plan, options, tiling, 1 if options.target.on_cpu else schedule.warps)
    b = KernelBuilder(graph, plan.name, options.divisor_checks)
    b.tile_symbols |= {"pid", "xindex"}
    n = plan.parallel
    b.size_params(n)
    b.emit(ProgramId("pid", 0, wide=needs_int64(n)))
    x = tile_symbol("xindex")
    b.emit(Arange("xindex", Index(tile_symbol("pid") * tile_symbol("XBLOCK")), "XBLOCK", 0, 1))
    schedule = current_pointwise_schedule(graph, plan, options)
    block, warps = schedule["XBLOCK"], schedule.warps
    xmask = bound_check(b, x, n, block, "xmask")
    for st in plan.stages:
        node = graph[st.node]
        if st.kind == StageKind.SCATTER:
            _store_scattered(b, graph, st, x, n, xmask)
            continue
        vals = storage_index_values(graph, node, x, n)
        v = b.value(mapped(st.body, out_index(node.rank), vals), mask=xmask)
        b.store(node.name, tuple(Index(e) for e in vals), v, xmask)
    return TileKernel(plan.name, b.finish_params(), {"XBLOCK": block}, numel=n,
                      grid=(sympy.ceiling(n / tile_symbol("XBLOCK")),), body=b.body, num_warps=warps,
                      reads=b.reads, writes=b.writes, kind=KernelKind.POINTWISE, plan=plan)


def storage_index_values(graph: Graph, node, x, n) -> tuple:
    """The output index of flat position `x`, counted in the output's storage order (a
    channels-last result is walked channel-fastest), so consecutive lanes store, and read
    inputs of the same layout, at consecutive addresses."""
    order = dense_order(node.shape, graph.output_strides.get(node.name))
    if order is None or order == tuple(range(node.rank)):
        return index_values(node.shape, x, {x: n})
    in_order = index_values(tuple(node.shape[d] for d in order), x, {x: n})
    vals = [None] * node.rank
    for k, d in enumerate(order):
        vals[d] = in_order[k]
    return tuple(vals)


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


def current_pointwise_schedule(graph: Graph, plan: KernelPlan, options: LoweringOptions) -> Schedule:
    """The rules' schedule with `options.schedule`'s knobs over it: what the lowering uses."""
    return schedule_over(pointwise_rules(plan, options), options.schedule)


def shrink_pointwise(plan: KernelPlan, schedule: Schedule, resource: str,
                     options: LoweringOptions) -> Schedule | None:
    """Half the elements per program (down to one), warps within them."""
    smaller = halved(schedule, ("XBLOCK",), floor=1)
    return warps_within(smaller, "XBLOCK") if smaller else None


def _kernels(graph: Graph, plan: KernelPlan, options: LoweringOptions) -> list[TileKernel]:
    return [lower_pointwise(graph, plan, options)]


FAMILY = KernelFamily(PlanKind.POINTWISE, lower=_kernels, space=pointwise_space,
                      schedule=current_pointwise_schedule, shrink=shrink_pointwise, cost=memory_time)

__all__ = ["FAMILY", "lower_pointwise", "pointwise_rules", "pointwise_space", "current_pointwise_schedule",
           "shrink_pointwise"]
