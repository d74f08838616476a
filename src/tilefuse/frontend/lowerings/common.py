"""Helpers shared by lowerings: argument normalisation, broadcasting, scalar operands, type
promotion, dimension handling and body simplification.

FX arguments reach a lowering with python numbers already turned into sympy numbers (and
SymInts into sympy expressions); `py` turns concrete sympy numbers back into python numbers so
that comparisons such as `alpha == 1` behave (sympy's `Float(1.0) != 1`).
"""
from __future__ import annotations

import math

import sympy
import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from ...errors import ProgramError
from ...ir import dtypes as dt
from ...ir.dtypes import DType
from ...ir.expr import Expr, Index, as_expr, cast, const, out_index, red_index, transform
from ...ir.graph import Constant, Input, ScalarInput
from ...ir.interpret import torch_dtype
from ...ir.monoid import Monoid
from ...ir.symbolic import simplify_index
from ..context import ir_dtype, plain_sympy, shape_of
from ..registry import Unsupported
from ..values import BufferValue, TensorValue, ViewValue

aten = torch.ops.aten

# ---------------------------------------------------------------- argument normalisation

to_sympy = plain_sympy  # PyTorch's sympy functions -> plain sympy


def py(x):
    """Concrete sympy numbers → python numbers (recursively through lists/tuples);
    symbolic expressions and everything else unchanged."""
    if isinstance(x, (list, tuple)):
        return type(x)(py(v) for v in x)
    if isinstance(x, sympy.Basic):
        x = to_sympy(x)
        if x is sympy.true or x is sympy.false:
            return bool(x)
        if x.is_Integer:
            return int(x)
        if x.is_Number:
            return float(x)
    return x


def is_tensor(v) -> bool:
    return isinstance(v, TensorValue)


def as_int(x, what: str = "argument") -> int:
    x = py(x)
    if isinstance(x, bool) or not isinstance(x, int):
        raise Unsupported(f"{what} must be a concrete int, got {x!r}")
    return x


def canonical_dim(dim, rank: int) -> int:
    d = as_int(dim, "dim")
    n = max(rank, 1)
    if not -n <= d < n:
        raise Unsupported(f"dim {d} out of range for rank {rank}")
    return d % n


def canonical_dims(dims, rank: int) -> list[int]:
    """Sorted unique reduction dims; None or [] mean every dim (as ATen reductions do)."""
    if dims is None:
        return list(range(rank))
    if not isinstance(dims, (list, tuple)):
        dims = [dims]
    if len(dims) == 0:
        return list(range(rank))
    if rank == 0:
        for d in dims:
            canonical_dim(d, 0)
        return []
    return sorted({canonical_dim(d, rank) for d in dims})


def sym(x) -> sympy.Expr:
    return to_sympy(sympy.sympify(x))


def overloads(*names, ns=None) -> list:
    """The overloads among `names` ("packet.overload", default overload when none) that this
    PyTorch version has; registering only these keeps the package importable across
    versions."""
    ns = aten if ns is None else ns
    out = []
    for name in names:
        pkt, _, ov = name.partition(".")
        target = getattr(getattr(ns, pkt, None), ov or "default", None)
        if target is not None:
            out.append(target)
    return out


# ---------------------------------------------------------------- metadata of multi-output ops


def meta_at(ctx, k: int):
    meta = ctx.current_meta
    return meta[k] if isinstance(meta, (tuple, list)) else meta


def meta_dtype(ctx, k: int = 0) -> DType:
    return ir_dtype(meta_at(ctx, k).dtype)


def meta_shape(ctx, k: int = 0) -> tuple:
    return tuple(sym(d) for d in shape_of(meta_at(ctx, k)))


def out_shape(ctx) -> tuple:
    """PyTorch's result shape of the op being lowered, in plain sympy."""
    return tuple(sym(d) for d in ctx.out_shape)


# ---------------------------------------------------------------- dtypes and scalars


def acc_dtype(dtype: DType) -> DType:
    """Accumulation dtype of a sum/prod: fp32 for fp16/bf16, int64 for integers and bool."""
    if dtype.is_float:
        return dt.compute_dtype(dtype)
    return dt.int64


def _meta_dummy(v):
    if isinstance(v, TensorValue):
        return torch.empty((1,) * min(v.rank, 1), dtype=torch_dtype(v.dtype), device="meta")
    v = py(v)
    if isinstance(v, sympy.Basic):
        return 1 if v.is_integer else 1.0
    if isinstance(v, Expr):
        return torch.empty((1,), dtype=torch_dtype(v.dtype), device="meta")
    return v


def promoted_dtype(*operands) -> DType:
    """PyTorch's default elementwise type promotion of tensors and python scalars (the
    dtype comparisons and `where` are carried out in)."""
    args = [_meta_dummy(v) for v in operands if v is not None]
    _, result = elementwise_dtypes(*args, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
    return ir_dtype(result)


def round_scalar(value, dtype: DType):
    """A python number rounded to `dtype` exactly as `torch.tensor(value, dtype=...)` does."""
    if dtype.is_bool:
        return bool(value)
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return value
    if dtype.is_int:
        return wrap_int(int(value), dtype)
    if dtype == dt.float64:
        return float(value)
    return torch.tensor(value, dtype=torch_dtype(dtype)).item()


#: the C++ names eager's overflow message gives each type
_C_NAMES = {"uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t", "int8": "int8_t",
            "int16": "int16_t", "int32": "int", "int64": "int64_t", "float32": "float"}


def check_scalar_fits(value, dtype: DType) -> None:
    """Raise `ProgramError` where eager refuses to convert the scalar `value` to `dtype` (c10's
    `checked_convert`, as `fill_`, `full`, `masked_fill`, `clamp`, `hardtanh`, `add`'s alpha and
    an integer tensor's `pow` exponent do). For an integer type: an integer outside its range
    (an unsigned type also takes negatives down to −max, which wrap) or a float outside it,
    compared in double as c10 does (infinities and NaN included). For fp32: a finite value
    beyond its range. Eager wraps other scalars silently (`x + 300`, comparisons: `wrap_int`).

    Not checked, so the value converts as IEEE says (to ±inf): fp16 and bf16, where eager's
    verdict depends on the device and the size (CPU fills a one-element tensor without the
    check, CUDA clamps fp16 by a float bound), and symbolic values, which eager sees only as
    numbers at run time."""
    value = py(value)
    if dtype.is_bool or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if dtype.is_int:
        info = torch.iinfo(torch_dtype(dtype))
        if isinstance(value, int):
            low = -info.max if info.min == 0 else info.min
            bad = value > info.max or value < low
        else:
            bad = math.isnan(value) or value < float(info.min) or value > float(info.max)
    elif dtype == dt.float32:
        big = float(torch.finfo(torch.float32).max)
        bad = abs(value) > big if isinstance(value, int) else math.isfinite(value) and abs(value) > big
    else:
        bad = False
    if bad:
        raise ProgramError(f"value cannot be converted to type {_C_NAMES.get(dtype.name, dtype.name)} without overflow")


def wrap_int(value: int, dtype: DType) -> int:
    """`value` as a `dtype` integer holds it: PyTorch casts an integer scalar operand to the
    tensor's integer type with wrap-around (`uint8_tensor == -1` compares with 255, `> 300` with
    44)."""
    bits = 8 * dtype.itemsize
    value %= 1 << bits
    return value - (1 << bits) if dtype.kind == "i" and value >= 1 << (bits - 1) else value


def scalar(value, dtype: DType | None = None, round_to: DType | None = None) -> Expr:
    """A python number, sympy expression or expression as an expression of `dtype`.
    `round_to` first rounds a python number to that dtype (PyTorch casts scalar operands of
    comparisons to the promoted dtype)."""
    if isinstance(value, Expr):
        return value if dtype is None else cast(value, dtype)
    value = py(value)
    if isinstance(value, sympy.Basic):
        e = Index(value, dt.int64 if value.is_integer else dt.float64)
        return e if dtype is None else cast(e, dtype)
    if round_to is not None:
        value = round_scalar(value, round_to)
    if dtype is None:
        return as_expr(value) if not isinstance(value, float) else const(value, dt.float64)
    if dtype.is_bool:
        return const(bool(value), dtype)
    if dtype.is_int and isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            raise Unsupported(f"cannot represent {value} as {dtype}")
        return const(wrap_int(int(value), dtype), dtype)  # truncation, like a float → int cast
    if dtype.is_int and isinstance(value, int):
        return const(wrap_int(value, dtype), dtype)
    return const(value, dtype)


def is_scalar_value(v, value) -> bool:
    """`v` is a concrete python scalar equal to `value`."""
    v = py(v)
    return not isinstance(v, (sympy.Basic, TensorValue, Expr)) and v is not None and \
        not isinstance(v, bool) and v == value


# ---------------------------------------------------------------- broadcasting


def broadcast_shapes(*shapes) -> tuple:
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for k in range(rank):
        dim = sympy.Integer(1)
        for s in shapes:
            j = k - (rank - len(s))
            if j < 0:
                continue
            d = sympy.sympify(s[j])
            if d != 1:
                dim = d
        out.append(dim)
    return tuple(out)


def broadcast_index(value: TensorValue, index: tuple, out_shape: tuple) -> tuple:
    offset = len(out_shape) - value.rank
    sub = []
    for j, d in enumerate(value.shape):
        if sympy.sympify(d) == 1 and sympy.sympify(out_shape[offset + j]) != 1:
            sub.append(Index(sympy.Integer(0)))
        else:
            sub.append(index[offset + j])
    return tuple(sub)


def broadcast_load(value, index: tuple, out_shape: tuple, dtype: DType | None = None,
                   round_to: DType | None = None) -> Expr:
    """Load `value` (tensor or python/sympy scalar) at `index` of the broadcast result, as
    `dtype`."""
    if isinstance(value, TensorValue):
        e = value.load(broadcast_index(value, index, out_shape))
        if round_to is not None and round_to != e.dtype:
            e = cast(e, round_to)
        return cast(e, dtype) if dtype is not None else e
    return scalar(value, dtype, round_to=round_to)


# ---------------------------------------------------------------- node builders with simplification


def simplify_sym(expr: sympy.Expr, ranges: dict) -> sympy.Expr:
    if not expr.has(sympy.floor, sympy.Mod):
        return expr
    return simplify_index(expr, ranges)


def simplify_body(body: Expr, ranges: dict) -> Expr:
    """Simplify every index expression of `body` with the index symbols' extents."""

    def fn(node):
        if isinstance(node, Index) and node.dtype.is_int:
            new = simplify_sym(node.expr, ranges)
            if new != node.expr:
                return Index(new, node.dtype)
        return None

    return transform(body, fn)


def pointwise(ctx, shape, dtype: DType, fn) -> BufferValue:
    shape = tuple(sym(d) for d in shape)
    ranges = dict(zip(out_index(len(shape)), shape))
    return ctx.pointwise(shape, dtype, lambda idx: simplify_body(fn(idx), ranges))


def reduce(ctx, shape, ranges, combiner: Monoid, fn, dtype: DType) -> BufferValue:
    shape = tuple(sym(d) for d in shape)
    ranges = tuple(sym(d) for d in ranges)
    extents = dict(zip(out_index(len(shape)), shape))
    extents.update(zip(red_index(len(ranges)), ranges))
    return ctx.reduce(shape, ranges, combiner, lambda idx, ridx: simplify_body(fn(idx, ridx), extents), dtype)


def elementwise(ctx, operands, fn, compute: DType | None = None, out_dtype: DType | None = None,
                round_to: DType | None = None) -> BufferValue:
    """Load every operand broadcast to ctx.out_shape in the compute dtype, combine with `fn`,
    cast to the result dtype."""
    out_dtype = out_dtype or ctx.out_dtype
    compute = compute or dt.compute_dtype(out_dtype)
    shape = out_shape(ctx)
    return pointwise(ctx, shape, out_dtype,
                     lambda idx: fn(*[broadcast_load(v, idx, shape, compute, round_to) for v in operands]))


def is_graph_input(ctx, value) -> bool:
    node = ctx.graph.nodes.get(value.name) if isinstance(value, BufferValue) else None
    return isinstance(node, (Input, ScalarInput, Constant))


def copy_of(ctx, value: TensorValue) -> TensorValue:
    """A value equal to `value` for an op that returns a fresh tensor (clone, _to_copy): the
    IR is functional, so the value itself; a graph input is wrapped in an identity view so
    that, if it is returned, the output is a copy rather than the caller's own input object
    (consumers read through the view for free)."""
    if is_graph_input(ctx, value):
        return ViewValue(value, tuple(value.shape), lambda idx: tuple(idx), "clone")
    return value


def finfo(dtype: DType):
    return torch.finfo(torch_dtype(dtype))
