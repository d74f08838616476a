"""Reference interpreter for the graph IR: the oracle every lowering is tested against.

It evaluates each node in one vectorised step with PyTorch: index symbols become broadcast
`arange` tensors, loads become advanced indexing, reductions reduce the trailing axes.
Correctness over speed: loads clamp out-of-range indices (they only occur in the branch of a
`where` that is not selected, as with padding and concatenation). A `CheckedIndex` (an index
read from tensor data) outside its bound raises the error eager PyTorch raises, for the
elements where it is live: under an unselected `where` branch it is not checked.
"""
from __future__ import annotations

import math

import sympy
import torch

from . import philox, symbolic
from .dtypes import DType
from .bounds import check_message, index_error
from .expr import (Binary, Cast, CheckedIndex, Const, Expr, Index, Load, Unary, Var, Where, index_symbol, out_index,
                   red_index, walk)
from .graph import Constant, Extern, ExternResult, Graph, Input, Pointwise, Reduce, ScalarInput, Scatter, TensorArg


def torch_dtype(d: DType) -> torch.dtype:
    return getattr(torch, {"bool": "bool"}.get(d.name, d.name))


def symbol_sources(graph: Graph) -> list:
    """Where each size symbol's value comes from: (position, dim or None for an int argument,
    symbol), in input order; inputs of static shape have none."""
    sources = []
    for node in graph.inputs:
        if isinstance(node, ScalarInput):
            if isinstance(node.symbol, sympy.Symbol):
                sources.append((node.position, None, node.symbol))
        elif isinstance(node, Input):
            sources.extend((node.position, k, d) for k, d in enumerate(node.shape) if isinstance(d, sympy.Symbol))
    return sources


def bind_from(sources: list, args) -> dict:
    """Size-symbol values from the call's tensors and ints (`symbol_sources`); each symbol
    bound by its name too."""
    env: dict = {}
    if not sources:
        return env
    for position, dim, symbol in sources:
        value = args[position]
        if dim is None:
            env[symbol] = int(value)
        elif value is not None and symbol not in env:  # None: an effect token AOTAutograd dropped
            env[symbol] = int(value.shape[dim])
    env.update({s.name: v for s, v in list(env.items())})
    return env


def bind_symbols(graph: Graph, args) -> dict:
    """Size-symbol values from the call's tensors and ints."""
    return bind_from(symbol_sources(graph), args)


_UNARY = {
    "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "exp2": torch.exp2, "log": torch.log,
    "log2": torch.log2, "log10": torch.log10, "log1p": torch.log1p, "expm1": torch.expm1,
    "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "sin": torch.sin, "cos": torch.cos, "tan": torch.tan,
    "asin": torch.asin, "acos": torch.acos, "atan": torch.atan, "sinh": torch.sinh,
    "cosh": torch.cosh, "tanh": torch.tanh, "tanh_approx": torch.tanh, "asinh": torch.asinh, "acosh": torch.acosh,
    "atanh": torch.atanh, "sigmoid": torch.sigmoid, "erf": torch.erf, "erfc": torch.erfc,
    "floor": torch.floor, "ceil": torch.ceil, "round": torch.round, "trunc": torch.trunc,
    "sign": torch.sign, "reciprocal": torch.reciprocal, "logical_not": torch.logical_not,
    "bitwise_not": torch.bitwise_not, "isnan": torch.isnan, "isinf": torch.isinf,
    "lgamma": torch.lgamma,
}
_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "truediv": torch.true_divide,
    "floordiv": torch.floor_divide, "mod": torch.remainder, "fmod": torch.fmod, "pow": torch.pow,
    "maximum": torch.maximum, "minimum": torch.minimum, "atan2": torch.atan2,
    "copysign": torch.copysign, "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le,
    "gt": torch.gt, "ge": torch.ge, "logical_and": torch.logical_and,
    "logical_or": torch.logical_or, "logical_xor": torch.logical_xor,
    "bitwise_and": torch.bitwise_and, "bitwise_or": torch.bitwise_or,
    "bitwise_xor": torch.bitwise_xor, "lshift": torch.bitwise_left_shift,
    "rshift": torch.bitwise_right_shift, "rand": philox.uniform,
}


class Evaluator:
    """Evaluates expressions given buffers (tensors) and symbol values (ints/tensors)."""

    def __init__(self, buffers: dict, env: dict, variables: dict | None = None):
        self.buffers = buffers
        self.env = env
        self.variables = variables or {}
        self.memo: dict = {}

    def __call__(self, e: Expr, path: tuple = ()) -> torch.Tensor:
        """`path`: the (condition, polarity) of each `where` branch above `e`, which decide
        where a check inside `e` is live (only expressions holding a check keep it)."""
        if path and not self._checks(e):
            path = ()
        key = (e, path)
        if key in self.memo:
            return self.memo[key]
        out = self._eval(e, path)
        self.memo[key] = out
        return out

    def _checks(self, e: Expr) -> bool:
        key = ("has-check", e)
        if key not in self.memo:
            self.memo[key] = any(isinstance(n, CheckedIndex) for n in walk(e))
        return self.memo[key]

    def _live(self, path: tuple):
        live = None
        for k, (cond, polarity) in enumerate(path):
            c = self(cond, path[:k]).to(torch.bool)
            c = c if polarity else ~c
            live = c if live is None else live & c
        return live

    def _check(self, e: CheckedIndex, path: tuple) -> torch.Tensor:
        v = self(e.x, path).to(torch.int64)
        n = int(symbolic.evaluate(e.size, self.env))
        if e.wrap:
            v = torch.where(v < 0, v + n, v)
        bad = (v < 0) | (v >= n)
        live = self._live(path)
        if live is not None:
            bad = bad & live
        if bool(bad.any()):
            raise index_error(e.error, check_message(e, n))
        return v

    def _eval(self, e: Expr, path: tuple = ()) -> torch.Tensor:
        def ev(x):  # children share the path
            return self(x, path)

        td = torch_dtype(e.dtype)
        if isinstance(e, Const):
            v = float("nan") if e.value == "nan" else e.value
            return torch.tensor(v, dtype=td)
        if isinstance(e, Index):
            return torch.as_tensor(symbolic.evaluate(e.expr, self.env)).to(td)
        if isinstance(e, Var):
            return self.variables[e.name]
        if isinstance(e, Load):
            src = self.buffers[e.buffer]
            if src.dim() == 0:
                return src.to(td)
            idx = []
            for comp, size in zip(e.index, src.shape):
                v = ev(comp).to(torch.int64)
                idx.append(v.clamp(0, max(size - 1, 0)))
            idx = torch.broadcast_tensors(*idx)
            return src[tuple(idx)].to(td)
        if isinstance(e, Unary):
            x = ev(e.x)
            if e.op in ("floor", "ceil", "round", "trunc") and not x.dtype.is_floating_point:
                return x
            return _UNARY[e.op](x).to(td)
        if isinstance(e, Binary):
            a, b = ev(e.a), ev(e.b)
            if e.op == "truediv" and not td.is_floating_point:
                raise TypeError("truediv must produce a float")
            return _BINARY[e.op](a, b).to(td)
        if isinstance(e, Where):
            return torch.where(ev(e.cond).to(torch.bool), self(e.a, path + ((e.cond, True),)),
                               self(e.b, path + ((e.cond, False),))).to(td)
        if isinstance(e, CheckedIndex):
            return self._check(e, path)
        if isinstance(e, Cast):
            x = ev(e.x)
            if e.dtype.is_bool:
                return x != 0
            return x.to(td)
        raise TypeError(f"cannot evaluate {type(e).__name__}")


def _grid(shape: tuple, symbols: tuple, total_rank: int, offset: int) -> dict:
    env = {}
    for k, (sym, n) in enumerate(zip(symbols, shape)):
        view = [1] * total_rank
        view[offset + k] = n
        env[sym] = torch.arange(n).view(view)
    return env


def evaluate_pointwise(node: Pointwise, buffers: dict, env: dict) -> torch.Tensor:
    shape = tuple(int(symbolic.evaluate(d, env)) for d in node.shape)
    local = dict(env)
    local.update(_grid(shape, out_index(len(shape)), len(shape), 0))
    value = Evaluator(buffers, local)(node.body)
    return value.expand(shape).to(torch_dtype(node.dtype)).contiguous()


def evaluate_reduce(node: Reduce, buffers: dict, env: dict) -> torch.Tensor:
    shape = tuple(int(symbolic.evaluate(d, env)) for d in node.shape)
    ranges = tuple(int(symbolic.evaluate(d, env)) for d in node.ranges)
    rank = len(shape) + len(ranges)
    local = dict(env)
    local.update(_grid(shape, out_index(len(shape)), rank, 0))
    local.update(_grid(ranges, red_index(len(ranges)), rank, len(shape)))
    value = Evaluator(buffers, local)(node.body).expand(shape + ranges)
    flat = value.reshape(shape + (math.prod(ranges),))
    m = node.combiner
    if flat.shape[-1] == 0:
        if not m.empty_ok:
            raise RuntimeError(f"{m} over an empty range")
        return torch.full(shape, m.identity(node.dtype), dtype=torch_dtype(node.dtype))
    return m.reduce(flat).to(torch_dtype(node.dtype))


def run_scatter(node: Scatter, buffers: dict, env: dict) -> torch.Tensor:
    """Write the node's values into its target tensor in place (positions outside it are
    skipped) and return the target."""
    target = buffers[node.target]
    space = tuple(int(symbolic.evaluate(d, env)) for d in node.space)
    local = dict(env)
    local.update(_grid(space, out_index(len(space)), len(space), 0))
    ev = Evaluator(buffers, local)
    value = ev(node.body).expand(space).to(target.dtype)
    where = [ev(c).to(torch.int64).expand(space) for c in node.index]
    inside = torch.ones(space, dtype=torch.bool)
    for w, n in zip(where, target.shape):
        inside &= (w >= 0) & (w < n)
    target[tuple(w[inside] for w in where)] = value[inside]
    return target


def resolve_extern_args(obj, buffers: dict, env: dict):
    if isinstance(obj, TensorArg):
        return buffers[obj.name]
    if isinstance(obj, sympy.Basic):
        v = symbolic.evaluate(obj, env)
        return v
    if isinstance(obj, list):
        return [resolve_extern_args(x, buffers, env) for x in obj]
    if isinstance(obj, tuple):
        return tuple(resolve_extern_args(x, buffers, env) for x in obj)
    if isinstance(obj, dict):
        return {k: resolve_extern_args(v, buffers, env) for k, v in obj.items()}
    return obj


_CONSTANT = object()  # marks a resolver's value as known once and for all


def _arg_resolver(obj):
    """(_CONSTANT, value) when `obj` needs nothing from a call, else (None, fn(buffers, env))."""
    if isinstance(obj, TensorArg):
        name = obj.name
        return None, lambda buffers, env: buffers[name]
    if isinstance(obj, sympy.Basic):
        if not obj.free_symbols:
            return _CONSTANT, symbolic.evaluate(obj, {})
        return None, lambda buffers, env: symbolic.evaluate(obj, env)
    if isinstance(obj, (list, tuple, dict)):
        keys = list(obj.keys()) if isinstance(obj, dict) else None
        items = [_arg_resolver(x) for x in (obj.values() if keys is not None else obj)]
        if all(kind is _CONSTANT for kind, _ in items):
            values = [v for _, v in items]
            return _CONSTANT, dict(zip(keys, values)) if keys is not None else type(obj)(values)
        parts = [(kind is _CONSTANT, v) for kind, v in items]
        if keys is not None:
            return None, lambda buffers, env: {k: v if const else v(buffers, env)
                                               for k, (const, v) in zip(keys, parts)}
        kind = type(obj)
        return None, lambda buffers, env: kind([v if const else v(buffers, env) for const, v in parts])
    return _CONSTANT, obj


def _python_binding(target):
    """`torch.convolution` for `aten.convolution.default`: the op's generated Python binding,
    which parses its arguments several microseconds faster than calling the overload through
    its schema (a ResNet call makes fifty such calls). Only for a `default` overload whose
    other overloads are `out=` variants, so the binding cannot pick another computation."""
    packet = getattr(target, "overloadpacket", None)
    if packet is None or getattr(target, "_overloadname", None) != "default" or getattr(target, "namespace", "") != "aten":
        return None
    try:
        others = [name for name in packet.overloads() if name != "default"]
    except Exception:  # noqa: BLE001 - an op without a listing: keep the overload
        return None
    if any(name != "out" and not name.endswith("_out") for name in others):
        return None
    name = packet.__name__
    for module in (torch._C._VariableFunctions, torch._C._nn):
        fn = getattr(module, name, None)
        if fn is not None:
            return fn
    return None


class PreparedExtern:
    """An extern call with its arguments' constant parts (sizes, strides, paddings as sympy
    integers) converted once; a call resolves only its buffers and symbolic sizes, and goes
    through the op's Python binding where one computes the same (`_python_binding`)."""

    def __init__(self, node: Extern):
        self.node = node
        self._args = _arg_resolver(tuple(node.args))
        self._kwargs = _arg_resolver(dict(node.kwargs))
        self._call = _python_binding(node.target) or node.target

    def _invoke(self, args, kwargs):
        if self._call is self.node.target:
            return self._call(*args, **kwargs)
        try:
            return self._call(*args, **kwargs)
        except TypeError:  # the binding parses these arguments otherwise: the overload, from now on
            self._call = self.node.target
            return self._call(*args, **kwargs)

    @staticmethod
    def _value(resolver, buffers, env):
        kind, v = resolver
        return v if kind is _CONSTANT else v(buffers, env)

    def __call__(self, buffers: dict, env: dict):
        node = self.node
        result = self._invoke(self._value(self._args, buffers, env), self._value(self._kwargs, buffers, env))
        if node.binds is not None:
            value = result.item() if isinstance(result, torch.Tensor) else result
            env[node.binds] = env[node.binds.name] = value
        elif not node.multi_output and isinstance(result, torch.Tensor):
            bind_result_sizes(node.shape, result, env)
        return result


def run_extern(node: Extern, buffers: dict, env: dict):
    """Call the extern; sizes its result defines (`nonzero`'s count, an `item()`) are bound
    in `env` for the rest of the graph. A call that writes into an intermediate it was given
    (`passes.inplace_externs`'s `index_put_`; not an input's mutation) writes into a copy here:
    the reference's buffers may be views of others."""
    if not node.mutates and node.args and isinstance(node.args[0], TensorArg) and _writes_first(node.target):
        buffers = dict(buffers)
        buffers[node.args[0].name] = buffers[node.args[0].name].clone()
    return PreparedExtern(node)(buffers, env)


def _writes_first(target) -> bool:
    schema = getattr(target, "_schema", None)
    args = getattr(schema, "arguments", None)
    alias = getattr(args[0], "alias_info", None) if args else None
    return bool(alias is not None and alias.is_write)


def bind_result_sizes(shape, value, env: dict) -> None:
    """Unbound size symbols of `shape` take the sizes of the tensor computed for it."""
    if not isinstance(value, torch.Tensor):
        return
    for d, actual in zip(shape, value.shape):
        if isinstance(d, sympy.Symbol) and d not in env:
            env[d] = env[d.name] = int(actual)


def output_value(out, buffers: dict, env: dict):
    if isinstance(out, str):
        return buffers[out]
    if isinstance(out, sympy.Basic):
        return symbolic.evaluate(out, env)
    return out


def _laid_out(value, strides, env: dict):
    """`value` stored with the strides the graph fixes for it (`Graph.output_strides`), as a
    compiled graph stores it: an op that reads storage (`as_strided`) sees the same memory."""
    if strides is None or not isinstance(value, torch.Tensor) or len(strides) != value.dim():
        return value
    concrete = [int(symbolic.evaluate(s, env)) if isinstance(s, sympy.Basic) else int(s) for s in strides]
    if list(value.stride()) == concrete or value.numel() <= 1:
        return value
    return torch.empty_strided(value.shape, concrete, dtype=value.dtype, device=value.device).copy_(value)


def interpret(graph: Graph, args, env: dict | None = None) -> list:
    """Run `graph` on concrete inputs; returns the outputs in order."""
    env = dict(env or {})
    env.update(bind_symbols(graph, args))
    buffers: dict = {}
    for node in graph.nodes.values():
        if isinstance(node, Input):
            buffers[node.name] = args[node.position]
        elif isinstance(node, ScalarInput):
            buffers[node.name] = torch.tensor(int(args[node.position]))
        elif isinstance(node, Constant):
            buffers[node.name] = node.value
        elif isinstance(node, Pointwise):
            buffers[node.name] = _laid_out(evaluate_pointwise(node, buffers, env), graph.output_strides.get(node.name), env)
        elif isinstance(node, Reduce):
            buffers[node.name] = _laid_out(evaluate_reduce(node, buffers, env), graph.output_strides.get(node.name), env)
        elif isinstance(node, Scatter):
            buffers[node.name] = run_scatter(node, buffers, env)
        elif isinstance(node, Extern):
            buffers[node.name] = run_extern(node, buffers, env)
        elif isinstance(node, ExternResult):
            buffers[node.name] = buffers[node.extern][node.item]
            bind_result_sizes(node.shape, buffers[node.name], env)
        else:
            raise TypeError(f"cannot interpret node {node.name} of kind {type(node).__name__}")
    return [output_value(o, buffers, env) for o in graph.outputs]


__all__ = ["interpret", "run_scatter", "Evaluator", "bind_symbols", "bind_result_sizes", "torch_dtype", "index_symbol"]
