"""Plain matrix products as strided views, so that a vendor library can run them.

A contraction plan with nothing fused into it (one stored `Reduce(sum)` of two loads, no
prologue beyond float conversions, no epilogue) is `C[b.., m, n] = A[b.., m, k] · B[b.., k, n]`
where A and B are *views* of their buffers: every index of a buffer dim is affine in the
iteration symbols. This module finds those affine maps; the runtime turns them into
`as_strided` views with the buffers' actual strides and calls ATen's matmul (cuBLAS, MKL).
The tuner measures that against the generated kernel (`impl` knob of the contraction space).

The library must multiply the values the graph defines: a conversion that rounds
(`x.bfloat16()` inlined into the operand, autocast's casts) is kept and applied to the view
before the call; an exact one (an upcast) is dropped, so the common case copies nothing.

A bias vector added to every row of the product, the whole epilogue (`addmm`, `F.linear` with
a bias: the product accumulated in fp32, the bias added, one rounding to the operands' dtype),
is folded into the call: `torch.addmm(bias, a, b)`, which cuBLAS and MKL run with the bias in
their own epilogue. A bias that autocast rounds first (an fp32 parameter `.to(bfloat16)`, inlined,
or a conversion node of its own) is passed with that conversion, applied before the call. So is a constant the product is multiplied by before its rounding (T5's
tied head scales its input, and `passes.scales` moves the scale past the sum): the library's
alpha, `torch.addmm(out, a, b, beta=0, alpha=c)`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import sympy

from ..fusion.plan import PlanKind
from ..ir import dtypes as dt
from ..ir.expr import Binary, Cast, Const, Index, Load, out_index, red_index, subs_index, transform
from ..ir.symbolic import contiguous_strides


@dataclass(frozen=True)
class OperandView:
    buffer: str
    #: per buffer dim: ({iteration symbol name: coefficient}, constant), sympy over size symbols
    dims: tuple
    #: when the dims are not affine one by one (a batch flattened into rows: `floor`/`mod`
    #: indices, as `F.linear` reads a 3-D input), the element offset into the buffer's storage
    #: is: ({iteration symbol name: element stride}, element offset), from the buffer's
    #: compile-time strides (`strides`), which the runtime checks
    flat: tuple | None = None
    strides: tuple | None = None
    #: dtypes the view is converted to, in order, before the call: the graph's rounding
    #: conversions, then the dtype the product is computed in (empty: the buffer as it is)
    casts: tuple = ()


@dataclass(frozen=True)
class MatmulViews:
    """C = A @ B over iteration symbols (batch.., m, n) and k."""

    a: OperandView  # over (batch.., m, k)
    b: OperandView  # over (batch.., k, n)
    out: str
    order: tuple  # the output node's dims in (batch.., m, n) order
    batch: tuple  # names of the batch symbols, in order
    m: str
    n: str
    k: str
    sizes: tuple  # sympy extents of (batch.., m, n, k)
    #: the product's own shape when `out` is a reshape of it (F.linear's 3-D result): the
    #: runtime views the contiguous `out` buffer with this shape first
    out_shape: tuple | None = None
    #: a vector added to every row (over (n,)): `out = addmm(bias, A, B)`, no batch dims
    bias: OperandView | None = None
    #: a constant the product is multiplied by before its one rounding (`(x · c) @ W` with the
    #: scale moved past the sum, `passes.scales`): cuBLAS's and MKL's alpha; no batch dims
    alpha: float = 1.0


def _plain_load(e):
    """(load, [rounding conversions, innermost first], dtype of the converted values) of a
    factor that is a load under float conversions, else None."""
    chain = []
    while isinstance(e, Cast) and e.dtype.is_float and e.x.dtype.is_float:
        chain.append(e.dtype)
        e = e.x
    if not (isinstance(e, Load) and e.dtype.is_float and all(isinstance(c, Index) for c in e.index)):
        return None
    kept, held = [], e.dtype
    for d in reversed(chain):
        if not dt.float_widens(held, d):  # rounds: the library must see the rounded values
            kept.append(d)
            held = d
    return e, kept, held


def _compute_dtype(fa, fb, node, product):
    """The dtype the library multiplies in: the output's own when both operands hold it and
    the graph accumulates as the library does (eager's call), else the graph's accumulation
    dtype — when widening to it is exact and copies no buffer that needs no conversion
    anyway (a rounded operand is a copy already; a plain bf16 buffer stays for the generated
    kernel); None otherwise."""
    (_, kept_a, held_a), (_, kept_b, held_b) = fa, fb
    if held_a == held_b == node.dtype and dt.compute_dtype(node.dtype) == product:
        return node.dtype
    if all(dt.float_widens(held, product) and (held == product or kept)
           for kept, held in ((kept_a, held_a), (kept_b, held_b))):
        return product
    return None


def _affine(expr, symbols: dict):
    """({name: coefficient}, constant) when `expr` is affine in `symbols`, else None."""
    e = sympy.expand(sympy.sympify(expr))
    coefs, rest = {}, e
    for name, s in symbols.items():
        c = e.coeff(s)
        if c.free_symbols & set(symbols.values()):
            return None
        if c != 0:
            coefs[name] = c
            rest = rest - c * s
    rest = sympy.expand(rest)
    if rest.free_symbols & set(symbols.values()) or rest.has(sympy.floor, sympy.Mod, sympy.ceiling):
        return None
    if any(c.has(sympy.floor, sympy.Mod, sympy.ceiling) for c in coefs.values()):
        return None
    return coefs, rest


def _forwards(coefs: dict) -> bool:
    """Whether every coefficient is provably not negative: a dim read backwards (`flip`) has no
    strided view (`as_strided` takes no negative stride), so such an operand stays generated."""
    return all(sympy.sympify(c).is_nonnegative for c in coefs.values())


def _operand(load: Load, symbols: dict, allowed: set, graph=None, ranges=None):
    dims = []
    for comp in load.index:
        aff = _affine(comp.expr, symbols)
        if aff is None or set(aff[0]) - allowed:
            return _flat_operand(load, symbols, allowed, graph, ranges)
        if not _forwards(aff[0]):
            return None
        dims.append((aff[0], aff[1]))
    return OperandView(load.buffer, tuple(dims))


def _compile_time_strides(graph, name):
    from ..ir.graph import Extern, ExternResult, Input
    from ..ir.storage import promised_strides

    node = graph.nodes.get(name)
    if isinstance(node, Input):
        return node.strides  # None: known only at run time
    if isinstance(node, (Extern, ExternResult)):
        return promised_strides(node)
    if node is None or not hasattr(node, "shape"):
        return None
    return graph.output_strides.get(name) or contiguous_strides(node.shape)


def _flat_operand(load: Load, symbols: dict, allowed: set, graph, ranges):
    """The load as one affine element offset into its buffer's storage, or None."""
    from ..ir.symbolic import simplify_index

    if graph is None:
        return None
    strides = _compile_time_strides(graph, load.buffer)
    if strides is None:
        return None
    offset = sum((comp.expr * st for comp, st in zip(load.index, strides)), sympy.Integer(0))
    aff = _affine(simplify_index(sympy.expand(offset), ranges), symbols)
    if aff is None or set(aff[0]) - allowed or not _forwards(aff[0]):
        return None
    return OperandView(load.buffer, (), flat=aff, strides=tuple(strides))


def _reshape_of(graph, node, stage) -> bool:
    """`stage` stores `node` reshaped (same elements in the same row-major order) into a
    contiguous buffer."""
    body = stage.body
    if not (stage.store and isinstance(body, Load) and body.buffer == node.name and graph[stage.node].dtype == node.dtype):
        return False
    return _reshaped_read(graph, node, graph[stage.node], body)


def _reshaped_read(graph, node, out, load: Load) -> bool:
    """`out`, a row-major buffer, holds at each position the element of `node` that `load`
    (in `out`'s index symbols) reads, in the same row-major order: a reshape of it."""
    from ..ir.symbolic import simplify_index

    from ..ir.storage import is_row_padded

    strides = graph.output_strides.get(out.name)
    if strides is not None and tuple(strides) != tuple(contiguous_strides(out.shape)):
        # rows padded for the library (`fusion.row_padding`) keep the reshape a view, when
        # it only merges or splits the dims before the rows
        if not (is_row_padded(out.shape, strides) and sympy.sympify(out.shape[-1]) == sympy.sympify(node.shape[-1])):
            return False
    if load.buffer != node.name or not all(isinstance(c, Index) for c in load.index):
        return False
    outs = out_index(out.rank)
    ranges = {s: out.shape[d] for d, s in enumerate(outs)}
    read = sum((c.expr * st for c, st in zip(load.index, contiguous_strides(node.shape))), sympy.Integer(0))
    written = sum((s * st for s, st in zip(outs, contiguous_strides(out.shape))), sympy.Integer(0))
    return sympy.expand(simplify_index(sympy.expand(read), ranges) - written) == 0


def _library_epilogue(graph, node, plan, stage, ops: tuple):
    """The body of `stage` without its final rounding when it is one of `ops` applied to the
    product (node) as a library runs it: stored, no batch dims, operands that hold the output's
    dtype unrounded, accumulated in that dtype's compute dtype (eager's call); else None."""
    c = plan.contraction
    out = graph[stage.node]
    body = stage.body
    if not stage.store or c.batch_dims:
        return None
    if isinstance(body, Cast):
        if body.dtype != out.dtype or not dt.float_widens(out.dtype, body.x.dtype):
            return None
        body = body.x
    if not (isinstance(body, Binary) and body.op in ops and body.dtype == node.dtype):
        return None
    fa, fb = _plain_load(c.a), _plain_load(c.b)
    if fa is None or fb is None or fa[1] or fb[1] or not (fa[2] == fb[2] == out.dtype):
        return None  # (operands that round first, or of another dtype: not eager's call)
    if node.dtype != dt.compute_dtype(out.dtype):
        return None
    return body


def _bias_add(graph, node, plan, stage) -> MatmulViews | None:
    """`stage` stores `rounded(product + bias[n])` (or a reshape of it) into a row-major
    buffer, where the product accumulates in the compute dtype of operands that hold the
    output's dtype and the bias holds it too: eager's `addmm`, as one library call."""
    c = plan.contraction
    out = graph[stage.node]
    body = _library_epilogue(graph, node, plan, stage, ("add",))
    if body is None:
        return None
    for product, bias in ((body.a, body.b), (body.b, body.a)):
        if isinstance(product, Load) and product.buffer == node.name:
            break
    else:
        return None
    fbias = _plain_load(through_conversions(graph, bias))
    if fbias is None or fbias[1] not in ([], [out.dtype]) or fbias[2] != out.dtype \
            or not _reshaped_read(graph, node, out, product):
        return None  # (a bias rounded to the output's dtype is addmm's: autocast's bias)
    n_index = product.index[c.n_dim].expr
    if not isinstance(n_index, sympy.Symbol):
        return None
    views = _views(graph, plan, node, None, compute=out.dtype)
    if views is None:
        return None
    iteration = set(out_index(out.rank)) | set(red_index(1))
    dims = []
    for comp in fbias[0].index:
        if not isinstance(comp, Index) or (comp.expr.free_symbols & iteration) - {n_index}:
            return None  # (a bias per row, or per anything but the column, is not addmm's)
        aff = _affine(comp.expr, {views.n: n_index})
        if aff is None or not _forwards(aff[0]):
            return None
        dims.append(aff)
    reshaped = out.shape != node.shape
    return replace(views, out=out.name, out_shape=tuple(node.shape) if reshaped else None,
                   bias=OperandView(fbias[0].buffer, tuple(dims), casts=tuple(fbias[1])))


def through_conversions(graph, e):
    """`e` with each load of a node that only converts a graph input (`x.to(bfloat16)` of a
    parameter, autocast's cast of a bias) replaced by that conversion of the input: what a
    library call can read where the converted node has no buffer of its own (an input always
    has one; another node may have been inlined)."""
    from ..ir.graph import Input, Pointwise

    def fn(x):
        if not isinstance(x, Load) or not all(isinstance(c, Index) for c in x.index):
            return None
        node = graph.nodes.get(x.buffer)
        body = node.body if isinstance(node, Pointwise) else None
        if not (isinstance(body, Cast) and isinstance(body.x, Load) and body.dtype.is_float
                and body.x.dtype.is_float and len(x.index) == node.rank
                and isinstance(graph.nodes.get(body.x.buffer), Input)):
            return None
        own = out_index(node.rank)
        return subs_index(body, {s: c.expr for s, c in zip(own, x.index)})

    return transform(e, fn)


def _scaled(graph, node, plan, stage) -> MatmulViews | None:
    """`stage` stores `rounded(product · c)` or `rounded(product / c)` (or a reshape of it) for a
    finite, non-zero float constant c (`_library_epilogue`): one library call with alpha = c."""
    out = graph[stage.node]
    body = _library_epilogue(graph, node, plan, stage, ("mul", "truediv"))
    if body is None:
        return None
    pairs = ((body.a, body.b), (body.b, body.a)) if body.op == "mul" else ((body.a, body.b),)
    for product, scale in pairs:
        if isinstance(product, Load) and product.buffer == node.name and isinstance(scale, Const):
            break
    else:
        return None
    try:
        alpha = float(scale.value)
    except (TypeError, ValueError):
        return None
    if alpha != alpha or alpha in (0.0, float("inf"), float("-inf")):
        return None
    if body.op == "truediv":
        alpha = 1.0 / alpha
    if not _reshaped_read(graph, node, out, product):
        return None
    views = _views(graph, plan, node, None, compute=out.dtype)
    if views is None:
        return None
    reshaped = out.shape != node.shape
    return replace(views, out=out.name, out_shape=tuple(node.shape) if reshaped else None, alpha=alpha)


def matmul_views(graph, plan) -> MatmulViews | None:
    """The plan as views for a library matmul, or None when anything is fused into it (a
    reshape of the result is not: it is a view of the output buffer)."""
    if plan.kind != PlanKind.CONTRACTION or not plan.stages:
        return None
    node = graph[plan.stages[0].node]
    reshaped = None
    if len(plan.stages) == 2 and not plan.stages[0].store and _reshape_of(graph, node, plan.stages[1]):
        reshaped = plan.stages[1].node
    elif len(plan.stages) == 2 and not plan.stages[0].store:
        return _bias_add(graph, node, plan, plan.stages[1]) or _scaled(graph, node, plan, plan.stages[1])
    elif len(plan.stages) != 1 or not plan.stages[0].store:
        return None
    return _views(graph, plan, node, reshaped)


def product_views(graph, plan) -> MatmulViews | None:
    """The *product part* of a contraction plan (its first stage, whatever epilogue follows) as
    views for a library matmul writing the product node's own buffer, or None when a prologue
    is fused into the operands."""
    if plan.kind != PlanKind.CONTRACTION or not plan.stages:
        return None
    return _views(graph, plan, graph[plan.stages[0].node], None)


def biased_product_views(graph, plan, users: dict):
    """(views, node) where `node` is a graph node holding `rounded(product + bias[n])` at the
    product's own positions (`addmm`'s decomposition leaves one behind the inlined epilogue)
    and the views compute it as one `addmm` into that node's buffer; None when there is none.
    `users`: the graph's readers of each buffer (`Graph.users()`)."""
    from ..ir.graph import Input, Pointwise
    from .plan import Stage, StageKind

    if plan.kind != PlanKind.CONTRACTION or not plan.stages:
        return None
    node = graph[plan.stages[0].node]
    for name in users.get(node.name, ()):
        summed = graph.nodes.get(name)
        if not isinstance(summed, Pointwise) or tuple(summed.shape) != tuple(node.shape):
            continue
        views = _bias_add(graph, node, plan, Stage(summed.name, StageKind.ROW, summed.body))
        # (the sum's own body reads the bias as the graph holds it: only an input is sure to have
        # a buffer at the call, where another node may have been inlined into its readers)
        if views is not None and views.out_shape is None and isinstance(graph.nodes.get(views.bias.buffer), Input):
            return views, summed
    return None


def _views(graph, plan, node, reshaped, compute=None) -> MatmulViews | None:
    c = plan.contraction
    fa, fb = _plain_load(c.a), _plain_load(c.b)
    if fa is None or fb is None or not node.dtype.is_float or c.a.dtype != c.b.dtype:
        return None
    (a, casts_a, held_a), (b, casts_b, held_b) = fa, fb
    compute = compute or _compute_dtype(fa, fb, node, c.a.dtype)
    if compute is None:
        return None
    outs = out_index(node.rank)
    (r0,) = red_index(1)
    batch = tuple(str(outs[d]) for d in c.batch_dims)
    m, n, k = str(outs[c.m_dim]), str(outs[c.n_dim]), str(r0)
    symbols = {str(s): s for s in outs} | {k: r0}
    ranges = {s: node.shape[d] for d, s in enumerate(outs)} | {r0: node.ranges[0]}
    va = _operand(a, symbols, set(batch) | {m, k}, graph, ranges)
    vb = _operand(b, symbols, set(batch) | {k, n}, graph, ranges)
    if va is None or vb is None:
        return None
    va = replace(va, casts=_conversions(casts_a, held_a, compute))
    vb = replace(vb, casts=_conversions(casts_b, held_b, compute))
    order = tuple(c.batch_dims) + (c.m_dim, c.n_dim)
    sizes = tuple(node.shape[d] for d in c.batch_dims) + (node.shape[c.m_dim], node.shape[c.n_dim], node.ranges[0])
    if reshaped is not None:
        return MatmulViews(va, vb, reshaped, order, batch, m, n, k, sizes, out_shape=tuple(node.shape))
    return MatmulViews(va, vb, node.name, order, batch, m, n, k, sizes)


def _conversions(kept: list, held, compute) -> tuple:
    return tuple(kept) + ((compute,) if held != compute else ())


def describe(views: MatmulViews) -> str:
    def operand(v: OperandView) -> str:
        return f"view of {v.buffer}" + "".join(f".to({d})" for d in v.casts)

    if views.bias is not None:
        return f"{views.out} = torch.addmm({operand(views.bias)}, {operand(views.a)}, {operand(views.b)})"
    if views.alpha != 1.0:
        return f"{views.out} = torch.addmm({views.out}, {operand(views.a)}, {operand(views.b)}, beta=0, alpha={views.alpha!r})"
    return f"{views.out} = torch.matmul({operand(views.a)}, {operand(views.b)})"


__all__ = ["MatmulViews", "OperandView", "matmul_views", "product_views", "biased_product_views", "describe"]
