"""Views and movement ops: reshape, permute, expand, slice, select, squeeze, unsqueeze, flip,
roll, repeat, unfold, diagonal, split.

None of these creates a node: each returns a `ViewValue` whose index map is folded into the
loads of its consumers. Reshape splits the old and new shapes into groups of adjacent dims
with equal products, so a reshape that only splits or merges adjacent dims gives the simplest
index arithmetic (a split is affine; only a merge needs `//` and `%`).
"""
from __future__ import annotations

import sympy
import torch

from ...ir.expr import Index, Load, out_index
from ...ir.symbolic import floordiv, mod
from ..registry import Unsupported, lowering
from ..values import BufferValue, TensorValue, ViewValue, ix, ix_add, ix_mod, ix_mul, ravel, unravel
from .common import as_int, canonical_dim, meta_shape, out_shape, overloads, py, simplify_sym, sym

aten = torch.ops.aten


def view(x, shape, index_map, what: str) -> TensorValue:
    return collapse(ViewValue(x, tuple(sym(d) for d in shape), index_map, what))


def collapse(v: ViewValue) -> TensorValue:
    """The buffer itself when a chain of views reads it at the identity index (a permute
    undone by another, a reshape back to the original shape)."""
    root = v
    while isinstance(root, ViewValue):
        if root.what == "clone":  # a copy of a graph input must stay a copy
            return v
        root = root.base
    if not isinstance(root, BufferValue) or len(root.shape) != len(v.shape):
        return v
    if not all(_same(sym(a), sym(b)) for a, b in zip(root.shape, v.shape)):
        return v
    syms = out_index(len(v.shape))
    e = v.load(tuple(Index(s) for s in syms))
    if not isinstance(e, Load) or e.buffer != root.name:
        return v
    ranges = dict(zip(syms, v.shape))
    for comp, s in zip(e.index, syms):
        if not (isinstance(comp, Index) and simplify_sym(comp.expr, ranges) == s):
            return v
    return root


def _all_sym(idx) -> bool:
    return all(isinstance(e, Index) and e.dtype.is_int for e in idx)


# ---------------------------------------------------------------- reshape

_PLACEHOLDERS = [sympy.Symbol(f"_p{k}", integer=True, nonnegative=True) for k in range(64)]


def _exact(e) -> sympy.Expr:
    """A size with its floor divisions taken as exact (used only to pair dims up; see
    `reshape_groups` for why the pairing stays sound)."""
    e = sympy.sympify(e)
    return e.replace(sympy.floor, lambda a: a) if e.has(sympy.floor) else e


def _is_multiple(big, small) -> bool:
    q = sympy.cancel(sympy.sympify(big) / sympy.sympify(small))
    return q != 1 and (q.is_integer is True or (q.is_number is False and q.as_numer_denom()[1] == 1))


def _same(a, b) -> bool:
    return a == b or sympy.expand(a - b) == 0


def reshape_groups(old: tuple, new: tuple):
    """[(old dims, new dims), ...] with equal products; None when the shapes cannot be
    grouped (then the whole tensor is one group). Size-1 dims outside groups are skipped.

    Symbolic sizes with floor divisions (`s//4`) are paired as if the divisions were exact.
    That is sound as long as at most one group has such sizes: every other group's products
    are equal outright, and the numel of a valid view is the same on both sides, so the
    remaining group's products are equal too. Groups from the first to the last one with a
    floor are therefore merged into one."""
    groups = _pair_dims(old, new)
    if groups is None:
        return None
    floored = [k for k, (go, gn) in enumerate(groups)
               if any(sympy.sympify(old[i]).has(sympy.floor) for i in go)
               or any(sympy.sympify(new[j]).has(sympy.floor) for j in gn)]
    if len(floored) > 1:
        a, b = floored[0], floored[-1]
        # the merged group spans the dims in between, size-1 dims skipped by the pairing included
        merged = (list(range(groups[a][0][0], groups[b][0][-1] + 1)),
                  list(range(groups[a][1][0], groups[b][1][-1] + 1)))
        groups = groups[:a] + [merged] + groups[b + 1:]
    return groups


def _pair_dims(old: tuple, new: tuple):
    groups = []
    i = j = 0
    no, nn = len(old), len(new)
    while True:
        while i < no and old[i] == 1:
            i += 1
        while j < nn and new[j] == 1:
            j += 1
        if i == no and j == nn:
            return groups
        if i == no or j == nn:
            return None
        go, gn = [i], [j]
        po, pn = sym(old[i]), sym(new[j])
        i += 1
        j += 1
        while not _same(_exact(po), _exact(pn)):
            if po.is_number and pn.is_number:
                grow_old = po < pn
            elif _is_multiple(_exact(pn), _exact(po)):
                grow_old = True
            elif _is_multiple(_exact(po), _exact(pn)):
                grow_old = False
            else:
                return None
            if grow_old:
                if i == no:
                    return None
                po *= sym(old[i])
                go.append(i)
                i += 1
            else:
                if j == nn:
                    return None
                pn *= sym(new[j])
                gn.append(j)
                j += 1
        groups.append((go, gn))


def _ravel_sym(index, shape):
    flat = sympy.Integer(0)
    for i, n in zip(index, shape):
        flat = flat * n + i
    return flat


def _unravel_sym(flat, shape):
    out = []
    for k in range(len(shape) - 1, -1, -1):
        if k == 0:
            out.append(flat)
        else:
            out.append(mod(flat, shape[k]))
            flat = floordiv(flat, shape[k])
    return list(reversed(out))


def reshape_map(old: tuple, new: tuple):
    """Index map of `x.reshape(new)` for `x` of shape `old`: new index → old index."""
    old = tuple(sym(d) for d in old)
    new = tuple(sym(d) for d in new)
    if len(new) > len(_PLACEHOLDERS):
        raise Unsupported("rank too large")
    if any(d == 0 for d in old + new):
        return lambda idx: tuple(Index(sympy.Integer(0)) for _ in old)
    groups = reshape_groups(old, new)
    if groups is None:
        groups = [(list(range(len(old))), list(range(len(new))))]
    P = _PLACEHOLDERS[:len(new)]
    ranges = dict(zip(P, new))
    formula = [sympy.Integer(0)] * len(old)
    for go, gn in groups:
        flat = _ravel_sym([P[j] for j in gn], [new[j] for j in gn])
        for i, e in zip(go, _unravel_sym(flat, [old[i] for i in go])):
            formula[i] = simplify_sym(sympy.expand(e) if not e.has(sympy.floor, sympy.Mod) else e, ranges)

    def index_map(idx):
        if _all_sym(idx):
            sub = {p: e.expr for p, e in zip(P, idx)}
            return tuple(Index(f.xreplace(sub)) for f in formula)
        out = [ix(0)] * len(old)
        for go, gn in groups:
            flat = ravel([idx[j] for j in gn], [new[j] for j in gn])
            for i, e in zip(go, unravel(flat, [old[i] for i in go])):
                out[i] = e
        return tuple(out)

    return index_map


def reshape(x, shape):
    shape = tuple(sym(d) for d in shape)
    if tuple(sym(d) for d in x.shape) == shape:
        return x
    return view(x, shape, reshape_map(x.shape, shape), "reshape")


@lowering(*overloads("view.default", "_unsafe_view.default", "reshape.default", "view_copy.default",
                "_reshape_alias.default", "_reshape_alias_copy.default"))
def view_lowering(ctx, x, size, *rest):
    return reshape(x, out_shape(ctx))


@lowering(*overloads("view.dtype"))
def view_dtype(ctx, x, dtype):
    raise Unsupported("bitcast views are not generated")


@lowering(*overloads("as_strided.default", "as_strided_copy.default"))
def as_strided(ctx, x, size, stride, storage_offset=None):
    raise Unsupported("as_strided depends on the physical strides of its input")


# ---------------------------------------------------------------- permutations


def permute(x, dims):
    rank = x.rank
    dims = [canonical_dim(d, rank) for d in dims]
    if sorted(dims) != list(range(rank)):
        raise Unsupported(f"bad permutation {dims}")
    if dims == list(range(rank)):
        return x

    def index_map(idx):
        out = [None] * rank
        for j, d in enumerate(dims):
            out[d] = idx[j]
        return tuple(out)

    return view(x, [x.shape[d] for d in dims], index_map, "permute")


@lowering(*overloads("permute.default", "permute_copy.default"))
def permute_lowering(ctx, x, dims):
    return permute(x, dims)


def transpose(x, d0, d1):
    rank = x.rank
    if rank < 2:
        return x
    d0, d1 = canonical_dim(d0, rank), canonical_dim(d1, rank)
    dims = list(range(rank))
    dims[d0], dims[d1] = dims[d1], dims[d0]
    return permute(x, dims)


@lowering(*overloads("transpose.int", "transpose_copy.int"))
def transpose_lowering(ctx, x, d0, d1):
    return transpose(x, d0, d1)


@lowering(*overloads("t.default", "t_copy.default"))
def t(ctx, x):
    return transpose(x, 0, 1)


# ---------------------------------------------------------------- broadcasting


def expand(x, shape):
    shape = tuple(sym(d) for d in shape)
    offset = len(shape) - x.rank
    if offset == 0 and tuple(sym(d) for d in x.shape) == shape:
        return x
    bcast = [sym(d) == 1 and shape[offset + k] != 1 for k, d in enumerate(x.shape)]

    def index_map(idx):
        return tuple(ix(0) if b else idx[offset + k] for k, b in enumerate(bcast))

    return view(x, shape, index_map, "expand")


@lowering(*overloads("expand.default", "expand_copy.default"))
def expand_lowering(ctx, x, size, implicit=False):
    return expand(x, out_shape(ctx))


@lowering(*overloads("repeat.default"))
def repeat(ctx, x, repeats):
    shape = out_shape(ctx)
    reps = py(list(repeats))
    lead = len(reps) - x.rank

    def index_map(idx):
        out = []
        for k, n in enumerate(x.shape):
            i = idx[lead + k]
            out.append(i if reps[lead + k] == 1 else ix_mod(i, n))
        return tuple(out)

    return view(x, shape, index_map, "repeat")


# ---------------------------------------------------------------- slicing


def slice_start(start, n):
    """Where a slice begins, clamped like PyTorch (only matters when it is not empty)."""
    start = py(start)
    n = sym(n)
    if start is None:
        return sympy.Integer(0)
    s = sym(start)
    if s.is_number:
        s = int(s)
        if n.is_number:
            n = int(n)
            if s < 0:
                s += n
            return sympy.Integer(min(max(s, 0), n))
        return sympy.Integer(s) if s >= 0 else sympy.Max(n + s, 0)
    if s.is_nonnegative:
        return s
    if s.is_negative:
        return sympy.Max(n + s, 0)
    raise Unsupported(f"slice start {s} of unknown sign")


def slice_view(x, dim, start, length, step):
    d = dim
    shape = list(x.shape)
    shape[d] = length

    def index_map(idx):
        out = list(idx)
        out[d] = ix_add(ix_mul(idx[d], step), start) if step != 1 else ix_add(idx[d], start)
        return tuple(out)

    return view(x, shape, index_map, "slice")


@lowering(*overloads("slice.Tensor", "slice_copy.Tensor"))
def slice_lowering(ctx, x, dim=0, start=None, end=None, step=1):
    d = canonical_dim(dim, x.rank)
    step = as_int(step, "slice step")
    if step <= 0:
        raise Unsupported("non-positive slice step")
    length = out_shape(ctx)[d]
    s = slice_start(start, x.shape[d])
    if s == 0 and step == 1 and _same(sym(length), sym(x.shape[d])):
        return x
    return slice_view(x, d, s, length, step)


@lowering(*overloads("narrow.default", "narrow_copy.default"))
def narrow(ctx, x, dim, start, length):
    d = canonical_dim(dim, x.rank)
    return slice_view(x, d, slice_start(start, x.shape[d]), out_shape(ctx)[d], 1)


def select(x, dim, index):
    d = canonical_dim(dim, x.rank)
    index = py(index)
    n = sym(x.shape[d])
    if isinstance(index, int):
        if index < 0:
            index = n + index
    elif isinstance(index, sympy.Basic):
        if index.is_negative:
            index = n + index
        elif not index.is_nonnegative:
            raise Unsupported(f"select index {index} of unknown sign")
    else:
        raise Unsupported(f"select index {index!r}")
    shape = list(x.shape)
    del shape[d]

    def index_map(idx):
        return tuple(idx[:d]) + (ix(index),) + tuple(idx[d:])

    return view(x, shape, index_map, "select")


@lowering(*overloads("select.int", "select_copy.int"))
def select_lowering(ctx, x, dim, index):
    return select(x, dim, index)


def _split_by_meta(ctx, x, dim):
    d = canonical_dim(dim, x.rank)
    outs = []
    offset = sympy.Integer(0)
    for k in range(len(ctx.current_meta)):
        length = meta_shape(ctx, k)[d]
        outs.append(slice_view(x, d, offset, length, 1))
        offset = offset + length
    return tuple(outs)


@lowering(*overloads("split_with_sizes.default", "split_with_sizes_copy.default"))
def split_with_sizes(ctx, x, split_sizes, dim=0):
    return _split_by_meta(ctx, x, dim)


@lowering(*overloads("split.Tensor", "split_copy.Tensor"))
def split(ctx, x, split_size, dim=0):
    return _split_by_meta(ctx, x, dim)


@lowering(*overloads("unbind.int", "unbind_copy.int"))
def unbind(ctx, x, dim=0):
    return tuple(select(x, dim, k) for k in range(len(ctx.current_meta)))


# ---------------------------------------------------------------- rank changes


@lowering(*overloads("squeeze.default", "squeeze.dim", "squeeze.dims", "squeeze_copy.default",
                "squeeze_copy.dim", "squeeze_copy.dims"))
def squeeze(ctx, x, dims=None):
    rank = x.rank
    if rank == 0:
        return x
    if dims is None:
        cand = list(range(rank))
    elif isinstance(dims, (list, tuple)):
        cand = [canonical_dim(d, rank) for d in dims]
    else:
        cand = [canonical_dim(dims, rank)]
    drop = sorted({d for d in cand if sym(x.shape[d]) == 1})
    if not drop:
        return x
    shape = [n for k, n in enumerate(x.shape) if k not in drop]
    keep = [k for k in range(rank) if k not in drop]

    def index_map(idx):
        out = [ix(0)] * rank
        for j, k in enumerate(keep):
            out[k] = idx[j]
        return tuple(out)

    return view(x, shape, index_map, "squeeze")


def unsqueeze(x, dim):
    d = canonical_dim(dim, x.rank + 1)
    shape = list(x.shape)
    shape.insert(d, sympy.Integer(1))

    def index_map(idx):
        return tuple(idx[:d]) + tuple(idx[d + 1:])

    return view(x, shape, index_map, "unsqueeze")


@lowering(*overloads("unsqueeze.default", "unsqueeze_copy.default"))
def unsqueeze_lowering(ctx, x, dim):
    return unsqueeze(x, dim)


# ---------------------------------------------------------------- reorderings


@lowering(*overloads("flip.default"))
def flip(ctx, x, dims):
    rank = x.rank
    flipped = {canonical_dim(d, rank) for d in dims} if rank else set()
    if not flipped:
        return x

    def index_map(idx):
        return tuple(ix_add(sym(x.shape[k]) - 1, ix_mul(i, -1)) if k in flipped else i
                     for k, i in enumerate(idx))

    return view(x, x.shape, index_map, "flip")


def _roll_index(i, n, shift):
    """(i - shift) mod n with a non-negative dividend."""
    n = sym(n)
    if n.is_number:
        s = shift % int(n)
        if s == 0:
            return i
        return ix_mod(ix_add(i, int(n) - s), n)
    if shift >= 0:
        return ix_mod(ix_add(i, n * shift - shift), n)
    return ix_mod(ix_add(i, -shift), n)


@lowering(*overloads("roll.default"))
def roll(ctx, x, shifts, dims=()):
    shifts = [as_int(s, "roll shift") for s in shifts]
    dims = [canonical_dim(d, x.rank) for d in dims]
    if not dims:
        if len(shifts) != 1:
            raise Unsupported("roll without dims takes one shift")
        total = sympy.Mul(*[sym(d) for d in x.shape]) if x.shape else sympy.Integer(1)

        def flat_map(idx):
            flat = ravel(idx, x.shape)
            return unravel(_roll_index(flat, total, shifts[0]), x.shape)

        return view(x, x.shape, flat_map, "roll")
    if len(shifts) != len(dims):
        raise Unsupported("roll shifts/dims mismatch")
    per_dim = {}
    for s, d in zip(shifts, dims):
        per_dim[d] = per_dim.get(d, 0) + s

    def index_map(idx):
        return tuple(_roll_index(i, x.shape[k], per_dim[k]) if k in per_dim else i for k, i in enumerate(idx))

    return view(x, x.shape, index_map, "roll")


@lowering(*overloads("unfold.default", "unfold_copy.default"))
def unfold(ctx, x, dimension, size, step):
    rank = x.rank
    d = canonical_dim(dimension, rank)
    step = as_int(step, "unfold step")
    if rank == 0:
        raise Unsupported("unfold of a 0-d tensor")

    def index_map(idx):
        out = list(idx[:rank])
        out[d] = ix_add(ix_mul(idx[d], step), idx[rank])
        return tuple(out)

    return view(x, out_shape(ctx), index_map, "unfold")


@lowering(*overloads("diagonal.default", "diagonal_copy.default"))
def diagonal(ctx, x, offset=0, dim1=0, dim2=1):
    rank = x.rank
    d1, d2 = canonical_dim(dim1, rank), canonical_dim(dim2, rank)
    offset = as_int(offset, "diagonal offset")
    rest = [k for k in range(rank) if k not in (d1, d2)]

    def index_map(idx):
        out = [None] * rank
        for j, k in enumerate(rest):
            out[k] = idx[j]
        diag = idx[len(rest)]
        out[d1] = ix_add(diag, max(-offset, 0))
        out[d2] = ix_add(diag, max(offset, 0))
        return tuple(out)

    return view(x, out_shape(ctx), index_map, "diagonal")
