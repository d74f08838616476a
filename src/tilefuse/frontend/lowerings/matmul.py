"""Matrix products: mm, bmm, addmm, baddbmm.

A product is a Reduce(sum) over the contraction index r0 whose body is exactly
`Binary("mul", A, B)`: A loads the left operand at (M-side index, r0), B the right operand
at (r0, N-side index), each wrapped in a Cast to fp32 for fp16/bf16 inputs (accumulation
in fp32, the node's dtype is the output dtype). The tile layer recognises this shape and
emits `dot`. addmm/baddbmm add a separate Pointwise epilogue (beta*bias + alpha*product)
that reads an fp32 product, so the result is rounded once, like eager.
"""
from __future__ import annotations

import torch

from ...ir import dtypes as dt
from ...ir.dtypes import DType
from ...ir.expr import Binary, Load, binary, cast
from ...ir.monoid import SUM
from ..registry import Unsupported, lowering
from ..values import TensorValue
from .common import broadcast_load, is_scalar_value, out_shape, pointwise, py, reduce, scalar

aten = torch.ops.aten


def _operand(ctx, value: TensorValue, index: tuple, acc: DType):
    e = value.load(index)
    if not isinstance(e, Load):  # buffers and views always load; guard the contract anyway
        raise Unsupported("matmul operand is not a load")
    return cast(e, acc)


def contraction(ctx, a: TensorValue, b: TensorValue, out_dtype: DType) -> TensorValue:
    """out[..., m, n] = sum_k a[..., m, k] * b[..., k, n] for 2-D or batched 3-D operands."""
    if a.rank != b.rank or a.rank not in (2, 3):
        raise Unsupported("matmul operands must both be 2-D or 3-D")
    if not (a.dtype.is_float or a.dtype.is_int) or a.dtype != b.dtype:
        raise Unsupported(f"matmul of {a.dtype} and {b.dtype}")
    acc = dt.compute_dtype(a.dtype) if a.dtype.is_float else a.dtype
    if a.rank == 2:
        shape = (a.shape[0], b.shape[1])
        k = a.shape[1]

        def body(idx, ridx):
            return Binary("mul", _operand(ctx, a, (idx[0], ridx[0]), acc),
                          _operand(ctx, b, (ridx[0], idx[1]), acc), acc)
    else:
        shape = (a.shape[0], a.shape[1], b.shape[2])
        k = a.shape[2]

        def body(idx, ridx):
            return Binary("mul", _operand(ctx, a, (idx[0], idx[1], ridx[0]), acc),
                          _operand(ctx, b, (idx[0], ridx[0], idx[2]), acc), acc)

    return reduce(ctx, shape, (k,), SUM, body, out_dtype)


@lowering(aten.mm.default, aten.bmm.default)
def mm(ctx, a, b):
    return contraction(ctx, a, b, ctx.out_dtype)


@lowering(aten.mm.dtype, aten.bmm.dtype)
def mm_out_dtype(ctx, a, b, out_dtype):
    return contraction(ctx, a, b, ctx.out_dtype)


def _add_product(ctx, bias, a, b, beta, alpha):
    out = ctx.out_dtype
    acc = dt.compute_dtype(out)
    return _scaled_sum(ctx, bias, contraction(ctx, a, b, acc), beta, alpha, out, acc)


def _scaled_sum(ctx, bias, prod, beta, alpha, out, acc):
    """beta * bias + alpha * prod, as PyTorch's addmm family defines it."""
    beta, alpha = py(beta), py(alpha)
    shape = out_shape(ctx)

    def body(idx):
        p = prod.load(idx)
        if not is_scalar_value(alpha, 1):
            p = binary("mul", p, scalar(alpha, acc))
        if is_scalar_value(beta, 0):
            return p  # beta == 0: the bias is ignored, NaNs included
        bv = broadcast_load(bias, idx, shape, acc)
        if not is_scalar_value(beta, 1):
            bv = binary("mul", bv, scalar(beta, acc))
        return binary("add", bv, p)

    return pointwise(ctx, shape, out, body)


@lowering(aten.addmm.default, aten.baddbmm.default)
def addmm(ctx, bias, a, b, *, beta=1, alpha=1):
    return _add_product(ctx, bias, a, b, beta, alpha)


@lowering(aten.addmm.dtype, aten.baddbmm.dtype)
def addmm_out_dtype(ctx, bias, a, b, out_dtype, *, beta=1, alpha=1):
    return _add_product(ctx, bias, a, b, beta, alpha)


@lowering(aten.addmv.default)
def addmv(ctx, bias, mat, vec, *, beta=1, alpha=1):
    """beta*bias + alpha*(mat @ vec): a sum-of-products reduction (not a 2-D contraction, so
    the tile layer treats it as an ordinary reduction) and a pointwise epilogue."""
    out = ctx.out_dtype
    if mat.rank != 2 or vec.rank != 1 or not out.is_float:
        raise Unsupported("addmv operands")
    acc = dt.compute_dtype(out)
    prod = reduce(ctx, (mat.shape[0],), (mat.shape[1],), SUM,
                  lambda idx, ridx: Binary("mul", cast(mat.load((idx[0], ridx[0])), acc),
                                           cast(vec.load((ridx[0],)), acc), acc), acc)
    return _scaled_sum(ctx, bias, prod, beta, alpha, out, acc)
