"""Data-dependent indexing and assembling ops: index_select, embedding, gather, advanced
indexing (`index.Tensor`), cat, constant_pad_nd, slice_scatter, select_scatter, scatter.

Gathers are views: the index component of the load is an expression that loads the index
tensor (indirect indexing), wrapped in a `CheckedIndex` with its bound and the error eager
raises for an index outside it (`IndexError` for index_select, embedding and advanced
indexing, `RuntimeError` for gather and scatter); `_unsafe_index` is unchecked. cat, padding
and the scatters select between sources with `where`, so they are small Pointwise nodes that
the fusion planner inlines into consumers.
"""
from __future__ import annotations

import sympy
import torch

from ...ir import dtypes as dt
from ...ir.expr import Binary, CheckedIndex, Expr, Index, Where, binary, cast, const
from ...ir.symbolic import floordiv, mod
from ..registry import Unsupported, lowering
from ..values import ViewValue, ix, ix_add
from .common import (as_int, broadcast_index, broadcast_shapes, canonical_dim, copy_of, is_tensor, out_shape,
                     overloads, pointwise, py, scalar, sym)
from .views import slice_start

aten = torch.ops.aten


def _index_expr(value, idx) -> Expr:
    """An integer index loaded from an index tensor, as int64."""
    if value.dtype.is_float or value.dtype.is_bool:
        raise Unsupported(f"index tensor of dtype {value.dtype}")
    return cast(value.load(tuple(idx)), dt.int64)


def _wrap_negative(e: Expr, n) -> Expr:
    """PyTorch's advanced indexing accepts negative indices: i < 0 → i + n."""
    return Where(Binary("lt", e, const(0), dt.bool_), binary("add", e, ix(n)), e, dt.int64)


def _checked(e: Expr, n, op: str, dim: int, wrap: bool = False, error: str = "IndexError") -> Expr:
    """`e` as an index into a dim of size `n`: checked against [0, n) (after wrapping negative
    indices when `wrap`), failing as eager does."""
    return CheckedIndex(e, sym(n), op, dim, wrap, error)


def _and(a: Expr | None, b: Expr) -> Expr:
    return b if a is None else Binary("logical_and", a, b, dt.bool_)


def _lt(a: Expr, b) -> Expr:
    return Binary("lt", a, ix(b), dt.bool_)


def _ge(a: Expr, b) -> Expr:
    return Binary("ge", a, ix(b), dt.bool_)


# ---------------------------------------------------------------- gathers (views)


@lowering(aten.index_select.default)
def index_select(ctx, x, dim, index):
    d = canonical_dim(dim, x.rank)
    if x.rank == 0:
        return x

    def index_map(idx):
        j = _checked(_index_expr(index, (idx[d],) if index.rank == 1 else ()), x.shape[d], "index_select", d)
        return tuple(idx[:d]) + (j,) + tuple(idx[d + 1:])

    return ViewValue(x, out_shape(ctx), index_map, "index_select")


@lowering(aten.embedding.default)
def embedding(ctx, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if weight.rank != 2:
        raise Unsupported("embedding weight must be 2-D")
    r = indices.rank

    def index_map(idx):
        return (_checked(_index_expr(indices, idx[:r]), weight.shape[0], "embedding", 0), idx[r])

    return ViewValue(weight, out_shape(ctx), index_map, "embedding")


@lowering(aten.gather.default)
def gather(ctx, x, dim, index, sparse_grad=False):
    rank = x.rank
    if rank == 0:
        return ViewValue(x, out_shape(ctx), lambda idx: (), "gather")
    d = canonical_dim(dim, rank)

    def index_map(idx):
        out = list(idx)
        out[d] = _checked(_index_expr(index, idx), x.shape[d], "gather", d, error="RuntimeError")
        return tuple(out)

    return ViewValue(x, out_shape(ctx), index_map, "gather")


def advanced_index(x, indices, op: str, checked: bool = True):
    """The layout of advanced indexing `x[indices]` (integer index tensors, None for whole
    dims): (shape of the result, position map from an index of the result to the index of `x`
    it reads), or None without index tensors. The index tensors broadcast together; their dims
    take the first indexed dim's place when the indexed dims are adjacent, else they lead
    (PyTorch's rule). Positions are `CheckedIndex`es of `op` (negative ones wrap) unless
    `checked` is off."""
    indices = list(indices) + [None] * (x.rank - len(indices))
    pos = [k for k, t in enumerate(indices) if t is not None]
    if not pos:
        return None
    for k in pos:
        t = indices[k]
        if not is_tensor(t) or t.dtype.is_bool or t.dtype == dt.uint8:
            raise Unsupported("boolean mask indexing")
    bshape = broadcast_shapes(*[indices[k].shape for k in pos])
    nb = len(bshape)
    adjacent = pos == list(range(pos[0], pos[-1] + 1))
    first = pos[0] if adjacent else 0
    rest = [k for k in range(x.rank) if k not in pos]
    rest_shape = [sym(x.shape[k]) for k in rest]
    shape = tuple(rest_shape[:first]) + tuple(bshape) + tuple(rest_shape[first:])

    def positions(idx):
        bidx = tuple(idx[first:first + nb])
        other = list(idx[:first]) + list(idx[first + nb:])
        out = [None] * x.rank
        for k in pos:
            t = indices[k]
            e = _index_expr(t, broadcast_index(t, bidx, bshape))
            out[k] = _checked(e, x.shape[k], op, k, wrap=True) if checked else _wrap_negative(e, x.shape[k])
        for j, k in enumerate(rest):
            out[k] = other[j]
        return tuple(out)

    return shape, positions


@lowering(*overloads("index.Tensor", "_unsafe_index.Tensor"))
def index_tensor(ctx, x, indices):
    """Advanced indexing with integer index tensors (boolean masks have data-dependent
    shapes and stay extern). `_unsafe_index` (decompositions whose indices are in range by
    construction) is not checked."""
    unsafe = "_unsafe_index" in str(ctx.current_target)
    layout = advanced_index(x, indices, "index", checked=not unsafe)
    if layout is None:
        return x
    return ViewValue(x, out_shape(ctx), layout[1], "index")


# ---------------------------------------------------------------- assembling (pointwise nodes)


def _non_empty_parts(tensors, d):
    parts = []
    for t in tensors:
        if t.rank == 1 and sym(t.shape[0]) == 0:
            continue  # legacy rule: 1-D empty tensors are skipped whatever their dim
        if sym(t.shape[d]) == 0:
            continue
        parts.append(t)
    return parts


@lowering(aten.cat.default)
def cat(ctx, tensors, dim=0):
    shape = out_shape(ctx)
    out = ctx.out_dtype
    rank = len(shape)
    if rank == 0:
        raise Unsupported("cat of 0-d tensors")
    d = canonical_dim(dim, rank)
    parts = _non_empty_parts(tensors, d)
    if not parts:
        return pointwise(ctx, shape, out, lambda idx: scalar(0, out))
    if len(parts) == 1:
        p = parts[0]
        return copy_of(ctx, p) if p.dtype == out else pointwise(ctx, shape, out, lambda idx: cast(p.load(idx), out))
    offsets = [sympy.Integer(0)]
    for p in parts:
        offsets.append(offsets[-1] + sym(p.shape[d]))

    def load_part(k, idx):
        sub = list(idx)
        sub[d] = ix_add(idx[d], -offsets[k])
        return cast(parts[k].load(tuple(sub)), out)

    def body(idx):
        e = load_part(len(parts) - 1, idx)
        for k in range(len(parts) - 2, -1, -1):
            e = Where(_lt(idx[d], offsets[k + 1]), load_part(k, idx), e, out)
        return e

    return pointwise(ctx, shape, out, body)


@lowering(aten.constant_pad_nd.default)
def constant_pad_nd(ctx, x, pad, value=0):
    pad = [py(p) for p in pad]
    if len(pad) % 2 or len(pad) // 2 > x.rank:
        raise Unsupported("bad padding")
    shape = out_shape(ctx)
    rank = x.rank
    lefts = [0] * rank
    rights = [0] * rank
    for k in range(len(pad) // 2):
        d = rank - 1 - k
        lefts[d], rights[d] = pad[2 * k], pad[2 * k + 1]
    for p in lefts + rights:
        if isinstance(p, sympy.Basic) and not (p.is_nonnegative or p.is_nonpositive):
            raise Unsupported("padding of unknown sign")

    def base_index(idx):
        return tuple(ix_add(i, -lefts[k]) if lefts[k] != 0 else i for k, i in enumerate(idx))

    if all(sym(p).is_nonpositive for p in lefts + rights):  # pure cropping: a view
        return ViewValue(x, shape, base_index, "constant_pad_nd")
    out = ctx.out_dtype

    def body(idx):
        cond = None
        for k, i in enumerate(idx):
            if sym(lefts[k]).is_positive:
                cond = _and(cond, _ge(i, lefts[k]))
            if sym(rights[k]).is_positive:
                cond = _and(cond, _lt(i, sym(lefts[k]) + sym(x.shape[k])))
        v = cast(x.load(base_index(idx)), out)
        return v if cond is None else Where(cond, v, scalar(value, out), out)

    return pointwise(ctx, shape, out, body)


@lowering(aten.slice_scatter.default)
def slice_scatter(ctx, x, src, dim=0, start=None, end=None, step=1):
    d = canonical_dim(dim, x.rank)
    step = as_int(step, "slice step")
    s = slice_start(start, x.shape[d])
    length = sym(src.shape[d])
    out = ctx.out_dtype
    if length == 0:
        return copy_of(ctx, x)

    n = sym(x.shape[d])
    end = s + step * (length - 1) + 1

    def body(idx):
        i = idx[d]
        cond = None if s == 0 else _ge(i, s)
        if not sympy.expand(end - n).is_nonnegative:
            cond = _and(cond, _lt(i, end))
        sub = list(idx)
        if step == 1:
            sub[d] = ix_add(i, -s)
        else:
            cond = _and(cond, Binary("eq", Index(mod(i.expr - s, step)) if isinstance(i, Index) else
                                     binary("mod", binary("sub", i, ix(s)), ix(step)), const(0), dt.bool_))
            sub[d] = Index(floordiv(i.expr - s, step)) if isinstance(i, Index) else \
                binary("floordiv", binary("sub", i, ix(s)), ix(step))
        if cond is None:
            return cast(src.load(tuple(sub)), out)
        return Where(cond, cast(src.load(tuple(sub)), out), cast(x.load(idx), out), out)

    return pointwise(ctx, x.shape, out, body)


@lowering(aten.select_scatter.default)
def select_scatter(ctx, x, src, dim, index):
    d = canonical_dim(dim, x.rank)
    index = py(index)
    if isinstance(index, int) and index < 0:
        index = sym(x.shape[d]) + index
    out = ctx.out_dtype

    def body(idx):
        sub = tuple(idx[:d]) + tuple(idx[d + 1:])
        return Where(Binary("eq", idx[d], ix(index), dt.bool_), cast(src.load(sub), out), cast(x.load(idx), out), out)

    return pointwise(ctx, x.shape, out, body)


@lowering(aten.scatter.value, aten.scatter.src)
def scatter(ctx, x, dim, index, src):
    """scatter with one index per row along `dim` (what cross-entropy's backward emits);
    more than one index per row can collide and stays extern."""
    rank = x.rank
    if rank == 0 or index.rank != rank:
        raise Unsupported("scatter of mismatched ranks")
    d = canonical_dim(dim, rank)
    if sym(index.shape[d]) != 1:
        raise Unsupported("scatter with more than one index per row")
    out = ctx.out_dtype

    def body(idx):
        sub = list(idx)
        sub[d] = ix(0)
        sub = tuple(sub)
        target = _checked(_index_expr(index, sub), x.shape[d], "scatter", d, error="RuntimeError")
        cond = Binary("eq", idx[d], target, dt.bool_)
        for k in range(rank):
            if k != d and sympy.expand(sym(index.shape[k]) - sym(x.shape[k])) != 0:
                cond = _and(cond, _lt(idx[k], index.shape[k]))
        v = cast(src.load(sub), out) if is_tensor(src) else scalar(src, out)
        return Where(cond, v, cast(x.load(idx), out), out)

    return pointwise(ctx, x.shape, out, body)
