"""Scatters into a graph input written in place.

With `keep_inference_input_mutations`, AOTAutograd hands an in-place update of an input
(`cache.index_copy_(2, pos, k)`, `x[idx] = v`) over as a functional scatter into a fresh copy
of the whole input followed by `copy_` of that copy back into the input: two full copies of a
KV cache per decoding step. When nothing else reads the input's old value, the pair is the
in-place scatter itself (`index_put_`), which writes only the updated rows — as eager does and
as Inductor's re-inplacing pass does; later readers of the new value read the written input.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

#: functional scatter -> its in-place form (same arguments)
_INPLACE = {aten.index_put.default: aten.index_put_.default}


def reinplace_input_scatters(gm: torch.fx.GraphModule) -> int:
    """Rewrite `copy_(x, scatter(x, ...))` into `scatter_(x, ...)` where `x` is a graph input
    whose old value nothing else reads (readers of the new value read the in-place result);
    returns the number of rewrites."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.copy_.default:
            continue
        dst, src = node.args[0], node.args[1]
        if not (isinstance(src, torch.fx.Node) and src.target in _INPLACE and dst.op == "placeholder"):
            continue
        if src.args[0] is not dst or set(dst.users) != {src, node}:
            continue
        # the write takes the scatter's place: whatever reads the new value (a decoding step's
        # attention over the updated cache) runs after it, as before
        with gm.graph.inserting_before(src):
            inplace = gm.graph.call_function(_INPLACE[src.target], src.args, src.kwargs)
        inplace.meta = dict(src.meta)
        node.replace_all_uses_with(inplace)
        gm.graph.erase_node(node)
        src.replace_all_uses_with(inplace)
        gm.graph.erase_node(src)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def mutates_input(target) -> bool:
    """Whether an ATen op writes into one of its arguments (`copy_`, `index_put_`, ...)."""
    schema = getattr(target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


__all__ = ["reinplace_input_scatters", "mutates_input"]
