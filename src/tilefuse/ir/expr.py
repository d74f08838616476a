"""The scalar expression language that Pointwise and Reduce bodies are written in.

An expression describes one element: constants, index arithmetic (`Index`, a sympy
expression over index and size symbols), loads of other tensors at index expressions,
arithmetic, comparisons, `Where` and casts. Expressions are immutable and hashable, so CSE
is dictionary lookup and substitution is a tree map.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import sympy

from . import dtypes as dt
from .dtypes import DType

UNARY_OPS = frozenset(
    """neg abs exp exp2 log log2 log10 log1p expm1 sqrt rsqrt sin cos tan asin acos atan
    sinh cosh tanh tanh_approx asinh acosh atanh sigmoid erf erfc floor ceil round trunc sign
    reciprocal logical_not bitwise_not isnan isinf lgamma""".split()
)
BINARY_OPS = frozenset(
    """add sub mul truediv floordiv mod fmod pow maximum minimum atan2 copysign
    eq ne lt le gt ge logical_and logical_or logical_xor bitwise_and bitwise_or
    bitwise_xor lshift rshift rand""".split()
)
COMPARISONS = frozenset("eq ne lt le gt ge".split())
LOGICAL = frozenset("logical_and logical_or logical_xor".split())
PREDICATES = frozenset("isnan isinf logical_not".split())


class Expr:
    """Base of all scalar expressions; every subclass has a `dtype` field."""

    dtype: DType

    def children(self) -> tuple["Expr", ...]:
        return ()

    def rebuild(self, children: tuple["Expr", ...]) -> "Expr":
        return self

    # Operator sugar keeps lowerings readable: `a * b + c`.
    def __add__(self, o):
        return binary("add", self, o)

    def __radd__(self, o):
        return binary("add", o, self)

    def __sub__(self, o):
        return binary("sub", self, o)

    def __rsub__(self, o):
        return binary("sub", o, self)

    def __mul__(self, o):
        return binary("mul", self, o)

    def __rmul__(self, o):
        return binary("mul", o, self)

    def __truediv__(self, o):
        return binary("truediv", self, o)

    def __rtruediv__(self, o):
        return binary("truediv", o, self)

    def __neg__(self):
        return Unary("neg", self, self.dtype)

    def __str__(self) -> str:
        return format_expr(self)

    def __getstate__(self):
        # the cached hash stays in its process (a string's hash differs from one to the next)
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state


@dataclass(frozen=True, eq=True)
class Const(Expr):
    value: object  # python bool/int/float; float may be inf/nan
    dtype: DType

    def __post_init__(self):
        if isinstance(self.value, float) and math.isnan(self.value):
            # nan != nan would break hashing-based CSE; store a canonical marker.
            object.__setattr__(self, "value", "nan")


@dataclass(frozen=True, eq=True)
class Index(Expr):
    """An integer (or, for symbolic scalars, float) value given by a sympy expression over
    index symbols (i0, r0, ...) and size symbols (s0, ...)."""

    expr: sympy.Expr
    dtype: DType = dt.int64


@dataclass(frozen=True, eq=True)
class Load(Expr):
    """Element of tensor `buffer` at a multi-dimensional logical index. Each component is an
    expression: usually `Index`, or a loaded value for gathers (indirect indexing)."""

    buffer: str
    index: tuple[Expr, ...]
    dtype: DType

    def children(self):
        return self.index

    def rebuild(self, children):
        return Load(self.buffer, tuple(children), self.dtype)


@dataclass(frozen=True, eq=True)
class Var(Expr):
    """A named value bound outside the expression (a reduction result inside a fused
    kernel, a tile-IR variable)."""

    name: str
    dtype: DType


@dataclass(frozen=True, eq=True)
class Unary(Expr):
    op: str
    x: Expr
    dtype: DType

    def __post_init__(self):
        assert self.op in UNARY_OPS, self.op

    def children(self):
        return (self.x,)

    def rebuild(self, children):
        return Unary(self.op, children[0], self.dtype)


@dataclass(frozen=True, eq=True)
class Binary(Expr):
    op: str
    a: Expr
    b: Expr
    dtype: DType

    def __post_init__(self):
        assert self.op in BINARY_OPS, self.op

    def children(self):
        return (self.a, self.b)

    def rebuild(self, children):
        return Binary(self.op, children[0], children[1], self.dtype)


@dataclass(frozen=True, eq=True)
class Where(Expr):
    cond: Expr
    a: Expr
    b: Expr
    dtype: DType

    def children(self):
        return (self.cond, self.a, self.b)

    def rebuild(self, children):
        return Where(children[0], children[1], children[2], self.dtype)


@dataclass(frozen=True, eq=True)
class Cast(Expr):
    x: Expr
    dtype: DType

    def children(self):
        return (self.x,)

    def rebuild(self, children):
        return Cast(children[0], self.dtype)


@dataclass(frozen=True, eq=True)
class CheckedIndex(Expr):
    """An integer index computed from tensor data (a gather's index tensor), with its bound.

    Its value is `x`, or `x + size` where `x < 0` when `wrap` (advanced indexing counts
    negative indices from the end, as PyTorch does). Any value outside `[0, size)` after that is
    an error of the program: eager PyTorch raises `error` ("IndexError" or "RuntimeError"), and
    so do the reference interpreter and generated kernels (unless checks are turned off). `op`
    and `dim` name what is indexed in the message; `size` is a sympy size expression."""

    x: Expr
    size: object  # sympy expression over size symbols
    op: str
    dim: int = 0
    wrap: bool = False
    error: str = "IndexError"
    dtype: DType = dt.int64

    def children(self):
        return (self.x,)

    def rebuild(self, children):
        return CheckedIndex(children[0], self.size, self.op, self.dim, self.wrap, self.error, self.dtype)


def _cached(generated_hash):
    """A node's hash, computed once: the dataclass's own hashes the fields, the children's
    hashes with them, so every dictionary lookup of a deep expression (a transform's memo,
    CSE) would walk its whole tree again."""
    def __hash__(self):
        try:
            return self.__dict__["_hash"]
        except KeyError:
            h = generated_hash(self)
            object.__setattr__(self, "_hash", h)
            return h

    return __hash__


for _node in (Const, Index, Load, Var, Unary, Binary, Where, Cast, CheckedIndex):
    _node.__hash__ = _cached(_node.__hash__)


# ---------------------------------------------------------------- construction helpers


def const(value, dtype: DType | None = None) -> Const:
    if dtype is None:
        dtype = dt.bool_ if isinstance(value, bool) else dt.int64 if isinstance(value, int) else dt.float32
    if dtype.is_bool:
        value = bool(value)
    elif dtype.is_int:
        value = int(value)
    else:
        value = float(value)
    return Const(value, dtype)


def as_expr(x, like: DType | None = None) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, sympy.Basic):
        return Index(sympy.sympify(x))
    if like is not None and not isinstance(x, bool):
        return const(x, like if (like.is_float or isinstance(x, int)) else dt.float32)
    return const(x)


def round_to(value: float, dtype: DType) -> float:
    """`value` rounded to the nearest `dtype` number (ties to even), as a cast would."""
    import struct

    import numpy as np

    if dtype.name == "float32":
        return float(np.float32(value))
    if dtype.name == "float16":
        return float(np.float16(value))
    if dtype.name == "bfloat16":
        if value != value or value in (float("inf"), float("-inf")):
            return value
        bits = struct.unpack("<I", struct.pack("<f", np.float32(value)))[0]
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        return struct.unpack("<f", struct.pack("<I", bits))[0]
    return float(value)


def cast(x: Expr, dtype: DType) -> Expr:
    if x.dtype == dtype:
        return x
    if isinstance(x, Const):
        v = float("nan") if x.value == "nan" else x.value
        if dtype.is_float and not isinstance(v, bool):
            v = round_to(float(v), dtype)
        return const(v, dtype)
    return Cast(x, dtype)


def unary(op: str, x: Expr, dtype: DType | None = None) -> Expr:
    if dtype is None:
        dtype = dt.bool_ if op in PREDICATES else x.dtype
    return Unary(op, x, dtype)


def binary(op: str, a, b, dtype: DType | None = None) -> Expr:
    if not isinstance(a, Expr) and not isinstance(b, Expr):
        raise TypeError("binary() needs at least one expression")
    a = as_expr(a, b.dtype if isinstance(b, Expr) else None)
    b = as_expr(b, a.dtype)
    if dtype is None:
        if op in COMPARISONS or op in LOGICAL:
            dtype = dt.bool_
        else:
            dtype = dt.promote(a.dtype, b.dtype)
    if op not in COMPARISONS and op not in LOGICAL and not op.startswith(("bitwise", "lshift", "rshift")):
        a, b = cast(a, dtype), cast(b, dtype)
    return Binary(op, a, b, dtype)


def where(c: Expr, a, b) -> Expr:
    a = as_expr(a, b.dtype if isinstance(b, Expr) else None)
    b = as_expr(b, a.dtype)
    dtype = dt.promote(a.dtype, b.dtype)
    return Where(c, cast(a, dtype), cast(b, dtype), dtype)


# ---------------------------------------------------------------- traversal


def walk(e: Expr) -> Iterator[Expr]:
    """Pre-order traversal (a node may appear several times if shared)."""
    stack = [e]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(node.children()))


def walk_unique(e: Expr) -> Iterator[Expr]:
    """Pre-order traversal visiting each node object once: an expression whose producers were
    substituted shares its subtrees, and walked as a tree it can be exponentially large (a
    residual MLP's backward took minutes)."""
    seen: set = set()
    stack = [e]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(reversed(node.children()))


def transform(e: Expr, fn: Callable[[Expr], Expr | None], memo: dict | None = None) -> Expr:
    """Bottom-up rewrite. `fn` sees a node whose children are already rewritten and returns
    a replacement or None to keep it."""
    memo = {} if memo is None else memo
    if e in memo:
        return memo[e]
    kids = e.children()
    if kids:
        new_kids = tuple(transform(k, fn, memo) for k in kids)
        node = e.rebuild(new_kids) if new_kids != kids else e
    else:
        node = e
    out = fn(node)
    out = node if out is None else out
    memo[e] = out
    return out


COMPARISONS = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})


def skip_intermediate_rounding(e: Expr) -> Expr:
    """`float32(bfloat16(x))` with `x` already float32 becomes `x`, also through selections
    (`float32(where(c, bfloat16(x), -inf))`): a value that stays in registers between two
    fused ops keeps its compute precision, as in Inductor's kernels; rounding to a
    low-precision dtype happens where a value is stored. Only for the rounding an op applies
    to its own result: the inliner keeps explicit conversions (`x.to(bfloat16)`) out of reach.
    The operands of a comparison keep eager's rounding all the way down their chain: a
    comparison is exact, a value compared with its own rounded copy (`x.amax() >= x`) must
    agree with itself, and an operand rounded only at its end from an unrounded chain can tie
    where eager's values differ (`sigmoid(sigmoid(x)) > sigmoid(x)` in bf16 picked the other
    branch). Their other uses keep compute precision (the chain is computed twice)."""

    def lift(x: Expr, dtype: DType) -> Expr:
        if isinstance(x, Cast) and x.dtype.is_low_precision and x.x.dtype == dtype:
            return x.x
        if isinstance(x, Where) and x.dtype.is_low_precision:
            return Where(x.cond, lift(x.a, dtype), lift(x.b, dtype), dtype)
        return cast(x, dtype)

    memo: dict = {}

    def rec(n: Expr, compared: bool) -> Expr:
        key = (n, compared)
        if key in memo:
            return memo[key]
        if compared or isinstance(n, Binary) and n.op in COMPARISONS:
            kids = tuple(rec(k, True) for k in n.children())  # (eager's rounding, every step)
        else:
            if isinstance(n, Cast) and n.dtype.is_float and not n.dtype.is_low_precision \
                    and n.x.dtype.is_low_precision and isinstance(n.x, (Cast, Where)):
                lifted = lift(n.x, n.dtype)
                if lifted != n:
                    memo[key] = out = rec(lifted, False)
                    return out
            kids = tuple(rec(k, False) for k in n.children())
        out = n.rebuild(kids) if kids and kids != n.children() else n
        memo[key] = out
        return out

    return rec(e, False)


def subs_index(e: Expr, mapping: dict) -> Expr:
    """Substitute sympy symbols inside every `Index` leaf (views, inlining)."""
    if not mapping:
        return e

    def fn(node):
        if isinstance(node, Index):
            new = node.expr.xreplace(mapping)
            if new is not node.expr:
                return Index(new, node.dtype)
        return None

    return transform(e, fn)


def loads(e: Expr) -> list[Load]:
    return [n for n in walk(e) if isinstance(n, Load)]


def buffers_read(e: Expr) -> set[str]:
    return {n.buffer for n in walk(e) if isinstance(n, Load)}


def free_symbols(e: Expr) -> set[sympy.Symbol]:
    out: set = set()
    for n in walk_unique(e):
        if isinstance(n, Index):
            out |= n.expr.free_symbols
    return out


def count_ops(e: Expr, limit: int | None = None) -> int:
    """The operations of `e` as a tree (a shared subtree counts at each use, as a kernel that
    inlines it computes it); past `limit`, the count stops there and returns `limit + 1`."""
    count = 0
    for n in walk(e):
        if isinstance(n, (Unary, Binary, Where)):
            count += 1
            if limit is not None and count > limit:
                break
    return count


def index_symbol(prefix: str, k: int) -> sympy.Symbol:
    return sympy.Symbol(f"{prefix}{k}", integer=True, nonnegative=True)


def out_index(rank: int) -> tuple[sympy.Symbol, ...]:
    return tuple(index_symbol("i", k) for k in range(rank))


def red_index(rank: int) -> tuple[sympy.Symbol, ...]:
    return tuple(index_symbol("r", k) for k in range(rank))


def size_symbol(k: int) -> sympy.Symbol:
    return sympy.Symbol(f"s{k}", integer=True, positive=True)


# ------------------------------------------------------------------------------ text
_INFIX = {
    "add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%",
    "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
    "logical_and": "&&", "logical_or": "||", "bitwise_and": "&", "bitwise_or": "|",
    "bitwise_xor": "^", "lshift": "<<", "rshift": ">>",
}


#: sympy's printer sorts every sum's terms (about half a millisecond an offset); the same
#: offsets recur in every layer's kernels and every candidate's lowering: printed once
sympy_text = functools.lru_cache(maxsize=1 << 15)(str)


def format_expr(e: Expr) -> str:
    if isinstance(e, Const):
        return repr(e.value) if e.dtype.is_float or e.dtype.is_bool else str(e.value)
    if isinstance(e, Index):
        return sympy_text(e.expr) if e.dtype.is_int else f"float({sympy_text(e.expr)})"
    if isinstance(e, Var):
        return e.name
    if isinstance(e, Load):
        return f"{e.buffer}[{', '.join(format_expr(i) for i in e.index)}]"
    if isinstance(e, Unary):
        if e.op == "neg":
            return f"-({format_expr(e.x)})"
        return f"{e.op}({format_expr(e.x)})"
    if isinstance(e, Binary):
        if e.op in _INFIX:
            return f"({format_expr(e.a)} {_INFIX[e.op]} {format_expr(e.b)})"
        return f"{e.op}({format_expr(e.a)}, {format_expr(e.b)})"
    if isinstance(e, Where):
        return f"where({format_expr(e.cond)}, {format_expr(e.a)}, {format_expr(e.b)})"
    if isinstance(e, Cast):
        return f"{e.dtype}({format_expr(e.x)})"
    if isinstance(e, CheckedIndex):
        bound = f"-{e.size} <= . < {e.size}" if e.wrap else f"0 <= . < {e.size}"
        return f"checked({format_expr(e.x)}, {bound})"
    return repr(e)
