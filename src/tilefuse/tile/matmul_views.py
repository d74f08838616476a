"""Plain matrix products as strided views, so that a vendor library can run them.

A contraction plan with nothing fused into it (one stored `Reduce(sum)` of two loads, no
prologue beyond a float upcast, no epilogue) is `C[b.., m, n] = A[b.., m, k] · B[b.., k, n]`
where A and B are *views* of their buffers: every index of a buffer dim is affine in the
iteration symbols. This module finds those affine maps; the runtime turns them into
`as_strided` views with the buffers' actual strides and calls ATen's matmul (cuBLAS, MKL).
The tuner measures that against the generated kernel (`impl` knob of the contraction space).
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from ..ir.expr import Cast, Index, Load, out_index, red_index


@dataclass(frozen=True)
class OperandView:
    buffer: str
    #: per buffer dim: ({iteration symbol name: coefficient}, constant), sympy over size symbols
    dims: tuple


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


def _plain_load(e):
    while isinstance(e, Cast) and e.dtype.is_float and e.x.dtype.is_float:
        e = e.x
    return e if isinstance(e, Load) and all(isinstance(c, Index) for c in e.index) else None


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


def _operand(load: Load, symbols: dict, allowed: set):
    dims = []
    for comp in load.index:
        aff = _affine(comp.expr, symbols)
        if aff is None or set(aff[0]) - allowed:
            return None
        dims.append((aff[0], aff[1]))
    return OperandView(load.buffer, tuple(dims))


def matmul_views(graph, plan) -> MatmulViews | None:
    """The plan as views for a library matmul, or None when anything is fused into it."""
    if plan.kind != "contraction" or len(plan.stages) != 1 or not plan.stages[0].store:
        return None
    c = plan.contraction
    node = graph[plan.stages[0].node]
    a, b = _plain_load(c.a), _plain_load(c.b)
    if a is None or b is None or not (a.dtype == b.dtype == node.dtype) or not node.dtype.is_float:
        return None
    outs = out_index(node.rank)
    (r0,) = red_index(1)
    batch = tuple(str(outs[d]) for d in c.batch_dims)
    m, n, k = str(outs[c.m_dim]), str(outs[c.n_dim]), str(r0)
    symbols = {str(s): s for s in outs} | {k: r0}
    va = _operand(a, symbols, set(batch) | {m, k})
    vb = _operand(b, symbols, set(batch) | {k, n})
    if va is None or vb is None:
        return None
    order = tuple(c.batch_dims) + (c.m_dim, c.n_dim)
    sizes = tuple(node.shape[d] for d in c.batch_dims) + (node.shape[c.m_dim], node.shape[c.n_dim], node.ranges[0])
    return MatmulViews(va, vb, node.name, order, batch, m, n, k, sizes)


def describe(views: MatmulViews) -> str:
    return f"{views.out} = torch.matmul(view of {views.a.buffer}, view of {views.b.buffer})"


__all__ = ["MatmulViews", "OperandView", "matmul_views", "describe"]
