"""FX graph (core ATen, after AOTAutograd) → graph IR.

Walks the FX nodes in order. Tensors become `TensorValue`s, SymInts become sympy
expressions, registered ops call their lowering, and anything else becomes an `Extern`.
Python arithmetic on sizes (`sym_size`, `operator.mul`, `sym_float`, ...) is evaluated
symbolically.
"""
from __future__ import annotations

import math
import operator

import sympy
import torch
import torch.fx

from .. import logs
from ..ir.graph import Constant, Graph, Input, ScalarInput
from ..ir.symbolic import Floor, floordiv
from ..ir.symbolic import mod as index_mod
from . import lowerings  # noqa: F401  (registers every lowering)
from .context import LoweringContext, ir_dtype, shape_of, strides_of, sym_expr
from .lowerings.random import hoist_seeds
from .origins import tag_new_nodes
from .registry import Unsupported, find_lowering
from .lowerings.common import pointwise, scalar
from .values import BufferValue, TensorValue

_SYM_OPS = {
    operator.add: operator.add, operator.sub: operator.sub, operator.mul: operator.mul,
    operator.truediv: operator.truediv, operator.neg: operator.neg, operator.pow: operator.pow,
    operator.floordiv: floordiv,
    operator.mod: lambda a, b: index_mod(a, b),
    torch.sym_float: lambda a: a, torch.sym_int: Floor,  # (sizes are not negative: truncation is the floor)
    math.sqrt: sympy.sqrt, torch.sym_sqrt if hasattr(torch, "sym_sqrt") else math.sqrt: sympy.sqrt,
    torch.sym_max: sympy.Max, torch.sym_min: sympy.Min,
    operator.eq: sympy.Eq, operator.ne: sympy.Ne, operator.lt: sympy.Lt, operator.le: sympy.Le,
    operator.gt: sympy.Gt, operator.ge: sympy.Ge,
    operator.and_: sympy.And, operator.or_: sympy.Or, operator.not_: sympy.Not,
    getattr(torch, "sym_not", operator.not_): sympy.Not,
    getattr(torch, "sym_ite", operator.truth): lambda c, a, b: sympy.Piecewise((a, c), (b, True)),
}


class LoweringError(RuntimeError):
    pass


def _is_sym_or_number(v) -> bool:
    return isinstance(v, (int, float, bool, sympy.Basic))


def lower_fx(gm: torch.fx.GraphModule, name: str = "graph") -> Graph:
    from .reinplace import reinplace_input_scatters

    if reinplace_input_scatters(gm):
        logs.log("graph", "%s: scatters into inputs written in place", name)
    graph = Graph(name=name)
    ctx = LoweringContext(graph)
    env: dict = {}
    position = 0

    def arg(a):
        if isinstance(a, torch.fx.Node):
            return env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(arg(x) for x in a)
        if isinstance(a, dict):
            return {k: arg(v) for k, v in a.items()}
        return sym_expr(a)

    for node in gm.graph.nodes:
        meta = node.meta.get("val")
        if node.op == "placeholder":
            if isinstance(meta, torch.Tensor):
                strides = strides_of(meta)
                inp = Input(node.name, ir_dtype(meta.dtype), shape_of(meta), position=position, strides=strides)
                graph.add(inp)
                graph.inputs.append(inp)
                env[node] = BufferValue(inp.name, inp.dtype, inp.shape)
            else:
                sym = sym_expr(meta) if meta is not None else None
                inp = ScalarInput(node.name, ir_dtype(torch.int64), (), position=position,
                                  symbol=sym if isinstance(sym, sympy.Symbol) else None)
                graph.add(inp)
                graph.inputs.append(inp)
                env[node] = sym if isinstance(sym, sympy.Basic) else sympy.Symbol(node.name, integer=True)
            position += 1
        elif node.op == "get_attr":
            value = getattr(gm, node.target)
            if isinstance(value, torch.fx.GraphModule):
                # a higher-order op's subgraph (`torch.cond`'s branches, a `while_loop` body):
                # passed as it is to the op, which runs as an extern
                env[node] = value
                continue
            if not isinstance(value, torch.Tensor):
                raise LoweringError(f"unsupported attribute {node.target} of type {type(value).__name__}")
            number = _scalar_constant(value)
            if number is not None:  # a 0-dim constant (`torch.zeros(())` in a mask): its value, no load
                dtype = ir_dtype(value.dtype)
                env[node] = pointwise(ctx, (), dtype, lambda idx, number=number, dtype=dtype: scalar(number, dtype))
                continue
            c = graph.add(Constant(graph.fresh_name("const"), ir_dtype(value.dtype), shape_of(value), value=value))
            env[node] = BufferValue(c.name, c.dtype, c.shape)
        elif node.op == "call_function":
            before = len(graph.nodes)
            env[node] = _lower_call(ctx, node, arg(node.args), arg(node.kwargs), meta)
            tag_new_nodes(graph, before, node)
        elif node.op == "output":
            outs = node.args[0]
            outs = outs if isinstance(outs, (list, tuple)) else (outs,)
            for o in outs:
                v = arg(o) if o is not None else None
                if isinstance(v, TensorValue):
                    before = len(graph.nodes)
                    name = ctx.realize(v)
                    if isinstance(o, torch.fx.Node):  # a view's copy: the view op's origin
                        tag_new_nodes(graph, before, o)
                    meta_val = o.meta.get("val") if isinstance(o, torch.fx.Node) else None
                    wanted = strides_of(meta_val) if isinstance(meta_val, torch.Tensor) else None
                    held = graph.output_strides.get(name)
                    if wanted is not None and held is not None and not _same_layout(graph.nodes[name].shape, held, wanted):
                        # one value returned in two layouts (a clone folded into its source, each
                        # the base of a view the caller reads by its traced strides): a copy
                        before = len(graph.nodes)
                        source = BufferValue(name, v.dtype, v.shape)
                        name = ctx.pointwise(v.shape, v.dtype, source.load).name
                        if isinstance(o, torch.fx.Node):
                            tag_new_nodes(graph, before, o)
                        held = None
                    graph.outputs.append(name)
                    if wanted is not None and held is None:
                        graph.output_strides[name] = wanted
                else:
                    graph.outputs.append(v)
        else:
            raise LoweringError(f"unsupported FX node kind {node.op} ({node.name})")
    hoist_seeds(ctx)
    logs.log("graph", "lowered graph:\n%s", graph)
    return graph


def _same_layout(shape, a, b) -> bool:
    """Whether two stride tuples lay out `shape` alike (strides of size-1 dims do not matter)."""
    if len(a) != len(b) or len(a) != len(shape):
        return False
    return all(d == 1 or sympy.simplify(sympy.sympify(x) - sympy.sympify(y)) == 0 for d, x, y in zip(shape, a, b))


def _lower_call(ctx: LoweringContext, node: torch.fx.Node, args, kwargs, meta):
    target = node.target
    if target is operator.getitem:
        return args[0][args[1]]
    if target in _SYM_OPS and all(_is_sym_or_number(a) for a in args):
        return sympy.sympify(_SYM_OPS[target](*[sympy.sympify(a) for a in args]))
    if target is getattr(torch, "sym_sum", None) and all(_is_sym_or_number(a) for a in args[0]):
        return sympy.Add(*[sympy.sympify(a) for a in args[0]])  # Dynamo's n-ary size sum (cat of symbolic sizes)
    if (isinstance(meta, (torch.SymInt, torch.SymFloat, torch.SymBool)) and not isinstance(sym_expr(meta), sympy.Symbol)
            and all(_is_sym_or_number(a) for a in args) and not kwargs):
        # other Python arithmetic on sizes (math.trunc / floor / ceil of a SymFloat, as
        # interpolate's output size): PyTorch's metadata already holds it over the input sizes
        return sym_expr(meta)
    if isinstance(target, torch._ops.OpOverload) and target.name().startswith("aten::sym_"):
        # aten.sym_size / sym_stride / sym_numel: the answer is already in the metadata
        return sym_expr(meta)
    ctx.current_meta = meta
    ctx.current_target = target
    ctx.current_node = node
    fn = find_lowering(target)
    reason = "no tilefuse lowering"
    opaque = _opaque_values(args, kwargs, meta)
    if opaque:  # kernels never compute on complex or float8 values
        fn, reason = None, f"{opaque} values run in ATen"
    if fn is not None:
        try:
            unbound = _unbound_sizes(ctx.graph, meta)
            if unbound:
                raise Unsupported(f"its output size {', '.join(sorted(unbound))} is computed by no earlier step "
                                  f"(ATen's result binds it)")
            out = fn(ctx, *args, **kwargs)
            logs.log("graph", "%s -> %s", target, _describe(out))
            return out
        except Unsupported as e:
            reason = f"lowering declined: {e}"
    if meta is None:
        # run-time checks (asserts, range constraints) have no value to compute
        logs.log("graph", "%s returns nothing: dropped", target)
        return None
    if isinstance(meta, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        sym = sym_expr(meta)
        if isinstance(sym, sympy.Symbol):  # a data-dependent scalar (`item()`): bound at run time
            ctx.extern(target, args, kwargs, reason, binds=sym)
            return sym
    if not isinstance(meta, (torch.Tensor, list, tuple)):
        raise LoweringError(f"{target}: produces {type(meta).__name__}, which tilefuse cannot represent")
    return ctx.extern(target, args, kwargs, reason)


def _unbound_sizes(graph, meta) -> set:
    """Data-dependent size symbols (`u…`) in the shape of `meta` that nothing in the graph so far
    binds at run time (inputs bind their sizes, externs their results' sizes and `item()`s): a
    kernel could not be launched with them (`x[:t.item()]` has a size related to `t.item()`
    only through PyTorch's shape environment)."""
    metas = meta if isinstance(meta, (tuple, list)) else (meta,)
    wanted = {str(x) for m in metas if isinstance(m, torch.Tensor) for d in shape_of(m)
              for x in sympy.sympify(d).free_symbols if str(x).startswith("u")}
    if not wanted:
        return set()
    bound = set()
    for n in graph.nodes.values():
        for d in getattr(n, "shape", ()):
            bound |= {str(x) for x in sympy.sympify(d).free_symbols}
        for attr in ("binds", "symbol"):
            sym = getattr(n, attr, None)
            if isinstance(sym, sympy.Symbol):
                bound.add(str(sym))
    return wanted - bound


def _opaque_values(args, kwargs, meta) -> str | None:
    """"complex" or "float8" when the op reads or makes such values, else None."""
    def kind(v) -> str | None:
        if isinstance(v, TensorValue):
            return ("complex" if v.dtype.kind == "c" else "float8") if v.dtype.is_opaque else None
        if isinstance(v, torch.Tensor):
            if v.dtype.is_complex:
                return "complex"
            return "float8" if v.dtype.is_floating_point and v.dtype.itemsize == 1 else None
        if isinstance(v, (list, tuple, dict)):
            for x in (v.values() if isinstance(v, dict) else v):
                found = kind(x)
                if found:
                    return found
            return None
        return "complex" if isinstance(v, complex) else None

    return kind(args) or kind(kwargs) or kind(meta)


def _describe(out) -> str:
    if isinstance(out, BufferValue):
        return out.name
    if isinstance(out, TensorValue):
        return "view"
    return type(out).__name__


def _scalar_constant(value: torch.Tensor):
    """The number a captured 0-dim constant holds (a real tensor of a real or integer dtype,
    not a parameter), else None."""
    plain = value.dtype.is_floating_point or value.dtype in _PLAIN_INTEGERS
    if value.dim() != 0 or not plain or value.requires_grad:
        return None
    try:
        # (lowering runs in AOTAutograd's fake mode; the constant itself is real)
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            number = value.item()
    except Exception:  # noqa: BLE001 - a fake or meta tensor: its value is unknown, it stays a buffer
        return None
    return number if type(number) in (bool, int, float) else None


_PLAIN_INTEGERS = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
