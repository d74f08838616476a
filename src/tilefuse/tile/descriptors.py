"""Contraction operands read through tensor descriptors (TMA on Hopper GPUs).

An operand of `C[m, n] = Σ_k A[m, k] · B[k, n]` can be read block by block through a
descriptor when it is a plain load (an upcast stripped) of a strided 2-D view of its buffer:
its element offset is `base + s·row + col`, with one of its two iteration axes at unit stride
(k or m for A, n or k for B; the other way round the block is transposed after the load). The
hardware's rules are checked here, statically: base and row stride multiples of 16 bytes, a
positive row stride. The launcher guards the buffer's own address (a view at an odd offset is
copied once per call). Out-of-range rows and columns read as 0, so the K tail needs no mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from ..ir.dtypes import float_widens
from ..ir.expr import Cast, Index, Load, out_index, red_index
from ..ir.rewrite import substitute_index

ALIGN_BYTES = 16


@dataclass(frozen=True)
class DescribedOperand:
    buffer: str
    base: object  # sympy: element offset of the view's first element
    shape: tuple  # (rows, cols) extents of the stored view
    row_stride: object
    block: tuple  # constexpr names of the block (rows, cols)
    transpose: bool  # stored as the dot operand transposed (load, then transpose)


def _plain_load(e):
    # only exact conversions: the descriptor's block is the buffer's values, unrounded
    while isinstance(e, Cast) and float_widens(e.x.dtype, e.dtype):
        e = e.x
    return e if isinstance(e, Load) and all(isinstance(c, Index) for c in e.index) else None


def _static_int(e) -> int | None:
    e = sympy.sympify(e)
    return int(e) if e.is_Integer else None


def _aligned(elements, itemsize: int) -> bool:
    v = _static_int(elements)
    return v is not None and (v * itemsize) % ALIGN_BYTES == 0


def describe_operands(graph, plan, a_expr, b_expr) -> tuple | None:
    """(A, B) as `DescribedOperand`s, or None when either cannot be read through a descriptor.
    `a_expr`/`b_expr`: the dot operands over the output index and the reduction index `r0`."""
    from .builder import KernelBuilder  # a throwaway builder computes the buffers' offsets

    c = plan.contraction
    node = graph[plan.stages[0].node]
    if c.batch_dims:
        return None
    M, N, K = node.shape[c.m_dim], node.shape[c.n_dim], node.ranges[0]
    outs = out_index(node.rank)
    (r0,) = red_index(1)
    i, j = sympy.symbols("desc_i desc_j", integer=True, nonnegative=True)
    probe = KernelBuilder(graph, "descriptor_probe")
    found = []
    # A over (m, k): rows m, cols k; B over (k, n): rows k, cols n
    for expr, row_dim, col_dim, rows, cols, block in (
            (a_expr, c.m_dim, None, M, K, ("BLOCK_M", "BLOCK_K")),
            (b_expr, None, c.n_dim, K, N, ("BLOCK_K", "BLOCK_N"))):
        load = _plain_load(expr)
        if load is None or not load.dtype.is_low_precision:
            return None
        subst = {s: Index(sympy.Integer(0)) for s in outs}
        if row_dim is not None:  # A: i is m, j is k
            subst[outs[row_dim]] = Index(i)
            subst[r0] = Index(j)
        else:  # B: i is k, j is n
            subst[r0] = Index(i)
            subst[outs[col_dim]] = Index(j)
        mapped = substitute_index(load, subst)
        offset = probe.offset(mapped.buffer, mapped.index)
        if not isinstance(offset, Index):
            return None
        off = sympy.expand(offset.expr)
        ci, cj = off.coeff(i), off.coeff(j)
        base = sympy.expand(off - ci * i - cj * j)
        if {i, j} & (ci.free_symbols | cj.free_symbols | base.free_symbols):
            return None
        item = load.dtype.itemsize
        if not _aligned(base, item):
            return None
        if cj == 1 and _static_int(ci) and _static_int(ci) > 0 and _aligned(ci, item):
            found.append(DescribedOperand(load.buffer, base, (rows, cols), ci, block, False))
        elif ci == 1 and _static_int(cj) and _static_int(cj) > 0 and _aligned(cj, item):
            found.append(DescribedOperand(load.buffer, base, (cols, rows), cj, block[::-1], True))
        else:
            return None
    return tuple(found)


__all__ = ["DescribedOperand", "describe_operands"]
