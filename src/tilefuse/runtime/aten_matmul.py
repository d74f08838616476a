"""Running a plain matrix product through ATen (cuBLAS on GPUs, MKL/OpenBLAS on CPUs).

`fusion.matmul_views` describes each operand as affine maps from the iteration symbols to the
buffer's dims; here they become `as_strided` views using the buffers' actual strides at call
time (so non-contiguous inputs need no copy), and the product is written into the output
buffer that the compiled graph allocated.
"""
from __future__ import annotations

import torch

from ..ir import symbolic
from ..ir.interpret import torch_dtype


class AtenMatmul:
    """A launcher with the generated kernels' interface: `launch(buffers, env)`."""

    def __init__(self, views):
        self.views = views

    def __tilefuse_reduce__(self):  # a stored graph rebuilds it (`runtime.artifact`)
        return (self.views,)

    def _view(self, t: torch.Tensor, op, symbols: tuple, sizes: tuple, env: dict) -> torch.Tensor:
        v = self._strided(t, op, symbols, sizes, env)
        for dtype in op.casts:
            v = v.to(torch_dtype(dtype))
        return v

    def _strided(self, t: torch.Tensor, op, symbols: tuple, sizes: tuple, env: dict) -> torch.Tensor:
        if op.flat is not None:  # one offset into the storage, valid for the compiled strides
            expected = tuple(int(symbolic.evaluate(s, env)) for s in op.strides)
            if any(n != 1 and st != want for n, st, want in zip(t.shape, t.stride(), expected)):
                raise RuntimeError(f"{op.buffer}: strides {tuple(t.stride())} are not the compiled {expected}")
            coefs, const = op.flat
            strides = [int(symbolic.evaluate(coefs.get(name, 0), env)) for name in symbols]
            return torch.as_strided(t, sizes, strides, t.storage_offset() + int(symbolic.evaluate(const, env)))
        strides, offset = [], t.storage_offset()
        for name in symbols:
            strides.append(sum(int(symbolic.evaluate(coefs.get(name, 0), env)) * t.stride(d)
                               for d, (coefs, _) in enumerate(op.dims)))
        for d, (_, const) in enumerate(op.dims):
            offset += int(symbolic.evaluate(const, env)) * t.stride(d)
        return torch.as_strided(t, sizes, strides, offset)

    def __call__(self, buffers: dict, env: dict) -> None:
        v = self.views
        *batch, M, N, K = (int(symbolic.evaluate(s, env)) for s in v.sizes)
        a = self._view(buffers[v.a.buffer], v.a, (*v.batch, v.m, v.k), (*batch, M, K), env)
        b = self._view(buffers[v.b.buffer], v.b, (*v.batch, v.k, v.n), (*batch, K, N), env)
        out = buffers[v.out]
        if v.out_shape is not None:  # the buffer holds a reshape of the product
            out = out.view(tuple(int(symbolic.evaluate(d, env)) for d in v.out_shape))
        out = out.permute(v.order)
        if out.numel() == 0:
            return
        if out.is_contiguous() and out.dtype == a.dtype:
            torch.matmul(a, b, out=out)
        else:
            out.copy_(torch.matmul(a, b))


__all__ = ["AtenMatmul"]
