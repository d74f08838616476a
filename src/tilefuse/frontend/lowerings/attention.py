"""PyTorch's fused attention ops, lowered through the math definition of attention.

On CUDA, `F.scaled_dot_product_attention` reaches AOTAutograd as one of the backend-specific
ops (`_scaled_dot_product_flash_attention`, `_efficient_attention`, `_cudnn_attention`,
`_fused_attention_overrideable`, and on CPU `_flash_attention_for_cpu` when no decomposition
ran). This module owns their `.default` overloads: each is lowered to the graph IR that
PyTorch's math path (`_scaled_dot_product_attention_math`, the CPU decomposition) produces,

    (q @ kᵀ)·s  [+ bias / causal mask]  → _safe_softmax (fp32)  →  @ v  → output dtype

so the fusion planner turns it into the same single "flash" kernel (the math path scales q
and k by √s each before the product; the value is the same up to fp32 rounding).
Half-precision inputs are multiplied as they are, accumulating in fp32; the softmax runs in
fp32 and its probabilities are rounded to the inputs' dtype before the product with V, as the
fused kernels do (the math path upcasts everything to fp32 instead: a P·V product off the
tensor cores); rows masked entirely give 0 (`_safe_softmax`).
Key/value with fewer heads than the query (grouped-query attention) are repeated per group.

Only the attention output (result 0) is produced, and for the CPU op
(`_scaled_dot_product_flash_attention_for_cpu`) its logsumexp (result 1, fp32, which its
backward op reads in a training step: `max + log Σ exp(s − max)` of the scaled, masked
scores, 0 for a row masked throughout, as ATen's CPU kernel gives). If the graph uses another
result (the CUDA ops' logsumexp, RNG state, ...), or dropout is on, or an argument is not
understood, the lowering declines and the op stays an ATen `Extern`.
"""
from __future__ import annotations

import math
import operator

import sympy
import torch
import torch.fx

from ...ir import dtypes as dt
from ...ir.expr import Index, binary, cast, const, unary, where
from ...ir.monoid import ANY
from ..registry import Unsupported, lowering
from ..values import TensorValue, ix, ix_floordiv, ix_mul
from .common import broadcast_load, broadcast_shapes, meta_dtype, overloads, pointwise, py, reduce, scalar, sym
from .matmul import contraction
from .nn import softmax_parts
from .views import reshape, transpose, view

aten = torch.ops.aten

#: op -> (name of its mask / bias argument or None, causal mask aligned to the bottom right)
_OPS = {
    "_scaled_dot_product_flash_attention": (None, True),  # FlashAttention-2: lower-right causal
    "_scaled_dot_product_efficient_attention": ("attn_bias", False),
    "_scaled_dot_product_cudnn_attention": ("attn_bias", False),
    "_scaled_dot_product_flash_attention_for_cpu": ("attn_mask", False),
    "_scaled_dot_product_fused_attention_overrideable": ("attn_bias", False),
}

#: ops whose logsumexp (result 1) is lowered too, when the graph reads it
_LOGSUMEXP = {"_scaled_dot_product_flash_attention_for_cpu"}

#: arguments that do not change the attention output
_IGNORED = {"compute_log_sumexp", "return_debug_mask"}


@lowering(*overloads(*(f"{name}.default" for name in _OPS)))
def fused_attention(ctx, *args, **kwargs):
    target = ctx.current_target
    name = target._schema.name.split("::")[-1]
    mask_arg, bottom_right = _OPS[name]
    a = _bind(target, args, kwargs)
    used = _results_used(ctx, name, {0, 1} if name in _LOGSUMEXP else {0})
    known = {"query", "key", "value", "dropout_p", "is_causal", "scale", mask_arg} | _IGNORED
    for arg in target._schema.arguments:
        if arg.name not in known and a[arg.name] != (arg.default_value if arg.has_default_value() else None):
            raise Unsupported(f"{name}: argument {arg.name}={a[arg.name]!r} is not supported")
    dropout = py(a["dropout_p"])
    if not isinstance(dropout, (int, float)) or dropout != 0:
        raise Unsupported(f"{name}: dropout_p={dropout!r} (only 0 is lowered; dropout needs RNG)")
    is_causal = py(a["is_causal"])
    if not isinstance(is_causal, bool):
        raise Unsupported(f"{name}: is_causal must be a constant, got {is_causal!r}")
    mask = a[mask_arg] if mask_arg is not None else None
    out, lse = attention(ctx, a["query"], a["key"], a["value"], mask, is_causal, a["scale"], bottom_right,
                         logsumexp=1 in used)
    return (out, lse) + (None,) * (len(ctx.current_meta) - 2)


def _bind(target, args, kwargs) -> dict:
    """The op's arguments by schema name, defaults filled in."""
    params = target._schema.arguments
    if len(args) > len(params):
        raise Unsupported(f"{target}: {len(args)} positional arguments")
    bound = {p.name: v for p, v in zip(params, args)}
    for k, v in kwargs.items():
        if k in bound or k not in {p.name for p in params}:
            raise Unsupported(f"{target}: unexpected argument {k!r}")
        bound[k] = v
    for p in params:
        if p.name not in bound:
            if not p.has_default_value():
                raise Unsupported(f"{target}: missing argument {p.name!r}")
            bound[p.name] = p.default_value
    return bound


# ---------------------------------------------------------------- which results the graph reads


def _fx_node(ctx):
    """The FX node being lowered (None when lowering outside the FX frontend)."""
    node = getattr(ctx, "current_node", None)
    return node if isinstance(node, torch.fx.Node) else None


def _results_used(ctx, name: str, lowered: set) -> set:
    """The results of the op the graph reads; declines if one is not in `lowered`."""
    node = _fx_node(ctx)
    if node is None:
        raise Unsupported(f"{name}: cannot tell which of its results the graph uses")
    returns = ctx.current_target._schema.returns
    used = set()
    for user in node.users:
        if user.target is not operator.getitem:
            raise Unsupported(f"{name}: its result tuple is used whole by {user.name}")
        k = user.args[1]
        if not user.users:
            continue
        if k not in lowered:
            what = returns[k].name if k < len(returns) and returns[k].name else f"result {k}"
            raise Unsupported(f"{name}: result {k} ({what}) is used by {', '.join(u.name for u in user.users)}; "
                              "only the attention output" + (" and its logsumexp" if 1 in lowered else "")
                              + " are lowered")
        used.add(k)
    return used


# ---------------------------------------------------------------- the math definition


def attention(ctx, q, k, v, mask, is_causal: bool, scale, bottom_right: bool = False, logsumexp: bool = False):
    """softmax(q @ kᵀ · scale + mask) @ v for (B, H, L, E) inputs, built as PyTorch's math path
    builds it; with `logsumexp`, (output, logsumexp of the scores over the keys: (B, H, L),
    fp32, 0 for a row masked throughout), else (output, None)."""
    if not all(isinstance(t, TensorValue) and t.rank == 4 for t in (q, k, v)):
        raise Unsupported("query, key and value must be 4-D tensors")
    if not (q.dtype.is_float and q.dtype == k.dtype == v.dtype):
        raise Unsupported(f"attention of {q.dtype}, {k.dtype}, {v.dtype}")
    if mask is not None and not isinstance(mask, TensorValue):
        raise Unsupported(f"mask of type {type(mask).__name__}")
    out_dtype = meta_dtype(ctx, 0)
    acc = dt.compute_dtype(q.dtype)  # scores, softmax and accumulation in fp32 for fp16/bf16
    b, h, n_q, e = (sym(d) for d in q.shape)
    n_k, e_v = sym(k.shape[2]), sym(v.shape[3])
    k, v = _repeat_heads(k, h), _repeat_heads(v, h)

    # The math path scales q and k by √scale each before the product (fp16 products could
    # overflow its half-precision matmul). Here the product accumulates in fp32, so the scale
    # is applied to the scores instead: the dot's operands stay exact upcasts of the inputs,
    # and a bf16/fp16 attention runs its Q·Kᵀ on tensor cores from the inputs' own bytes.
    shape = (b, h, n_q, n_k)
    product = reshape(contraction(ctx, _batched(q), _batched(transpose(k, -2, -1)), acc), shape)
    factor = _scale(scale, e)
    scores = pointwise(ctx, shape, acc, lambda i: binary("mul", product.load(i), scalar(factor, acc)))

    terms = []
    if is_causal:
        terms.append(_causal_mask(ctx, n_q, n_k, acc, bottom_right))
    if mask is not None:
        if broadcast_shapes(mask.shape, shape) != shape:
            raise Unsupported(f"mask of shape {mask.shape} does not broadcast to the scores {shape}")
        terms.append(_additive(ctx, mask, acc))
    if terms:
        base = scores
        scores = pointwise(ctx, shape, acc, lambda i: _sum(
            [base.load(i)] + [broadcast_load(t, i, shape, acc) for t in terms]))

    weights, (p, m, s) = _safe_softmax(ctx, scores, acc)
    # the fused kernels this op stands for (FlashAttention, cuDNN, memory-efficient, ATen's CPU
    # flash kernel) multiply the probabilities rounded to the inputs' dtype with V as it is:
    # a bf16/fp16 P·V runs on tensor cores, accumulating in fp32
    out = contraction(ctx, _batched(_as(ctx, weights, v.dtype)), _batched(v), acc)
    out = reshape(out, (b, h, n_q, e_v))
    if out_dtype != acc:
        src = out
        out = pointwise(ctx, src.shape, out_dtype, lambda i: cast(src.load(i), out_dtype))
    if not logsumexp:
        return out, None
    lse_dtype = meta_dtype(ctx, 1)

    def lse(i):  # ATen's CPU kernel: max + log(sum), with max 0 and sum 1 for a masked row
        j = (*i, ix(0))
        value = binary("add", m.load(j), unary("log", s.load(j)))
        value = where(binary("eq", m.load(j), const(float("-inf"), acc)), const(0.0, acc), value)
        return cast(value, lse_dtype) if lse_dtype != acc else value

    return out, pointwise(ctx, shape[:3], lse_dtype, lse)


def _batched(t: TensorValue) -> TensorValue:
    """(B, H, M, N) seen as (B·H, M, N), the batched matrix `at::matmul` multiplies."""
    b, h, m, n = (sym(d) for d in t.shape)
    return reshape(t, (b * h, m, n))


def _as(ctx, t: TensorValue, dtype) -> TensorValue:
    if t.dtype == dtype:
        return t
    return pointwise(ctx, t.shape, dtype, lambda i: cast(t.load(i), dtype))


def _sum(exprs):
    total = exprs[0]
    for x in exprs[1:]:
        total = binary("add", total, x)
    return total


def _repeat_heads(t: TensorValue, heads) -> TensorValue:
    """Key/value heads repeated to the query's head count, as `repeat_interleave` on dim 1
    does: query head h reads key/value head ⌊h·Hkv/H⌋ (= ⌊h/group⌋; stays in bounds for
    any symbolic head counts)."""
    kv = sym(t.shape[1])
    if kv == heads:
        return t
    group = heads / kv
    if group.is_number and not (group.is_Integer and group > 0):
        raise Unsupported(f"{heads} query heads do not split into groups of {kv} key/value heads")
    b, _, n, d = t.shape
    return view(t, (b, heads, n, d), lambda i: (i[0], ix_floordiv(ix_mul(i[1], kv), heads), i[2], i[3]),
                "repeat_interleave")


def _scale(scale, head_dim):
    """The scores' scale; it defaults to 1/√E like `sdp::calculate_scale`."""
    scale = py(scale)
    if scale is None:
        if isinstance(py(head_dim), int):
            return 1.0 / math.sqrt(py(head_dim))
        return 1 / sympy.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise Unsupported(f"scale must be a constant, got {scale!r}")
    return float(scale)


def _causal_mask(ctx, n_q, n_k, acc, bottom_right: bool) -> TensorValue:
    """0 where key j may be attended from query i, -inf elsewhere: j <= i (top-left, the
    math path's `ones(L, S).tril()`) or j <= i + S - L (bottom-right, FlashAttention-2)."""
    offset = sym(n_k) - sym(n_q) if bottom_right else sympy.Integer(0)

    def body(i):
        keep = binary("le", Index(i[1].expr - i[0].expr), Index(offset))
        return where(keep, const(0.0, acc), const(float("-inf"), acc))

    return pointwise(ctx, (n_q, n_k), acc, body)


def _additive(ctx, mask: TensorValue, acc) -> TensorValue:
    """A boolean keep-mask as 0 / -inf (`convert_boolean_attn_mask`); a float bias as is."""
    if mask.dtype.is_bool:
        return pointwise(ctx, mask.shape, acc, lambda i: where(
            mask.load(i), const(0.0, acc), const(float("-inf"), acc)))
    if not mask.dtype.is_float:
        raise Unsupported(f"attention mask of dtype {mask.dtype}")
    return mask


def _safe_softmax(ctx, x: TensorValue, acc):
    """softmax over the last dim, with rows that are -inf throughout giving 0
    (`aten._safe_softmax` as PyTorch decomposes it); also (plan, row max, row sum of exp)."""
    p, m, s = softmax_parts(ctx, x, -1, acc)
    shape = tuple(x.shape)

    def softmax(i):
        j = p.output_index(i)
        return binary("truediv", unary("exp", binary("sub", x.load(i), m.load(j))), s.load(j))

    probs = pointwise(ctx, shape, acc, softmax)
    is_inf = pointwise(ctx, shape, dt.bool_, lambda i: binary("eq", x.load(i), const(float("-inf"), acc)))
    finite = pointwise(ctx, shape, dt.bool_, lambda i: unary("logical_not", is_inf.load(i)))
    row_any = reduce(ctx, p.out_shape, p.ranges, ANY, lambda i, r: finite.load(p.input_index(i, r)), dt.bool_)
    masked_row = pointwise(ctx, p.out_shape, dt.bool_, lambda i: unary("logical_not", row_any.load(i)))
    zeros = pointwise(ctx, shape, acc, lambda i: const(0.0, acc))
    return pointwise(ctx, shape, acc, lambda i: where(
        masked_row.load(p.output_index(i)), zeros.load(i), probs.load(i))), (p, m, s)


__all__ = ["attention", "fused_attention"]
