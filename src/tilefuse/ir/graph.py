"""Graph IR: tensors defined by index formulas.

A `Graph` has inputs, nodes in topological order, and outputs. Node kinds:

* `Input` / `ScalarInput` / `Constant` — values that come from outside;
* `Pointwise` — element `i` is a scalar expression over index symbols `i0..`;
* `Reduce` — element `i` combines a body over reduction symbols `r0..` with a monoid;
* `Extern` (+ `ExternResult` for multi-output calls) — a library call for what tilefuse does
  not generate.

Views are not nodes: they are index maps already folded into the loads of their consumers.
Shapes are tuples of sympy integers or expressions over size symbols `s0, s1, ...`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import sympy

from .dtypes import DType
from .expr import Expr, buffers_read, format_expr
from .monoid import SUM, Monoid, monoid

Shape = tuple  # tuple[sympy.Expr, ...]


@dataclass(eq=False)
class Node:
    name: str
    dtype: DType
    shape: Shape

    @property
    def rank(self) -> int:
        return len(self.shape)

    def inputs(self) -> set[str]:
        return set()


@dataclass(eq=False)
class Input(Node):
    """A tensor argument of the graph, at position `position` of the call. `strides` (sympy,
    from the capture's metadata, which torch.compile's guards keep true) lets generated code
    fold layouts at compile time; None means "read the strides at run time"."""

    position: int = 0
    strides: tuple | None = None


@dataclass(eq=False)
class ScalarInput(Node):
    """A symbolic integer argument (Dynamo passes SymInts as graph inputs)."""

    position: int = 0
    symbol: sympy.Symbol | None = None


@dataclass(eq=False)
class Constant(Node):
    """A tensor constant captured with the graph (its value is opaque to the IR)."""

    value: Any = None


@dataclass(eq=False)
class Pointwise(Node):
    body: Expr = None

    def inputs(self):
        return buffers_read(self.body)


@dataclass(eq=False)
class Reduce(Node):
    """out[i] = combiner over r in ranges of body(i, r). `body.dtype` is the accumulation
    dtype; the result is cast to `dtype`. argmax/argmin yield the flat index of r. The
    combiner is a `Monoid` (a name given to the constructor is looked up)."""

    ranges: Shape = ()
    combiner: Monoid = SUM
    body: Expr = None

    def __post_init__(self):
        self.combiner = monoid(self.combiner)

    def inputs(self):
        return buffers_read(self.body)

    @property
    def reduction_numel(self):
        return sympy.Mul(*self.ranges) if self.ranges else sympy.Integer(1)


@dataclass(eq=False)
class Scatter(Node):
    """An indexed write into graph input `target`, in place (`cache.index_copy_(2, pos, k)`,
    `x[idx] = v`): for every index i of `space`, `target[index(i)] = body(i)`. Index
    components may be data-dependent (loads); positions outside the target are not written.
    The node's value is the target after the write (its shape and dtype); it writes memory
    that others may read, so it is never dead code."""

    target: str = ""
    space: Shape = ()
    index: tuple = ()
    body: Expr = None
    mutates: bool = True

    def inputs(self):
        found = buffers_read(self.body) | {self.target}
        for c in self.index:
            found |= buffers_read(c)
        return found


@dataclass(frozen=True)
class TensorArg:
    """Placeholder for a tensor argument inside an Extern's args."""

    name: str


@dataclass(eq=False)
class Extern(Node):
    """A call to a library kernel. args/kwargs hold python values, `TensorArg`s and sympy
    expressions (symbolic ints, resolved at run time). `outputs` lists (dtype, shape) per
    result when the call returns several tensors; then `ExternResult` nodes name them."""

    target: Any = None
    target_name: str = ""
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    reason: str = ""
    multi_output: bool = False
    #: a data-dependent size or scalar (an unbacked symbol such as `u0`) the call's result
    #: defines: `item()` of a tensor; bound when the call runs
    binds: Any = None
    #: the call writes into one of its arguments (a graph input): it runs after every other
    #: step, when nothing can still read the input's old value
    mutates: bool = False
    #: the strides the traced call returned (sympy; None: unknown). A hint for choosing the
    #: layout of what reads the result (`fusion.layout`); kernels read the actual strides.
    strides: tuple | None = None

    def inputs(self):
        found: set[str] = set()

        def visit(a):
            if isinstance(a, TensorArg):
                found.add(a.name)
            elif isinstance(a, (list, tuple)):
                for x in a:
                    visit(x)
            elif isinstance(a, dict):
                for x in a.values():
                    visit(x)

        visit(self.args)
        visit(self.kwargs)
        return found


@dataclass(eq=False)
class ExternResult(Node):
    extern: str = ""
    item: int = 0
    strides: tuple | None = None  # as `Extern.strides`, for this result

    def inputs(self):
        return {self.extern}


@dataclass
class Graph:
    inputs: list[Node] = field(default_factory=list)  # Input and ScalarInput, by position
    nodes: dict[str, Node] = field(default_factory=dict)  # every node, topological order
    outputs: list[Any] = field(default_factory=list)  # node names, or python/sympy scalars
    name: str = "graph"
    #: layouts the caller expects for computed outputs (AOTAutograd saves activations with
    #: the strides it traced); others are allocated contiguous
    output_strides: dict = field(default_factory=dict)
    #: node name -> `ir.origin.Origin`: the ATen ops and user source lines a node came from
    origins: dict = field(default_factory=dict)

    def add(self, node: Node) -> Node:
        if node.name in self.nodes:
            raise ValueError(f"duplicate node name {node.name}")
        self.nodes[node.name] = node
        return node

    def expand_nodes(self, replacements: dict) -> None:
        """Replace nodes in place by lists of nodes (name -> [new nodes, in order]), keeping
        the topological order; a new node that comes from the old one's ops takes its origin."""
        nodes = {}
        for name, node in self.nodes.items():
            for new in replacements.get(name, [node]):
                nodes[new.name] = new
                if new.name != name and name in self.origins:
                    self.origins.setdefault(new.name, self.origins[name])
        self.nodes = nodes

    def fresh_name(self, prefix: str = "buf") -> str:
        k = len(self.nodes)
        while f"{prefix}{k}" in self.nodes:
            k += 1
        return f"{prefix}{k}"

    def __getitem__(self, name: str) -> Node:
        return self.nodes[name]

    def output_names(self) -> list[str]:
        return [o for o in self.outputs if isinstance(o, str)]

    def users(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {n: [] for n in self.nodes}
        for node in self.nodes.values():
            for src in node.inputs():
                out[src].append(node.name)
        return out

    def size_symbols(self) -> set[sympy.Symbol]:
        syms: set = set()
        for node in self.nodes.values():
            for d in node.shape:
                syms |= sympy.sympify(d).free_symbols
        return syms

    def computed(self) -> Iterable[Node]:
        return (n for n in self.nodes.values() if isinstance(n, (Pointwise, Reduce, Scatter, Extern, ExternResult)))

    def __str__(self) -> str:
        return format_graph(self)


# ------------------------------------------------------------------------------ text
def format_type(dtype, shape) -> str:
    return f"{dtype}[{', '.join(str(d) for d in shape)}]"


def format_node(node) -> str:
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
