"""Running a plain matrix product through ATen (cuBLAS on GPUs, MKL/OpenBLAS on CPUs), with a
bias vector folded in (`addmm`) where the graph adds one.

`fusion.matmul_views` describes each operand as affine maps from the iteration symbols to the
buffer's dims; here they become `as_strided` views using the buffers' actual strides at call
time (so non-contiguous inputs need no copy), and the product is written into the output
buffer that the compiled graph allocated. An output whose rows are padded to 16 bytes
(`fusion.row_padding`) is written in two calls: the aligned columns, then the few left.
"""
from __future__ import annotations

import functools
import math

import torch

from ..backends.inline_call import SKIP, Buf, Expect, InlineCall
from ..backends.size_cache import SizeCache, size_key
from ..ir.storage import MIN_PADDED_ROW, ROW_ALIGNMENT
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
        v = self.views
        bias = buffers[v.bias.buffer] if v.bias is not None else None
        self._run(self._sized_for(env), buffers[v.a.buffer], buffers[v.b.buffer], buffers[v.out], bias)

    def inline(self, buffers: dict, env: dict):
        """This product for the compiled graph's generated call (`backends.inline_call`): the
        integers for these sizes bound, the views made from the buffers' strides per call."""
        z = self._sized_for(env)
        if z.empty:
            return SKIP
        v = self.views
        names = (v.a.buffer, v.b.buffer, v.out) + ((v.bias.buffer,) if v.bias is not None else ())
        tensors = [buffers[n] for n in names]
        fast = _Direct.make(z, *tensors)
        if fast is not None:  # the views' layouts worked out once, checked at the call's entry
            expects = {n: Expect(tuple(t.stride())) for n, t in zip(names, tensors)}
            return InlineCall(fast, tuple(Buf(n) for n in names), expects, label="library product")
        return InlineCall(functools.partial(self._run, z), tuple(Buf(n) for n in names), label="library product")

    def _run(self, z: "_Sized", a, b, out, bias=None) -> None:
        v = self.views
        a = z.a.view(a)
        b = z.b.view(b)
        if z.out_shape is not None:  # the buffer holds a reshape of the product
            out = out.view(z.out_shape)
        if z.permuted:
            out = out.permute(v.order)
        if z.empty:
            return
        bias = z.bias.view(bias) if z.bias is not None else None
        alpha = v.alpha
        if out.dtype != a.dtype or not _writable_in_place(out):
            out.copy_(_product(bias, a, b, alpha))
            return
        split = z.aligned_columns(out)
        if split is None:
            _product(bias, a, b, alpha, out)
            return
        # rows padded to 16 bytes (`fusion.row_padding`): the aligned columns in one call, the
        # few left in another, so that the library's fast kernels take the bulk
        head, tail = slice(0, split), slice(split, None)
        _product(bias[head] if bias is not None else None, a, b[:, head], alpha, out[:, head])
        _product(bias[tail] if bias is not None else None, a, b[:, tail], alpha, out[:, tail])


def _product(bias, a, b, alpha: float, out=None):
    if bias is not None:  # (2-D: addmm folds the bias into the library's epilogue)
        return torch.addmm(bias, a, b) if out is None else torch.addmm(bias, a, b, out=out)
    if alpha != 1.0:  # (2-D: the library's alpha, nothing added: beta = 0 ignores the input)
        if out is None:
            return torch.addmm(a.new_zeros(()), a, b, beta=0, alpha=alpha)
        return torch.addmm(out, a, b, beta=0, alpha=alpha, out=out)
    return torch.matmul(a, b) if out is None else torch.matmul(a, b, out=out)


def _writable_in_place(out: torch.Tensor) -> bool:
    """The library writes `out` as it is: contiguous, or a matrix with unit column stride and
    rows padded (cuBLAS and MKL take a leading dimension)."""
    if out.is_contiguous():
        return True
    return out.dim() == 2 and out.stride(1) == 1 and out.stride(0) >= out.shape[1]


class _Sized:
    """The views' integers for one set of sizes."""

    def __init__(self, v, env: dict):
        def ev(e) -> int:
            return int(symbolic.evaluate(e, env))

        *batch, M, N, K = (ev(s) for s in v.sizes)
        self.out_shape = tuple(ev(d) for d in v.out_shape) if v.out_shape is not None else None
        self.permuted = tuple(v.order) != tuple(range(len(v.order)))
        self.order, self.alpha = tuple(v.order), v.alpha
        self.empty = M * N * math.prod(batch) == 0
        self.a = _Operand(v.a, (*v.batch, v.m, v.k), (*batch, M, K), ev)
        self.b = _Operand(v.b, (*v.batch, v.k, v.n), (*batch, K, N), ev)
        self.bias = _Operand(v.bias, (v.n,), (N,), ev) if v.bias is not None else None
        self.n = N

    def aligned_columns(self, out: torch.Tensor) -> int | None:
        """The number of leading columns to compute apart from the rest, so that the library
        sees a row length and leading dimensions that are multiples of 16 bytes; None when
        one call serves (rows aligned already, or `out`'s rows are not)."""
        if out.dim() != 2 or self.n < MIN_PADDED_ROW:
            return None
        per = ROW_ALIGNMENT // out.element_size() if ROW_ALIGNMENT % out.element_size() == 0 else 0
        if not per or self.n % per == 0 or out.stride(0) % per or out.stride(1) != 1:
            return None
        return self.n - self.n % per


try:  # a view by sizes, strides and an offset from the tensor's own, without the dispatcher
    from torch._C._dynamo.guards import _reinterpret_tensor as _reinterpret  # (Inductor's `reinterpret_tensor`)
    REINTERPRETS_AS_NEW = True  # (its result is a tensor of its own over the storage, not a view)
except ImportError:  # pragma: no cover - older PyTorch
    REINTERPRETS_AS_NEW = False

    def _reinterpret(t, sizes, strides, delta):
        return torch.as_strided(t, sizes, strides, t.storage_offset() + delta)


class _Direct:
    """A product for the generated call, for buffers with the strides it was made for (the call
    checks them at its entry): each view's sizes, strides and offset from its buffer's own
    offset are worked out once, so a call makes at most one view per operand and calls the
    library. Only for operands that need no conversion (a bias may: autocast rounds an fp32 one
    per call, as eager does) and an output written in place in one call."""

    __slots__ = ("a", "b", "out", "bias", "bias_casts", "alpha", "mm")

    @staticmethod
    def make(z: "_Sized", a, b, out, bias=None) -> "_Direct | None":
        if z.a.casts or z.b.casts:
            return None
        av, bv = z.a.view(a), z.b.view(b)
        if not (_shares_memory(av, a) and _shares_memory(bv, b)):  # (a reversed operand: a copy per call)
            return None
        o = out.view(z.out_shape) if z.out_shape is not None else out
        if z.permuted:
            o = o.permute(z.order)
        if o.dtype != av.dtype or not _writable_in_place(o) or z.aligned_columns(o) is not None:
            return None
        d = _Direct()
        d.a, d.b, d.out = _relayout(a, av), _relayout(b, bv), _relayout(out, o)
        # (a bias autocast rounds, an fp32 parameter: converted per call, as eager's autocast does)
        d.bias_casts = z.bias.casts if z.bias is not None else ()
        bias_view = z.bias.strided(bias) if z.bias is not None else None
        if bias_view is not None and not _shares_memory(bias_view, bias):
            return None
        d.bias = _relayout(bias, bias_view) if bias_view is not None else None
        d.alpha = z.alpha
        d.mm = av.dim() == 2 and bias is None and z.alpha == 1.0  # (matmul's dispatch skipped)
        return d

    def __call__(self, a, b, out, bias=None) -> None:
        a, b, out = _apply(self.a, a), _apply(self.b, b), _apply(self.out, out)
        if self.mm:
            torch.mm(a, b, out=out)
            return
        if bias is not None:
            bias = _apply(self.bias, bias)
            for dtype in self.bias_casts:
                bias = bias.to(dtype)
        _product(bias, a, b, self.alpha, out)


def _shares_memory(view: torch.Tensor, t: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


def _relayout(t: torch.Tensor, view: torch.Tensor):
    """None when `view` is `t` as it is, else (sizes, strides, offset from t's own)."""
    if view.shape == t.shape and view.stride() == t.stride() and view.storage_offset() == t.storage_offset():
        return None
    return tuple(view.shape), tuple(view.stride()), view.storage_offset() - t.storage_offset()


def _apply(layout, t: torch.Tensor) -> torch.Tensor:
    if layout is None:
        return t
    return _reinterpret(t, *layout)


def _reversed_view(t: torch.Tensor, sizes: tuple, strides: tuple, offset: int) -> torch.Tensor:
    """The operand whose dims of negative stride run backwards through `t` (a `flip` the
    planner could not prove away): `as_strided` takes no negative stride, so the view with
    those dims forwards, flipped — a copy, not a view of `t`."""
    flipped = [d for d, st in enumerate(strides) if st < 0]
    start = offset + sum(strides[d] * (sizes[d] - 1) for d in flipped if sizes[d] > 0)
    forwards = tuple(-st if st < 0 else st for st in strides)
    return torch.as_strided(t, sizes, forwards, start).flip(flipped)


#: buffer layouts remembered per operand and set of sizes
MAX_LAYOUTS = 16


class _Operand:
    """One operand's view for one set of sizes. Its strides and offset follow from the
    buffer's own strides and offset, so they are worked out once per pair of those (a call
    with the same layouts as the last makes one `as_strided` view and nothing else)."""

    def __init__(self, op, symbols: tuple, sizes: tuple, ev):
        self.op, self.sizes = op, sizes
        self.casts = tuple(torch_dtype(d) for d in op.casts)
        if op.flat is not None:  # one offset into the storage, valid for the compiled strides
            coefs, const = op.flat
            self.expected = tuple(ev(st) for st in op.strides)
            self.flat = (tuple(ev(coefs.get(name, 0)) for name in symbols), ev(const))
        else:
            self.expected = self.flat = None
            self.coefs = [[ev(coefs.get(name, 0)) for coefs, _ in op.dims] for name in symbols]
            self.consts = [ev(const) for _, const in op.dims]
        self._layouts: dict = {}  # (buffer strides, offset) -> (view strides, view offset)

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """The operand as the library takes it: the view, converted."""
        v = self.strided(t)
        for dtype in self.casts:
            v = v.to(dtype)
        return v

    def strided(self, t: torch.Tensor) -> torch.Tensor:
        """The view of `t` for these sizes, before any conversion."""
        key = (t.stride(), t.storage_offset())
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layout(t, *key)
            if tuple(t.shape) == self.sizes and tuple(layout[0]) == key[0] and layout[1] == key[1]:
                layout = None, None  # the buffer as it is: no view to make
            if len(self._layouts) >= MAX_LAYOUTS:  # (offsets that move every call: keep it bounded)
                self._layouts.clear()
            self._layouts[key] = layout
        if layout[0] is None:
            return t
        if any(st < 0 for st in layout[0]):
            return _reversed_view(t, self.sizes, *layout)
        return torch.as_strided(t, self.sizes, *layout)

    def _layout(self, t, st: tuple, offset: int) -> tuple:
        if self.flat is not None:
            if any(n != 1 and s != want for n, s, want in zip(t.shape, st, self.expected)):
                raise RuntimeError(f"{self.op.buffer}: strides {tuple(st)} are not the compiled {self.expected}")
            return self.flat[0], offset + self.flat[1]
        strides = tuple(sum(c * s for c, s in zip(row, st)) for row in self.coefs)
        return strides, offset + sum(c * s for c, s in zip(self.consts, st))


__all__ = ["AtenMatmul"]
