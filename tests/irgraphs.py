"""Build small graph-IR graphs by hand for tests below the frontend."""
from __future__ import annotations

import sympy
import torch

from tilefuse.frontend.context import LoweringContext
from tilefuse.frontend.values import BufferValue
from tilefuse.ir import dtypes as dt
from tilefuse.ir.graph import Graph, Input


class GraphBuilder:
    def __init__(self, name="g"):
        self.graph = Graph(name=name)
        self.ctx = LoweringContext(self.graph)

    def input(self, name, shape, dtype=dt.float32, strides=None):
        """`strides`: the layout known at compile time ("contiguous" or a tuple), as a captured
        graph has it; None reads the strides at run time."""
        shape = tuple(sympy.sympify(d) for d in shape)
        if strides == "contiguous":
            from tilefuse.ir.symbolic import contiguous_strides
            strides = contiguous_strides(shape)
        elif strides is not None:
            strides = tuple(sympy.sympify(s) for s in strides)
        node = Input(name, dtype, shape, position=len(self.graph.inputs), strides=strides)
        self.graph.add(node)
        self.graph.inputs.append(node)
        return BufferValue(name, dtype, shape)

    def bf16_product(self, m, k, n):
        """`a @ b` of two bf16 inputs `a` (m, k) and `b` (k, n), accumulated in fp32, rounded to
        bf16: a plain product as the frontend lowers `torch.mm`."""
        from tilefuse.ir.expr import cast

        a, b = self.input("a", (m, k), dt.bfloat16), self.input("b", (k, n), dt.bfloat16)
        return self.ctx.reduce((m, n), (k,), "sum",
                               lambda i, r: cast(a.load((i[0], r[0])), dt.float32) * cast(b.load((r[0], i[1])), dt.float32),
                               dt.bfloat16)

    def output(self, *values):
        self.graph.outputs = [self.ctx.realize(v) for v in values]
        return self.graph


def run_compiled(graph, args):
    from tilefuse.compiler import compile_ir
    from tilefuse.config import config

    with config.patch(target="interpret"):
        compiled, report = compile_ir(graph, torch.device("cpu"))
        return compiled(*args), report
