"""The builder lowerings use to add nodes to the graph under construction."""
from __future__ import annotations

from typing import Callable

import sympy
import torch
import torch.utils._sympy.functions as _tf

from ..ir import dtypes as dt
from ..ir.dtypes import DType
from ..ir.expr import Expr, Index, cast, out_index, red_index
from ..ir.graph import Extern, ExternResult, Graph, Pointwise, Reduce, TensorArg
from ..ir.monoid import Monoid, monoid
from ..ir.symbolic import Ceiling, Floor, as_index_function, ceildiv, floordiv, fold_mod_complement
from ..ir.symbolic import mod as index_mod
from .cudnn_attention_grad import REPLACEMENTS as _SAFER_CALLS
from .reinplace import mutates_input
from .values import BufferValue, TensorValue

_TORCH_TO_IR = {
    torch.bool: dt.bool_, torch.uint8: dt.uint8, torch.uint16: dt.uint16, torch.uint32: dt.uint32,
    torch.uint64: dt.uint64, torch.int8: dt.int8, torch.int16: dt.int16,
    torch.int32: dt.int32, torch.int64: dt.int64, torch.float16: dt.float16,
    torch.bfloat16: dt.bfloat16, torch.float32: dt.float32, torch.float64: dt.float64,
    torch.complex32: dt.complex32, torch.complex64: dt.complex64, torch.complex128: dt.complex128,
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _TORCH_TO_IR[getattr(torch, _name)] = dt.ALL[_name]


#: ops whose result depends on where a view's elements sit in memory, not only on its values
STORAGE_DEPENDENT = frozenset({"as_strided", "as_strided_scatter", "as_strided_copy"})


class StorageAliasError(RuntimeError):
    """An op that reads a view's storage was applied to a view tilefuse folded into indices;
    the graph cannot be compiled faithfully (it runs eagerly instead)."""


def _ints(values) -> list | None:
    """Concrete integers (Python's or sympy's) as a list of ints; None where one is not."""
    if not isinstance(values, (list, tuple)):
        return None
    out = []
    for v in values:
        if type(v) is int or isinstance(v, sympy.Integer):
            out.append(int(v))
        else:
            return None
    return out


def dense_layout(shape, strides) -> bool:
    """Whether a layout is non-overlapping and dense: its dims, in order of stride, each step
    over all the elements the dims before hold (size-1 dims aside)."""
    expected = 1
    for d, st in sorted(((int(d), int(st)) for d, st in zip(shape, strides) if int(d) != 1), key=lambda p: p[1]):
        if st != expected:
            return False
        expected *= d
    return True


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s static layout fills `numel` consecutive storage positions (any order of dims)."""
    return all(type(n) is int for n in (*t.shape, *t.stride())) and dense_layout(t.shape, t.stride())


def ir_dtype(d: torch.dtype) -> DType:
    try:
        return _TORCH_TO_IR[d]
    except KeyError:
        raise TypeError(f"tilefuse does not generate code for dtype {d}") from None


def plain_sympy(e):
    """Rewrite PyTorch's own sympy functions (FloorDiv, ModularIndexing, PythonMod, CeilDiv,
    its Max/Min, ...), which appear in symbolic shapes, into the plain sympy that the IR's
    simplifier, evaluator and printers understand."""
    if not isinstance(e, sympy.Basic) or e.is_Atom:
        return e
    args = [plain_sympy(a) for a in e.args]
    if isinstance(e, _tf.FloorDiv):
        return floordiv(args[0], args[1])
    if isinstance(e, _tf.CeilDiv):
        return ceildiv(args[0], args[1])
    if isinstance(e, _tf.ModularIndexing):
        return index_mod(floordiv(args[0], args[1]), args[2])
    if isinstance(e, (_tf.PythonMod, _tf.Mod)):
        return index_mod(args[0], args[1])
    if isinstance(e, (_tf.IntTrueDiv, _tf.FloatTrueDiv)):
        return args[0] / args[1]
    if isinstance(e, (_tf.PowByNatural, _tf.FloatPow)):
        return args[0] ** args[1]
    if isinstance(e, (_tf.ToFloat, _tf.Identity, _tf.TruncToFloat)):
        return args[0]
    if isinstance(e, (_tf.FloorToInt, _tf.TruncToInt)):  # sizes are non-negative: trunc == floor
        return Floor(args[0])
    if isinstance(e, _tf.CeilToInt):
        return Ceiling(args[0])
    if isinstance(e, _tf.Max):
        return sympy.Max(*args)
    if isinstance(e, _tf.Min):
        return sympy.Min(*args)
    ours = as_index_function(e, args)  # (sympy's own floor trusts its wrong integer test)
    if ours is not None:
        return ours
    if any(x is not y for x, y in zip(args, e.args)):
        e = e.func(*args)
    return fold_mod_complement(e) if e.is_Add else e


def sym_expr(x):
    """A python int / SymInt / SymFloat as a sympy expression."""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return plain_sympy(x.node.expr)
    if isinstance(x, bool):
        return x
    if isinstance(x, (int, float)):
        return sympy.sympify(x)
    return x


def shape_of(t) -> tuple:
    return tuple(sympy.sympify(sym_expr(d)) for d in t.shape)


def strides_of(t) -> tuple | None:
    """The strides of a traced result, as sympy (None when there is no tensor)."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return tuple(sympy.sympify(sym_expr(st)) for st in t.stride())
    except (RuntimeError, NotImplementedError):  # a sparse or nested result has no strides
        return None


class LoweringContext:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.current_meta = None  # FakeTensor(s) PyTorch computed for the op being lowered
        self.current_target = None
        self.current_node = None  # the FX node being lowered (lowerings that look at its users)

    # -------------------------------------------------------------- what the op must produce
    @property
    def out_dtype(self) -> DType:
        meta = self.current_meta
        if isinstance(meta, (tuple, list)):
            meta = meta[0]
        return ir_dtype(meta.dtype)

    @property
    def out_shape(self) -> tuple:
        meta = self.current_meta
        if isinstance(meta, (tuple, list)):
            meta = meta[0]
        return shape_of(meta)

    # -------------------------------------------------------------- node builders
    def _name(self) -> str:
        return self.graph.fresh_name("buf")

    def pointwise(self, shape, dtype: DType, fn: Callable[[tuple], Expr]) -> BufferValue:
        """out[i] = fn(i) for i over `shape`; `fn` gets a tuple of `Index` expressions."""
        shape = tuple(sympy.sympify(d) for d in shape)
        idx = tuple(Index(s) for s in out_index(len(shape)))
        body = cast(fn(idx), dtype)
        node = self.graph.add(Pointwise(self._name(), dtype, shape, body=body))
        return BufferValue(node.name, dtype, shape)

    def reduce(self, shape, ranges, combiner: Monoid | str, fn: Callable[[tuple, tuple], Expr],
               dtype: DType) -> BufferValue:
        """out[i] = combiner over r in `ranges` of fn(i, r); the combiner is a `Monoid` or its
        name (`ir.monoid.monoid` looks it up)."""
        shape = tuple(sympy.sympify(d) for d in shape)
        ranges = tuple(sympy.sympify(d) for d in ranges)
        idx = tuple(Index(s) for s in out_index(len(shape)))
        ridx = tuple(Index(s) for s in red_index(len(ranges)))
        body = fn(idx, ridx)
        node = self.graph.add(Reduce(self._name(), dtype, shape, ranges=ranges, combiner=monoid(combiner), body=body))
        return BufferValue(node.name, dtype, shape)

    def realize(self, value: TensorValue) -> str:
        """The name of a node holding `value` (a copy kernel for views)."""
        if isinstance(value, BufferValue):
            return value.name
        return self.pointwise(value.shape, value.dtype, value.load).name

    def _pin_traced_layouts(self, args) -> None:
        """An op that reads its argument's storage sees the storage eager gave the argument: a
        buffer computed here is stored with the strides it was traced with (the product of a
        channels-last input is channels-last in eager), whatever layout would be faster."""
        fx_args = getattr(self.current_node, "args", ())
        for a, fx in zip(args, fx_args):
            val = getattr(fx, "meta", {}).get("val") if isinstance(fx, torch.fx.Node) else None
            node = self.graph.nodes.get(a.name) if isinstance(a, BufferValue) else None
            if isinstance(node, (Pointwise, Reduce)) and isinstance(val, torch.Tensor) and a.name not in self.graph.output_strides:
                strides = strides_of(val)
                if strides is not None and len(strides) == node.rank:
                    self.graph.output_strides[a.name] = strides

    def _dense_view_rebased(self, op: str, args, kwargs):
        """`as_strided(view, size, stride, offset)` where the view was traced dense (its
        elements fill a span of storage without gaps, in any order of dimensions) and every
        element the op reads lies in that span, not in the rest of its base's storage: the same
        op on the view realised as a buffer of the traced strides (`_pin_traced_layouts`), read
        from the span's start (Longformer's overlapping chunks of a transposed query). (args,
        kwargs), or None where that does not hold or is not known (symbolic sizes, an explicit
        storage offset)."""
        if op not in ("as_strided", "as_strided_copy") or len(args) < 3:
            return None
        fx_args = getattr(self.current_node, "args", ())
        val = fx_args[0].meta.get("val") if fx_args and isinstance(fx_args[0], torch.fx.Node) else None
        size, stride = _ints(args[1]), _ints(args[2])
        offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
        # an explicit offset counts from the storage's start, which a graph input's view shares
        # with its caller and which differs call by call (Dynamo does not guard it): refused
        plain = size is not None and stride is not None and len(size) == len(stride) and offset is None
        if not plain or not isinstance(val, torch.Tensor) or not isinstance(val.numel(), int) \
                or not isinstance(val.storage_offset(), int) or not _dense(val):
            return None
        if any(s < 0 for s in stride):
            return None
        if all(n > 0 for n in size) and sum((n - 1) * s for n, s in zip(size, stride)) >= val.numel():
            return None
        rest = {k: v for k, v in kwargs.items() if k != "storage_offset"}
        return (BufferValue(self.realize(args[0]), args[0].dtype, args[0].shape), size, stride), rest

    def extern(self, target, args, kwargs, reason: str, binds=None):
        """Call `target` from ATen at run time. Returns a value or a tuple of values, as the
        op does. `binds`: the unbacked symbol the call's scalar result defines."""

        def convert(a):
            if isinstance(a, TensorValue):
                return TensorArg(self.realize(a))
            if isinstance(a, (list, tuple)):
                return type(a)(convert(x) for x in a)
            if isinstance(a, dict):
                return {k: convert(v) for k, v in a.items()}
            if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                return sym_expr(a)
            return a

        parts = str(target).split(".")  # "aten.<op>.<overload>"; a higher-order op has no dots
        if (parts[1] if len(parts) > 1 else parts[0]) in STORAGE_DEPENDENT and any(
                isinstance(a, TensorValue) and not isinstance(a, BufferValue) for a in args):
            # the op reads the view's *storage*, which a materialised copy does not have, unless
            # the view is dense and the op reads only its elements
            rebased = self._dense_view_rebased(parts[1] if len(parts) > 1 else "", args, kwargs)
            if rebased is None:
                raise StorageAliasError(f"{target} of a view depends on the storage layout of the view's base")
            args, kwargs = rebased
        if (parts[1] if len(parts) > 1 else parts[0]) in STORAGE_DEPENDENT:
            self._pin_traced_layouts(args)
        meta = self.current_meta
        multi = isinstance(meta, (tuple, list))
        first = next((m for m in meta if isinstance(m, torch.Tensor)), None) if multi else meta
        if not isinstance(first, torch.Tensor):
            first = None  # a scalar result (`binds`)
        # convert first: realising a view argument adds a node, and so takes a name
        ext_args, ext_kwargs = convert(tuple(args)), convert(dict(kwargs))
        target = _SAFER_CALLS.get(target, target)  # (an ATen op that is wrong for some layouts)
        name = self._name()
        node = Extern(
            name, ir_dtype(first.dtype) if first is not None else dt.float32,
            shape_of(first) if first is not None else (), target=target,
            target_name=str(target), args=ext_args, kwargs=ext_kwargs,
            reason=reason, multi_output=multi, binds=binds, mutates=mutates_input(target),
            strides=strides_of(first),
        )
        self.graph.add(node)
        if not multi:
            return BufferValue(name, node.dtype, node.shape)
        results = []
        for k, m in enumerate(meta):
            if not isinstance(m, torch.Tensor):
                results.append(None)
                continue
            r = self.graph.add(ExternResult(f"{name}_{k}", ir_dtype(m.dtype), shape_of(m), extern=name, item=k,
                                            strides=strides_of(m)))
            results.append(BufferValue(r.name, r.dtype, r.shape))
        return tuple(results)
