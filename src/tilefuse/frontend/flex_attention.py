"""FlexAttention programs compiled as the attention they describe.

`flex_attention(q, k, v, score_mod=..., block_mask=...)` reaches a torch.compile backend as one
higher-order op that holds the user's score function and the block mask's mask function as
graphs. Run as an extern it is eager's implementation, which materialises every score. Instead,
before AOTAutograd traces Dynamo's graph, each such op is replaced by what it computes (eager's
own definition, `torch._higher_order_ops.flex_attention.math_attention`):

    s = (q @ kᵀ) · scale                      fp32 (fp64 for fp64 inputs), from the inputs as given
    s = score_mod(s, b, h, i, j)              the user's graph, called once on index tensors
                                              shaped to broadcast over (batch, head, query, key)
    s = where(mask_mod(b, h, i, j), s, −inf)  the block mask's mask function
    o = safe_softmax(s) @ v                   a row masked throughout gives 0, not NaN

and the fusion planner derives one flash kernel from that chain as from any other spelling: a
mask function of indices is an index formula whose dead tiles are skipped, one that reads
tensors (document ids, lengths) is a data mask with a run-time block summary. The block mask's
tensors themselves are not read: eager applies `mask_mod` to every score, and so does this.

The op's other results are produced where the graph reads them: the log-sum-exp and the row
maximum of the masked scores, in base 2 as the op returns them (the public function converts),
−inf for a row masked throughout. Grouped-query attention repeats key and value per group;
key and value with batch 1 broadcast over the query's batch. Under autocast q, k and v are
first converted to autocast's dtype where this PyTorch's op has an autocast rule that does so,
and the rest runs with autocast off.

In a training graph (with `attention_backward`) that reads the output alone, the chain is the
attention-chain rewrite's autograd function (`attention_chains._AttentionChain`; a log-sum-exp
the graph reads has a gradient of its own, and that graph is differentiated as written): its backward recomputes the scores
tile by tile from the saved row statistics, and the score function's derivative comes from
autograd through the user's graph, so a learnable bias captured by `score_mod` gets its
gradient. Rows masked throughout keep the op's semantics there too: probabilities 0 and no
gradient.

A score function whose result does not broadcast to the scores' shape when called on whole
index tensors (one that returns a vector per score, say) is not rewritten: the op stays an
extern, and `TILEFUSE_LOGS=graph` says why.
"""
from __future__ import annotations

import functools
import math
import operator

import torch
import torch.fx

from .. import logs

_LN2 = math.log(2.0)


def _flex_op():
    return getattr(torch.ops.higher_order, "flex_attention", None)


def decompose(gm: torch.fx.GraphModule, training: bool, chains: bool) -> int:
    """Replace every `flex_attention` op of Dynamo's graph `gm` by its definition, in place;
    `chains`: in a training graph, as one autograd function whose backward recomputes the
    scores (`attention_chains`). Returns how many were replaced."""
    op = _flex_op()
    if op is None:
        return 0
    done = 0
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op]:
        why = _unsupported(gm, node)
        if why is not None:
            logs.log("graph", "%s: flex_attention left as an extern: %s", node.name, why)
            continue
        read = [u.args[1] for u in node.users if u.target is operator.getitem and isinstance(u.args[1], int)]
        if len(read) != len(node.users):
            logs.log("graph", "%s: flex_attention left as an extern: its result is used whole", node.name)
            continue
        outputs = max(read, default=0) + 1
        trace = node.meta.get("stack_trace")
        node.target = _flex_math
        node.kwargs = {"outputs": outputs, "chain": bool(training and chains), "stack_trace": trace}
        logs.log("graph", "%s: flex_attention computed as its definition (%s)", node.name,
                 "one autograd function, scores recomputed in the backward" if training and chains else
                 "scores, score_mod, mask_mod, safe softmax, product")
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _unsupported(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str | None:
    """Why `node` (a flex_attention op) cannot be rewritten, or None."""
    if len(node.args) < 7:
        return f"an unknown signature ({len(node.args)} arguments)"
    q, k, v, score_mod, block_mask = node.args[:5]
    mask_mod = block_mask[-1] if isinstance(block_mask, tuple) and block_mask else None
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if not (isinstance(fn, torch.fx.Node) and fn.op == "get_attr"):
            return f"its {name} is not a graph of the module"
    shapes = [getattr(n.meta.get("example_value"), "shape", None) if isinstance(n, torch.fx.Node) else None
              for n in (q, k, v)]
    if any(s is None or len(s) != 4 for s in shapes):
        return "inputs that are not 4-D tensors"
    scale = node.args[5]
    if not isinstance(scale, (int, float, torch.fx.Node)) or \
            (isinstance(scale, torch.fx.Node) and isinstance(scale.meta.get("example_value"), torch.Tensor)):
        return f"a scale that is not a number ({type(scale).__name__})"
    score_fn, mask_fn = getattr(gm, score_mod.target), getattr(gm, mask_mod.target)
    for name, fn in (("score_mod", score_fn), ("mask_mod", mask_fn)):
        op = _not_elementwise(fn)
        if op is not None:
            return f"its {name} calls {op}, which is not computed score by score on whole index tensors"
    try:
        _check_broadcast(score_fn, mask_fn, node)
    except _NotBroadcast as err:
        return str(err)
    return None


#: what a score or mask function may call: ops that compute each score from that score and
#: its indices alone, so calling the function once on index tensors that broadcast gives what
#: calling it per score (eager's vmap) gives — no reductions, reshapes or slices
_ELEMENTWISE = frozenset("""
    add sub mul truediv floordiv mod pow neg pos abs lt le gt ge eq ne and_ or_ xor invert
    __add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __floordiv__
    __mod__ __pow__ __neg__ __abs__ __lt__ __le__ __gt__ __ge__ __eq__ __ne__ __and__ __or__
    __xor__ __invert__
    where tanh exp exp2 expm1 log log2 log10 log1p sigmoid sqrt rsqrt sign clamp clamp_min
    clamp_max clip minimum maximum fmin fmax erf sin cos floor ceil round trunc frac remainder
    fmod div true_divide multiply subtract square reciprocal relu logical_and logical_or
    logical_not logical_xor bitwise_and bitwise_or bitwise_xor bitwise_not isnan isinf
    nan_to_num full_like zeros_like ones_like scalar_tensor masked_fill
    to float double half bfloat16 int long bool type_as
    """.split())
#: ones that make a tensor of the size they are given: allowed for a 0-d result only
_SIZED = frozenset({"new_ones", "new_zeros", "new_full", "new_tensor"})


def _not_elementwise(fn: torch.fx.GraphModule) -> str | None:
    """The first call in `fn` that is not score by score, or None."""
    for n in fn.graph.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        if name == "getitem" or name == "__getitem__":
            index = n.args[1] if len(n.args) > 1 else None
            items = index if isinstance(index, (tuple, list)) else (index,)
            if all(isinstance(i, (torch.fx.Node, int)) for i in items):
                continue
            return "an index with slices"
        if name == "masked_fill":
            value = n.kwargs.get("value", n.args[2] if len(n.args) > 2 else None)
            if isinstance(value, torch.fx.Node):
                return "masked_fill with a tensor value"
            continue
        if name in _SIZED:
            size = n.kwargs.get("size", n.args[1] if len(n.args) > 1 else None)
            if isinstance(size, (tuple, list)) and len(size) == 0:
                continue
            return f"{name} of a size"
        if name not in _ELEMENTWISE:
            return name
    return None


class _NotBroadcast(Exception):
    pass


def _check_broadcast(score_fn, mask_fn, node: torch.fx.Node) -> None:
    """Call the score and mask functions on meta tensors of the index shapes: each result must
    broadcast to the scores' shape (a function written per score does, one that returns more
    per score does not)."""
    q, k = (node.args[i].meta["example_value"] for i in (0, 1))
    if any(not isinstance(d, int) for d in (*q.shape, *k.shape)):
        return  # (symbolic sizes: checked by the trace itself)
    score_bufs, mask_bufs = (_meta_values(node.args[i]) if len(node.args) > i else () for i in (7, 8))
    if any(b is None for b in (*score_bufs, *mask_bufs)):
        return  # (a captured value without an example: checked by the trace itself)
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    idx = _indices(shape, torch.device("meta"))
    scores = torch.empty(shape, dtype=torch.float32, device="meta")
    try:
        with torch.no_grad():
            results = (("score_mod", score_fn(scores, *idx, *score_bufs)), ("mask_mod", mask_fn(*idx, *mask_bufs)))
    except Exception as err:  # noqa: BLE001 - a function that fails on whole index tensors
        raise _NotBroadcast(f"its score or mask function fails on whole index tensors ({type(err).__name__}: "
                            f"{err})") from err
    for name, r in results:
        if not isinstance(r, torch.Tensor) or not _broadcasts(r.shape, shape):
            got = tuple(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__
            raise _NotBroadcast(f"its {name} gives {got} on index tensors, not one value per score {tuple(shape)}")


def _broadcasts(shape, to) -> bool:
    try:
        return tuple(torch.broadcast_shapes(shape, to)) == tuple(to)
    except RuntimeError:
        return False


def _meta_values(arg) -> tuple:
    values = []
    for a in arg if isinstance(arg, (tuple, list)) else ():
        v = a.meta.get("example_value") if isinstance(a, torch.fx.Node) else a
        if v is None and isinstance(a, torch.fx.Node):
            values.append(None)
            continue
        values.append(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
                      if isinstance(v, torch.Tensor) else v)
    return tuple(values)


def _indices(shape, device) -> tuple:
    """Batch, head, query and key indices as int64 tensors that broadcast over `shape`."""
    out = []
    for dim, size in enumerate(shape):
        view = [1, 1, 1, 1]
        view[dim] = size
        out.append(torch.arange(size, device=device).view(view))
    return tuple(out)


def _repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, H, S, D) → (B, H·groups, S, D), each head repeated `groups` times in a row
    (`repeat_interleave` over dim 1)."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def _flex_math(query, key, value, score_mod, block_mask, scale, kernel_options, score_mod_other_buffers=(),
               mask_mod_other_buffers=(), *, outputs: int = 2, chain: bool = False, stack_trace=None):
    """The flex_attention op's results (`outputs` of them: output, log-sum-exp, row max)."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        if _autocast_casts_inputs():
            dtype = torch.get_autocast_dtype(device)
            query, key, value = (_autocast(t, device, dtype) for t in (query, key, value))
        with torch.autocast(device, enabled=False):
            return _flex_math(query, key, value, score_mod, block_mask, scale, kernel_options,
                              score_mod_other_buffers, mask_mod_other_buffers, outputs=outputs, chain=chain,
                              stack_trace=stack_trace)
    groups = query.size(1) // key.size(1)
    key, value = _repeat_heads(key, groups), _repeat_heads(value, groups)
    key = key.expand(query.size(0), *key.shape[1:])
    value = value.expand(query.size(0), *value.shape[1:])
    extras = (*score_mod_other_buffers, *mask_mod_other_buffers)
    scores = functools.partial(_masked_scores, score_mod, block_mask[-1], scale,
                               len(score_mod_other_buffers))
    kt = key.transpose(-2, -1)
    if chain and outputs == 1:  # (a log-sum-exp read too carries its own gradient: differentiated as written)
        from .attention_chains import ChainFunctions, _call_chain

        fns = ChainFunctions(scores, functools.partial(_weighted_values, query.dtype), _working(query.dtype),
                             stack_trace, safe_rows=True)
        return (_call_chain(fns, query, kt, value, *extras),)
    s = scores(query, kt, *extras)
    p = torch.ops.aten._safe_softmax(s, -1)
    out = _weighted_values(query.dtype, p, value, None)
    return (out, *_row_statistics(s)[: outputs - 1])


def _autocast(t: torch.Tensor, device: str, dtype: torch.dtype) -> torch.Tensor:
    """`t` as autocast's rule converts an input: a floating tensor on autocast's device, fp64
    excepted, to autocast's dtype; anything else as it is."""
    if t.is_floating_point() and t.device.type == device and t.dtype != torch.float64:
        return t.to(dtype)
    return t


@functools.lru_cache(maxsize=None)
def _autocast_casts_inputs() -> bool:
    """Whether this PyTorch's flex_attention op has an autocast rule (it converts q, k and v
    to autocast's dtype); without one, eager computes on the inputs as given."""
    import importlib

    module = importlib.import_module("torch._higher_order_ops.flex_attention")  # (the package's
    return hasattr(module, "_flex_attention_autocast_impl")                      # name is the op)


def _working(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _masked_scores(score_mod, mask_mod, scale, n_score_buffers: int, q, kt, *extras):
    """The scores after `score_mod` and the mask, in the working precision."""
    working = _working(q.dtype)
    if q.dtype in (torch.float16, torch.bfloat16) and kt.dtype == q.dtype:
        s = _ScoreProduct.apply(q, kt, working) * scale
    else:
        s = (q.to(working) @ kt.to(working)) * scale
    shape = s.shape
    b, h, i, j = _indices(shape, s.device)
    keep = mask_mod(b, h, i, j, *extras[n_score_buffers:])
    # masked scores reach score_mod detached: their gradient is 0, not 0 times a derivative
    # that may not be finite there (log1p(i - j) above the diagonal), as eager's backward zeroes
    # the scores' gradient under the mask after score_mod's
    s = s.to(working)
    modded = score_mod(torch.where(keep, s, s.detach()), b, h, i, j, *extras[:n_score_buffers])
    return torch.where(keep, modded, torch.full((), float("-inf"), dtype=working, device=s.device))


class _ScoreProduct(torch.autograd.Function):
    """q @ kᵀ of half-precision inputs in the working precision (exact products, fp32 sums),
    whose backward rounds the incoming score gradient to the inputs' dtype before its two
    products, as FlexAttention's compiled backward and FlashAttention's kernels round dS:
    without it dQ and dKᵀ would be fp32 products, off the tensor cores (what eager's
    definition computes, at several times the cost)."""

    @staticmethod
    def forward(ctx, q, kt, working):
        ctx.save_for_backward(q, kt)
        return q.to(working) @ kt.to(working)

    @staticmethod
    def backward(ctx, grad):
        q, kt = ctx.saved_tensors
        g = grad.to(q.dtype)
        dq = g @ kt.transpose(-2, -1) if ctx.needs_input_grad[0] else None
        dkt = q.transpose(-2, -1) @ g if ctx.needs_input_grad[1] else None
        return dq, dkt, None


def _weighted_values(dtype: torch.dtype, p, v, keep):
    """The probabilities rounded to the inputs' dtype, times V."""
    return p.to(dtype) @ v.to(dtype)


def _row_statistics(s: torch.Tensor) -> tuple:
    """(log-sum-exp, max) of each row of the masked scores in base 2, −inf for a row masked
    throughout."""
    return s.logsumexp(-1) / _LN2, s.amax(-1) / _LN2


__all__ = ["decompose"]
