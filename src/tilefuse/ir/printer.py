"""Readable text for expressions and graphs (what `str(graph)` and `explain` show)."""
from __future__ import annotations

from .expr import Binary, Cast, CheckedIndex, Const, Expr, Index, Load, Unary, Var, Where

_INFIX = {
    "add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%",
    "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
    "logical_and": "&&", "logical_or": "||", "bitwise_and": "&", "bitwise_or": "|",
    "bitwise_xor": "^", "lshift": "<<", "rshift": ">>",
}


def format_expr(e: Expr) -> str:
    if isinstance(e, Const):
        return repr(e.value) if e.dtype.is_float or e.dtype.is_bool else str(e.value)
    if isinstance(e, Index):
        return str(e.expr) if e.dtype.is_int else f"float({e.expr})"
    if isinstance(e, Var):
        return e.name
    if isinstance(e, Load):
        return f"{e.buffer}[{', '.join(format_expr(i) for i in e.index)}]"
    if isinstance(e, Unary):
        if e.op == "neg":
            return f"-({format_expr(e.x)})"
        return f"{e.op}({format_expr(e.x)})"
    if isinstance(e, Binary):
        if e.op in _INFIX:
            return f"({format_expr(e.a)} {_INFIX[e.op]} {format_expr(e.b)})"
        return f"{e.op}({format_expr(e.a)}, {format_expr(e.b)})"
    if isinstance(e, Where):
        return f"where({format_expr(e.cond)}, {format_expr(e.a)}, {format_expr(e.b)})"
    if isinstance(e, Cast):
        return f"{e.dtype}({format_expr(e.x)})"
    if isinstance(e, CheckedIndex):
        bound = f"-{e.size} <= . < {e.size}" if e.wrap else f"0 <= . < {e.size}"
        return f"checked({format_expr(e.x)}, {bound})"
    return repr(e)


def format_type(dtype, shape) -> str:
    return f"{dtype}[{', '.join(str(d) for d in shape)}]"


def format_node(node) -> str:
    from .graph import Constant, Extern, ExternResult, Input, Pointwise, Reduce, ScalarInput, Scatter

    head = f"{node.name}: {format_type(node.dtype, node.shape)}"
    if isinstance(node, Pointwise):
        return f"{head} = {format_expr(node.body)}"
    if isinstance(node, Reduce):
        ranges = ", ".join(f"r{k}<{n}" for k, n in enumerate(node.ranges))
        return f"{head} = {node.combiner}[{ranges}]({format_expr(node.body)})"
    if isinstance(node, Scatter):
        where = ", ".join(format_expr(c) for c in node.index)
        space = ", ".join(str(d) for d in node.space)
        return f"{head} = {node.target} with [{where}] = {format_expr(node.body)} for i in [{space}]  (in place)"
    if isinstance(node, Extern):
        return f"{head} = extern {node.target_name}(...)  # {node.reason}"
    if isinstance(node, ExternResult):
        return f"{head} = {node.extern}[{node.item}]"
    if isinstance(node, ScalarInput):
        return f"{node.name}: int = {node.symbol}"
    if isinstance(node, Input):
        return f"{head}  (input {node.position})"
    if isinstance(node, Constant):
        return f"{head}  (constant)"
    return head


def format_graph(g, origins: bool = True, name: str | None = None) -> str:
    """The graph as text; `origins`: each node's ops and source places as a trailing comment;
    `name`: the name printed instead of the graph's own."""
    from .graph import Input, ScalarInput

    params = ", ".join(
        f"{n.name}: {format_type(n.dtype, n.shape)}" if isinstance(n, Input) else f"{n.name}: int"
        for n in g.inputs
    )
    lines = [f"def {g.name if name is None else name}({params}):"]
    origins = getattr(g, "origins", {}) if origins else {}
    for node in g.nodes.values():
        if isinstance(node, (Input, ScalarInput)):
            continue
        text = format_node(node)
        origin = origins.get(node.name)
        if origin:  # where it came from: `# mean, rsqrt  (model.py:42)`
            text += f"{';' if ' # ' in text else '  #'} {origin.comment()}"
        lines.append("  " + text)
    lines.append(f"  return ({', '.join(str(o) for o in g.outputs)})")
    return "\n".join(lines)
