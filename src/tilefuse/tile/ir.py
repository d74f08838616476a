"""Tile IR: backend-neutral tiled kernels.

A `TileKernel` has parameters (buffers, sizes, strides), a launch grid over its parallel
axes, tunable compile-time block sizes, and a body of statements over *tiles* (blocks of
values that broadcast like NumPy arrays): program ids, ranges, masked loads and stores,
elementwise math (the graph IR's expression language, with `Var` leaves naming tiles and
`Index` leaves holding sympy index arithmetic over tile and size symbols), reductions along a
tile axis, `dot`, and loops over reduction-axis tiles with carried state.

The Triton backend prints it as Triton; a CPU backend prints the same statements as C++.
"""
from __future__ import annotations

from dataclasses import dataclass, field


from ..ir.dtypes import DType
from ..ir.expr import Expr, Index, format_expr
from ..fusion.plan import Vocabulary
from ..ir.monoid import Monoid


@dataclass(frozen=True)
class Scratch:
    """A temporary buffer a kernel writes for a later kernel of the same plan (the partial
    states of a split reduction); the runtime allocates it like a graph buffer."""

    name: str
    shape: tuple  # sympy extents
    dtype: DType


@dataclass
class Param:
    name: str
    kind: str  # "buffer" | "size"
    dtype: DType | None = None


# ---------------------------------------------------------------------------- statements
class Stmt:
    pass


@dataclass
class ProgramId(Stmt):
    name: str
    axis: int
    wide: bool = False  # 64-bit: index arithmetic of this kernel may pass 2**31
    #: programs numbered from the end of the axis (`n - 1 - id`): the launch order then starts
    #: with the programs of most work (a causal flash kernel's last row blocks), so that the
    #: grid's last wave holds short programs rather than one long one
    reverse: bool = False
    #: > 0 on both axes of a 2-D grid: programs launch in groups of `group` indices of axis 1
    #: (batch elements), axis 0 slowest within a group — every batch element's first block,
    #: then every one's second, ... With `reverse` on axis 0 the launch order runs from the
    #: heaviest blocks of a group to the lightest, while the operands the group streams stay
    #: few enough to be reused from the L2 cache (one group's batch elements at a time)
    group: int = 0


@dataclass
class Arange(Stmt):
    """name = start + arange(0, BLOCK), laid along `axis` of an `ndim`-dimensional tile."""

    name: str
    start: Expr
    block: str  # constexpr name
    axis: int
    ndim: int


@dataclass
class Let(Stmt):
    name: str
    value: Expr


@dataclass
class Full(Stmt):
    """name = a tile of `shape` (constexpr names / ints) filled with `value`."""

    name: str
    shape: tuple
    value: object
    dtype: DType


@dataclass
class BroadcastTile(Stmt):
    """name = value broadcast to a tile of `shape` (constexpr names / ints)."""

    name: str
    value: Expr
    shape: tuple


@dataclass
class TransposeTile(Stmt):
    """name = value transposed (a 2-D tile read the other way round: one load serves a dot
    that takes its rows and another that takes its columns)."""

    name: str
    value: Expr


@dataclass
class LoadTile(Stmt):
    name: str
    buffer: str
    offset: Expr
    mask: Expr | None
    dtype: DType
    other: object = 0
    #: cache hint: "last" (read again soon: keep it in L2), "first" (its last read: let it go),
    #: "" (none). Backends without such hints ignore it.
    eviction: str = ""


@dataclass
class StoreTile(Stmt):
    buffer: str
    offset: Expr
    value: Expr
    mask: Expr | None
    dtype: DType


@dataclass
class ReduceTile(Stmt):
    """name = combiner of `value` along `axis` (kept as a size-1 axis); the combiner is a tile
    monoid (`Monoid.tile`: sum, prod, max or min)."""

    name: str
    value: Expr
    combiner: Monoid
    axis: int
    dtype: DType


@dataclass
class ArgReduceTile(Stmt):
    """name = index (from `index`) of the max/min of `value` along `axis`, ties to the lowest
    index; NaN counts as the largest value, as in PyTorch."""

    name: str
    value: Expr
    index: Expr
    combiner: Monoid  # ARGMAX | ARGMIN
    axis: int


@dataclass
class DotTile(Stmt):
    """name = acc + a @ b, accumulated in acc's dtype (fp32; fp64 for double operands)."""

    name: str
    a: Expr
    b: Expr
    acc: Expr
    input_dtype: DType | None = None  # dtype the operands are cast to before the dot


@dataclass
class Assign(Stmt):
    """Update a loop-carried variable."""

    name: str
    value: Expr


@dataclass
class For(Stmt):
    var: str
    start: Expr
    stop: Expr
    step: str  # constexpr name
    body: list = field(default_factory=list)
    #: a loop over a persistent program's tiles whose body holds the K loop: the backend may
    #: flatten the two into one software pipeline (the next tile's loads overlap this epilogue)
    flatten: bool = False


@dataclass
class MakeDescriptor(Stmt):
    """name = a descriptor of a 2-D strided view of `buffer` (row-major: the last stride is 1)
    for block reads of `block` (constexpr names); on Hopper GPUs the copies run on the tensor
    memory accelerator (TMA). Elements outside `shape` read as 0."""

    name: str
    buffer: str
    base: Expr  # element offset of the view's first element
    shape: tuple  # two Exprs
    strides: tuple  # (row stride Expr, 1)
    block: tuple  # two constexpr names


@dataclass
class DescriptorLoad(Stmt):
    """name = the block of `descriptor` at `offsets` (element coordinates), transposed when
    `transpose` (an operand stored the other way round)."""

    name: str
    descriptor: str
    offsets: tuple  # two Exprs
    dtype: DType
    transpose: bool = False


@dataclass
class Check(Stmt):
    """Every element of `ok` (a bool tile) must hold: an index read from tensor data lies in
    its bound, or an integer divisor is not zero. Where one does not, the kernel fails with
    `error` ("IndexError" or "RuntimeError", the class eager PyTorch raises; "ZeroDivisionError"
    for a divisor: eager's RuntimeError('ZeroDivisionError')) and `message`, in which `{size}`
    stands for the value of `size` (the bound, an `Index` over size symbols). Triton prints
    `tl.device_assert`; the C++ backend records the failure and the launcher raises it after
    the kernel returns. Loads at such an index are masked by it too: they never read outside
    their buffer."""

    ok: Expr
    message: str
    error: str = "IndexError"
    size: Expr | None = None


@dataclass
class Comment(Stmt):
    text: str


def expr_names(e: Expr) -> set[str]:
    """The names an expression reads: tile values (`Var`) and the symbols of its index
    arithmetic (tile symbols, sizes)."""
    import sympy

    from ..ir.expr import Index, Var, walk

    names = set()
    for n in walk(e):
        if isinstance(n, Var):
            names.add(n.name)
        elif isinstance(n, Index):
            names |= {s.name for s in sympy.sympify(n.expr).free_symbols}
    return names


def stmt_exprs(s: Stmt) -> list:
    """The expressions a statement reads, its own only (a loop's bounds, not its body)."""
    out = []
    for name in _EXPR_FIELDS.get(type(s), ()):
        value = getattr(s, name)
        if isinstance(value, tuple):
            out.extend(value)
        elif value is not None:
            out.append(value)
    return out


#: the fields of each statement that hold expressions it reads (tuples hold several)
_EXPR_FIELDS = {Let: ("value",), Assign: ("value",), BroadcastTile: ("value",), ReduceTile: ("value",),
                TransposeTile: ("value",), Arange: ("start",), LoadTile: ("offset", "mask"),
                StoreTile: ("offset", "value", "mask"), ArgReduceTile: ("value", "index"), DotTile: ("a", "b", "acc"),
                For: ("start", "stop"), MakeDescriptor: ("base", "shape", "strides"), DescriptorLoad: ("offsets",),
                Check: ("ok", "size")}


def with_exprs(s: Stmt, fn) -> Stmt:
    """A copy of `s` with every expression it reads (those `stmt_exprs` lists) replaced by
    `fn(expr)`; a loop's body is kept as it is."""
    from dataclasses import replace

    changes = {}
    for name in _EXPR_FIELDS.get(type(s), ()):
        value = getattr(s, name)
        if isinstance(value, tuple):
            changes[name] = tuple(fn(v) for v in value)
        elif value is not None:
            changes[name] = fn(value)
    return replace(s, **changes) if changes else s


def statements(stmts):
    """Every statement of a body, those inside loops included, in order (a loop before its body)."""
    for s in stmts:
        yield s
        if isinstance(s, For):
            yield from statements(s.body)


def checks_of(stmts) -> list:
    """The `Check` statements of a body, loops included, in order."""
    return [s for s in statements(stmts) if isinstance(s, Check)]


def without_checks(stmts) -> list:
    """A body with its `Check` statements removed (index checks turned off)."""
    out = []
    for s in stmts:
        if isinstance(s, Check):
            continue
        if isinstance(s, For):
            from dataclasses import replace

            s = replace(s, body=without_checks(s.body))
        out.append(s)
    return out


def check_message(check: Check, env: dict | None = None) -> str:
    """The check's message with its bound: the value in `env` (symbol values), else the size
    expression's text."""
    size = "?"
    if check.size is not None:
        size = str(check.size)
        if env is not None:
            from ..ir import symbolic

            try:
                size = str(int(symbolic.evaluate(check.size.expr, env)))
            except (KeyError, TypeError, ValueError, NotImplementedError):
                pass
    return check.message.replace("{size}", size)


class KernelKind(Vocabulary):
    """What a tile kernel is: its plan's kind (`fusion.plan.PlanKind`), or the merge kernel a
    split flash plan adds after its split kernel, or the pre-kernel that lists the key tiles a
    flash kernel with a mask read from data visits (`tile.block_summary`)."""

    POINTWISE = "pointwise"
    REDUCTION = "reduction"
    CONTRACTION = "contraction"
    FLASH = "flash"
    FLASH_MERGE = "flash-merge"
    BLOCK_SUMMARY = "block-summary"


@dataclass
class TileKernel:
    name: str
    params: list[Param]
    constexprs: dict  # block-size name -> int
    numel: object  # sympy size of the parallel space: nothing to launch when it is 0
    grid: tuple  # sympy expressions over size symbols and constexpr symbols
    body: list
    num_warps: int = 4
    num_stages: int = 1
    reads: list = field(default_factory=list)
    writes: list = field(default_factory=list)
    kind: KernelKind = KernelKind.POINTWISE
    plan: object = None  # the KernelPlan it implements (for reports)
    scratch: dict = field(default_factory=dict)  # name -> Scratch it writes for a later kernel, or reads
    #: alternatives tiled for small values of a symbolic extent, chosen at launch (`tile.variants`)
    variants: object = None
    #: constexprs that are exact extents of any size, not power-of-two blocks (C++ kernels only)
    exact_extents: frozenset = frozenset()

    def grid_size(self, env: dict) -> tuple:
        from ..ir import symbolic

        full = dict(env)
        full.update(self.constexprs)
        return tuple(max(1, int(symbolic.evaluate(g, full))) for g in self.grid)

    def __str__(self) -> str:
        return format_tile_kernel(self)


# ------------------------------------------------------------------------------ text
def _stmt(s, pad: str, out: list) -> None:
    if isinstance(s, ProgramId):
        order = (" reversed" if s.reverse else "") + (f" grouped by {s.group}" if s.group else "")
        out.append(f"{pad}{s.name} = program_id({s.axis}){order}")
    elif isinstance(s, Arange):
        out.append(f"{pad}{s.name} = {format_expr(s.start)} + range({s.block}) @axis{s.axis}/{s.ndim}")
    elif isinstance(s, (Let, Assign)):
        out.append(f"{pad}{s.name} {'=' if isinstance(s, Let) else '<-'} {format_expr(s.value)}")
    elif isinstance(s, BroadcastTile):
        out.append(f"{pad}{s.name} = broadcast({format_expr(s.value)}, {list(s.shape)})")
    elif isinstance(s, TransposeTile):
        out.append(f"{pad}{s.name} = transpose({format_expr(s.value)})")
    elif isinstance(s, Full):
        out.append(f"{pad}{s.name} = full({list(s.shape)}, {s.value}, {s.dtype})")
    elif isinstance(s, LoadTile):
        mask = f" if {format_expr(s.mask)}" if s.mask is not None else ""
        hint = f" (evict {s.eviction})" if s.eviction else ""
        out.append(f"{pad}{s.name} = load {s.buffer}[{format_expr(s.offset)}]{mask}{hint}")
    elif isinstance(s, StoreTile):
        mask = f" if {format_expr(s.mask)}" if s.mask is not None else ""
        out.append(f"{pad}store {s.buffer}[{format_expr(s.offset)}] = {format_expr(s.value)}{mask}")
    elif isinstance(s, ReduceTile):
        out.append(f"{pad}{s.name} = reduce_{s.combiner}({format_expr(s.value)}, axis={s.axis})")
    elif isinstance(s, ArgReduceTile):
        out.append(f"{pad}{s.name} = {s.combiner}({format_expr(s.value)}, axis={s.axis})")
    elif isinstance(s, DotTile):
        operands = f" in {s.input_dtype.name}" if s.input_dtype is not None else ""
        out.append(f"{pad}{s.name} = dot({format_expr(s.a)}, {format_expr(s.b)}){operands} + {format_expr(s.acc)}")
    elif isinstance(s, MakeDescriptor):
        dims = ", ".join(format_expr(d) for d in s.shape)
        strides = ", ".join(format_expr(d) for d in s.strides)
        out.append(f"{pad}{s.name} = descriptor {s.buffer}[{format_expr(s.base)} + view({dims}) strides ({strides})] "
                   f"blocks {s.block[0]}×{s.block[1]}")
    elif isinstance(s, DescriptorLoad):
        at = ", ".join(format_expr(o) for o in s.offsets)
        out.append(f"{pad}{s.name} = block {s.descriptor}[{at}]{'.T' if s.transpose else ''}")
    elif isinstance(s, For):
        flat = " (flattened with the inner loop)" if s.flatten else ""
        out.append(f"{pad}for {s.var} in range({format_expr(s.start)}, {format_expr(s.stop)}, {s.step}):{flat}")
        for t in s.body:
            _stmt(t, pad + "  ", out)
    elif isinstance(s, Check):
        out.append(f"{pad}check {format_expr(s.ok)} else {s.error}: {check_message(s)}")
    elif isinstance(s, Comment):
        out.append(f"{pad}# {s.text}")


def format_tile_kernel(k: TileKernel) -> str:
    params = ", ".join(p.name for p in k.params)
    blocks = ", ".join(f"{n}={v}" for n, v in k.constexprs.items())
    out = [f"tile kernel {k.name}({params}) grid={tuple(str(g) for g in k.grid)} {blocks} warps={k.num_warps}"]
    for s in k.body:
        _stmt(s, "  ", out)
    if k.variants is not None:
        v = k.variants
        for bound, alt in zip(v.bounds, v.kernels):
            out.append(f"for {format_expr(Index(v.extent))} <= {bound} (chosen at launch):")
            out.append(format_tile_kernel(alt))
    return "\n".join(out)
