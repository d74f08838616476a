"""In-place indexed writes into graph inputs: `index_put_`, the form a KV-cache update
(`cache.index_copy_(2, pos, k)`, `cache[:, :, pos] = k`) takes once `frontend.reinplace` has
turned AOTAutograd's functional copy-and-write-back into the write itself.

The write becomes a `Scatter` node: one generated kernel walks the written values (the
indexed shape, as advanced indexing defines it), computes each value — its pointwise
producers, such as RoPE of the new keys, fused in — and stores it at the indexed position
of the input. Only the written rows are touched. Negative indices wrap as in eager; a
position outside the input is not written.

Lowered only when nothing else reads the input's old value (then the write can run whenever
its values are ready) and without `accumulate` (which needs atomic adds); otherwise the op
stays an ATen call.
"""
from __future__ import annotations

import sympy
import torch

from ...ir import dtypes as dt
from ...ir.expr import Binary, Index, Where, binary, cast, const, out_index
from ...ir.graph import Input, Scatter
from ..registry import Unsupported, lowering
from ..values import BufferValue, ix
from .common import broadcast_index, broadcast_shapes, is_tensor, py, sym

aten = torch.ops.aten


@lowering(aten.index_put_.default)
def index_put_(ctx, x, indices, values, accumulate=False):
    if py(accumulate):
        raise Unsupported("index_put_ with accumulate=True (needs atomic adds)")
    if not (isinstance(x, BufferValue) and isinstance(ctx.graph.nodes.get(x.name), Input)):
        raise Unsupported("index_put_ into a tensor that is not a graph input")
    node = ctx.current_node
    if node is None or len(node.args[0].users) != 1:
        raise Unsupported("index_put_ into an input whose old value is also read")
    if not is_tensor(values):
        raise Unsupported("index_put_ of a non-tensor value")
    indices = list(indices) + [None] * (x.rank - len(indices))
    pos = [k for k, t in enumerate(indices) if t is not None]
    if not pos:
        raise Unsupported("index_put_ without index tensors")
    for k in pos:
        t = indices[k]
        if not is_tensor(t) or not t.dtype.is_int:
            raise Unsupported("index_put_ with a boolean mask or non-integer index")
    bshape = broadcast_shapes(*[indices[k].shape for k in pos])
    nb = len(bshape)
    adjacent = pos == list(range(pos[0], pos[-1] + 1))
    first = pos[0] if adjacent else 0
    rest = [k for k in range(x.rank) if k not in pos]
    rest_shape = [sym(x.shape[k]) for k in rest]
    space = tuple(rest_shape[:first]) + tuple(bshape) + tuple(rest_shape[first:])
    if broadcast_shapes(values.shape, space) != tuple(sympy.sympify(d) for d in space):
        raise Unsupported(f"index_put_ values of shape {values.shape} do not broadcast to {space}")

    idx = tuple(Index(s) for s in out_index(len(space)))
    bidx = idx[first:first + nb]
    other = list(idx[:first]) + list(idx[first + nb:])
    where = [None] * x.rank
    for k in pos:
        t = indices[k]
        e = cast(t.load(broadcast_index(t, bidx, bshape)), dt.int64)
        where[k] = Where(Binary("lt", e, const(0), dt.bool_), binary("add", e, ix(x.shape[k])), e, dt.int64)
    for j, k in enumerate(rest):
        where[k] = other[j]
    body = cast(values.load(broadcast_index(values, idx, space)), x.dtype)
    name = ctx._name()
    ctx.graph.add(Scatter(name, x.dtype, tuple(sympy.sympify(d) for d in x.shape), target=x.name,
                          space=space, index=tuple(where), body=body))
    return BufferValue(name, x.dtype, tuple(sympy.sympify(d) for d in x.shape))


__all__ = ["index_put_"]
