"""In-place indexed writes into graph inputs: `index_put_`, the form a KV-cache update
(`cache.index_copy_(2, pos, k)`, `cache[:, :, pos] = k`) takes once `frontend.reinplace` has
turned AOTAutograd's functional copy-and-write-back into the write itself.

The write becomes a `Scatter` node: one generated kernel walks the written values (the
indexed shape, as advanced indexing defines it), computes each value — its pointwise
producers, such as RoPE of the new keys, fused in — and stores it at the indexed position
of the input. Only the written rows are touched. Negative indices wrap as in eager; a
position outside the input is an error, as in eager (an index check; with the checks turned
off it is not written).

Lowered only when nothing else reads the input's old value (then the write can run whenever
its values are ready) and without `accumulate` (which needs atomic adds); otherwise the op
stays an ATen call.
"""
from __future__ import annotations

import sympy
import torch

from ...ir.expr import Index, cast, out_index
from ...ir.graph import Input, Scatter
from ..registry import Unsupported, lowering
from ..values import BufferValue
from .common import broadcast_index, broadcast_shapes, is_tensor, py
from .indexing import advanced_index

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
    layout = advanced_index(x, indices, "index_put_")
    if layout is None:
        raise Unsupported("index_put_ without index tensors")
    space, positions = layout
    if broadcast_shapes(values.shape, space) != tuple(sympy.sympify(d) for d in space):
        raise Unsupported(f"index_put_ values of shape {values.shape} do not broadcast to {space}")
    idx = tuple(Index(s) for s in out_index(len(space)))
    where = positions(idx)
    body = cast(values.load(broadcast_index(values, idx, space)), x.dtype)
    name = ctx._name()
    ctx.graph.add(Scatter(name, x.dtype, tuple(sympy.sympify(d) for d in x.shape), target=x.name,
                          space=space, index=tuple(where), body=body))
    return BufferValue(name, x.dtype, tuple(sympy.sympify(d) for d in x.shape))


__all__ = ["index_put_"]
