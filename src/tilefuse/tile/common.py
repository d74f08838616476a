"""Helpers every kernel family's lowering shares: the lowering options, static sizes and
powers of two, padding identities and masks, tile index symbols, dot operands, and the
combining and re-basing of carried reduction states."""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from ..ir import dtypes as dt
from ..ir.expr import Cast, Const, Expr, Index, Var, binary, cast, where
from ..ir.graph import Graph
from ..ir.storage import dense_order
from ..ir.monoid import Monoid
from ..ir.rewrite import substitute_index
from ..ir.symbolic import simplify_index, unravel_sym
from .builder import KernelBuilder, land
from .ir import BroadcastTile
from .schedule import Schedule
from .target import Target


@dataclass
class LoweringOptions:
    """What a lowering is asked for: the machine (`target`), the compile's knobs that shape
    kernels, and a schedule to lay over the family's rules."""

    target: Target = Target()  # the machine the kernels run on (`tile.target`)
    persistent_reduction_limit: int = 8192
    column_tiles: bool = True  # reductions that read across their outputs get column tiles
    flash_config: str = ""
    flash_split: int = 0  # key ranges per block of rows in attention kernels (0: by occupancy)
    block_summary: bool = True  # masks read from data: a pre-kernel lists the key tiles to visit
    flash_launch_groups: bool = False  # causal attention kernels launch by groups of batch elements
    schedule: Schedule | None = None  # a schedule of the plan's space (tuned, fitted): over the rules, knob by knob
    matmul: str = "auto"  # plain matmuls: "auto" (measured), "generated", "aten"
    divisor_checks: bool = False  # an integer division by zero raises (CPU tensors, as eager does there)
    index_checks: bool = True  # indices read from data are checked against their bounds (TILEFUSE_INDEX_CHECKS)


def pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def static_int(e) -> int | None:
    e = sympy.sympify(e)
    return int(e) if e.is_Integer else None


def needs_int64(*sizes) -> bool:
    total = sympy.Mul(*sizes)
    v = static_int(total)
    return v is None or v >= 2**31


def identity_const(m: Monoid, dtype) -> Const:
    """The value padding lanes contribute: the monoid's identity in `dtype`, as a constant."""
    v = m.identity(dtype)
    return Const(float(v) if dtype.is_float else v, dtype)


def uniform_layout(graph: Graph, stages, parallel) -> tuple | None:
    """(shape, storage order) shared by every stage's result, when they share one and it
    spans the kernel's whole parallel space (`parallel` elements), else None. A result with
    no dense layout of its own counts as laid out in its dims' order."""
    shapes = {tuple(graph[st.node].shape) for st in stages}
    if len(shapes) != 1:
        return None
    (shape,) = shapes
    if not shape or sympy.sympify(sympy.Mul(*shape)) != sympy.sympify(parallel):
        return None
    identity = tuple(range(len(shape)))
    orders = {dense_order(shape, graph.output_strides.get(st.node)) or identity for st in stages}
    return (shape, orders.pop()) if len(orders) == 1 else None


def bound_check(b: KernelBuilder, index, extent, block: int, name: str):
    """`index < extent` as a mask, or None when every block is full (static extent that the
    block divides): unmasked loads and stores vectorise better."""
    if isinstance(index, sympy.Symbol):
        b.coordinate_extents[index] = extent
    ext = static_int(extent)
    if ext is not None and ext > 0 and ext % block == 0:
        return None
    return b.let(binary("lt", Index(index), Index(extent)), name)


def full_tile(b: KernelBuilder, value: Expr, shape=("XBLOCK", "RBLOCK")) -> Var:
    """A reduction's contribution as a whole tile: a body that does not depend on the
    reduction index still counts once per element of the axis."""
    name = b.fresh("bc")
    b.emit(BroadcastTile(name, value, shape))
    return Var(name, value.dtype)


def masked(b: KernelBuilder, mask, value, other):
    return value if mask is None else b.let(where(mask, value, other))


def tile_symbol(name: str) -> sympy.Symbol:
    # tile indices, program ids and block sizes are never negative: this lets index
    # arithmetic use the fast truncating // and % of the backend
    return sympy.Symbol(name, integer=True, nonnegative=True)


def mapped(body: Expr, symbols, values) -> Expr:
    return substitute_index(body, {s: Index(v) for s, v in zip(symbols, values)})


def index_values(shape, flat, ranges: dict) -> tuple:
    return tuple(simplify_index(v, ranges) for v in unravel_sym(flat, shape))


def lane_ranges(index, shape) -> dict:
    """Extents of the tile symbols that index a kernel's output directly (`rm` of dim M): every
    lane that stores has its symbol inside the dim, so index arithmetic of epilogues may
    assume it (a masked lane's address is never dereferenced)."""
    ranges = {}
    for v, d in zip(index, shape):
        v = sympy.sympify(v)
        if v.is_Symbol:
            ranges[v] = d
    return ranges


def dot_operand(e: Expr) -> tuple[Expr, object]:
    """Strip an upcast of a low-precision operand so the dot runs on tensor cores with fp32
    accumulation."""
    if isinstance(e, Cast) and e.dtype == dt.float32 and e.x.dtype.is_low_precision:
        return e.x, e.x.dtype
    return e, e.dtype


def dot_accumulator(*factors: Expr):
    """The dtype a dot of these factors accumulates in: fp64 for double operands (fp32 would
    lose their precision), fp32 otherwise."""
    return dt.float64 if any(dot_operand(f)[1] == dt.float64 for f in factors) else dt.float32


def combine(b: KernelBuilder, m: Monoid, acc: Expr, v: Expr) -> Expr:
    """acc ⊕ v for an accumulator of `m`, as the tile carries it (any/all: max/min of 0/1)."""
    if not m.tile.op:  # argmax/argmin carry (value, index) pairs: the lowering selects them
        raise ValueError(f"{m} has no elementwise combine")
    return binary(m.tile.op, acc, v)


def rebase(b: KernelBuilder, graph: Graph, carried: Var, repair, running: dict, finite: bool = False) -> Var:
    """h(t) = t·factor(old, new) for a carried partial sum, with every guard decided per row
    (the carried tile itself is only multiplied and selected once):

    * an unchanged base needs no re-basing: condition 1 of the derivation gives
      h(t, r, r) = t, so the factor is 1 there (and `exp(-inf - -inf)` is never formed);
    * the old partial sum is dropped when the factor is 0, or when a max/min producer has just
      left its identity (±inf): its terms were then built on an undefined base (a row that had
      only seen -inf), and in the finished reduction they are exactly 0.

    `finite`: the loop built the terms on a finite base while the producers were at their
    identity (`fusion.finite_base`), so the partial sum is finite and the product alone re-bases
    it (no select on every element)."""
    olds = tuple(running[p][0] for p in repair.producers)
    news = tuple(running[p][1] for p in repair.producers)
    raw = b.value(repair.factor_expr(olds, news))
    same = None
    for old, new in zip(olds, news):
        same = land(same, binary("eq", old, new))
    if same is None:  # no producer (a plain sum carried through a key loop): nothing to re-base
        return carried
    # through b.value (memoised): the sums re-based onto the same producers share one factor
    factor = b.value(where(same, Const(1.0, raw.dtype), raw))
    if finite:
        return b.let(cast(binary("mul", carried, factor), carried.dtype), "rebased")
    discard = binary("eq", factor, Const(0.0, factor.dtype))
    for prod, old, new in zip(repair.producers, olds, news):
        m = graph[prod].combiner
        if m.extremum and old.dtype.is_float:
            ident = identity_const(m, old.dtype)
            left = binary("logical_and", binary("eq", old, ident), binary("ne", new, ident))
            discard = binary("logical_or", discard, left)
    discard = b.value(discard)
    return b.let(where(discard, Const(0.0, carried.dtype), cast(binary("mul", carried, factor), carried.dtype)),
                 "rebased")
