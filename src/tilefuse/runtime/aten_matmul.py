"""Running a plain matrix product through ATen (cuBLAS on GPUs, MKL/OpenBLAS on CPUs), with a
bias vector folded in (`addmm`) where the graph adds one.

`fusion.matmul_views` describes each operand as affine maps from the iteration symbols to the
buffer's dims; here they become `as_strided` views using the buffers' actual strides at call
time (so non-contiguous inputs need no copy), and the product is written into the output
buffer that the compiled graph allocated.
"""
from __future__ import annotations

import torch

from ..backends.size_cache import SizeCache, size_key
from ..ir import symbolic
from ..ir.interpret import torch_dtype


class AtenMatmul:
    """A launcher with the generated kernels' interface: `launch(buffers, env)`. What the views
    need from the sizes (extents, coefficients, offsets as ints) is evaluated once per set of
    sizes; a call only reads the buffers' strides and makes the views."""

    def __init__(self, views):
        self.views = views
        self._sized = SizeCache()  # size_key(env) -> _Sized

    def __tilefuse_reduce__(self):  # a stored graph rebuilds it (`runtime.artifact`)
        return (self.views,)

    def _sized_for(self, env: dict) -> "_Sized":
        key = size_key(env)
        sized = self._sized.get(key)
        if sized is None:
            sized = self._sized.put(key, _Sized(self.views, env))
        return sized

    def __call__(self, buffers: dict, env: dict) -> None:
        v, z = self.views, self._sized_for(env)
        a = _view(buffers[v.a.buffer], v.a, z.a, z.a_sizes)
        b = _view(buffers[v.b.buffer], v.b, z.b, z.b_sizes)
        out = buffers[v.out]
        if z.out_shape is not None:  # the buffer holds a reshape of the product
            out = out.view(z.out_shape)
        out = out.permute(v.order)
        if out.numel() == 0:
            return
        direct = out.is_contiguous() and out.dtype == a.dtype  # written in place
        if v.bias is not None:  # (2-D: addmm folds the bias into the library's epilogue)
            bias = _view(buffers[v.bias.buffer], v.bias, z.bias, z.b_sizes[-1:])
            if direct:
                torch.addmm(bias, a, b, out=out)
            else:
                out.copy_(torch.addmm(bias, a, b))
        elif direct:
            torch.matmul(a, b, out=out)
        else:
            out.copy_(torch.matmul(a, b))


class _Sized:
    """The views' integers for one set of sizes."""

    def __init__(self, v, env: dict):
        def ev(e) -> int:
            return int(symbolic.evaluate(e, env))

        *batch, M, N, K = (ev(s) for s in v.sizes)
        self.a_sizes, self.b_sizes = (*batch, M, K), (*batch, K, N)
        self.out_shape = tuple(ev(d) for d in v.out_shape) if v.out_shape is not None else None
        self.a = _operand_ints(v.a, (*v.batch, v.m, v.k), ev)
        self.b = _operand_ints(v.b, (*v.batch, v.k, v.n), ev)
        self.bias = _operand_ints(v.bias, (v.n,), ev) if v.bias is not None else None


def _operand_ints(op, symbols: tuple, ev):
    """("flat", expected strides, strides, offset) for a view with one storage offset, else
    ("dims", coefficients[symbol][dim], constants[dim]) to combine with the actual strides."""
    if op.flat is not None:
        coefs, const = op.flat
        return ("flat", tuple(ev(st) for st in op.strides), [ev(coefs.get(name, 0)) for name in symbols], ev(const))
    return ("dims", [[ev(coefs.get(name, 0)) for coefs, _ in op.dims] for name in symbols],
            [ev(const) for _, const in op.dims])


def _view(t: torch.Tensor, op, ints, sizes: tuple) -> torch.Tensor:
    if ints[0] == "flat":  # one offset into the storage, valid for the compiled strides
        _, expected, strides, const = ints
        if any(n != 1 and st != want for n, st, want in zip(t.shape, t.stride(), expected)):
            raise RuntimeError(f"{op.buffer}: strides {tuple(t.stride())} are not the compiled {expected}")
        v = torch.as_strided(t, sizes, strides, t.storage_offset() + const)
    else:
        _, coefs, consts = ints
        st = t.stride()
        strides = [sum(c * s for c, s in zip(row, st)) for row in coefs]
        v = torch.as_strided(t, sizes, strides, t.storage_offset() + sum(c * s for c, s in zip(consts, st)))
    for dtype in op.casts:
        v = v.to(torch_dtype(dtype))
    return v


__all__ = ["AtenMatmul"]
