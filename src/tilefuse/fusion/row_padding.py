"""Padded rows for the products a library may run on a GPU.

cuBLAS chooses its fast Hopper kernels (TMA loads and stores, 16-byte vectors) only when every
leading dimension holds a multiple of 16 bytes. A product whose rows are not — GPT-2's head,
N = 50257 bf16 logits per row — runs in an old, 7× slower kernel: 6.6 ms in eager on an H200
against 0.86 ms with N padded to 50264. Inductor's `pad_mm` copies the weight into a padded
buffer on every call and returns the logits with padded rows.

Here the product's output buffer gets rows padded to 16 bytes (strides `(N', 1)` with N' the
next multiple) and nothing is copied: the runtime (`runtime.aten_matmul`) computes the first
columns up to the last multiple of 16 bytes in one library call, whose leading dimensions are
all aligned, and the few columns left (at most 7 for bf16) in a second, small one.

The same holds for what a library product reads: an operand computed by a generated kernel
(a language model's logits gradient, written by the loss's backward and read by the head's two
gradient products) gets rows padded too, so the library's calls see aligned leading dimensions
where they would otherwise fall back to the slow kernel and lose the race to the generated one.

Only buffers nobody else fixes are padded: intermediates, and the outputs of an inference
graph (a training graph's outputs are saved for the backward, which was traced with their
eager strides). A buffer an ATen call reads keeps its layout. The generated kernel is still
measured against the library on the padded layout; the padding is a layout, not a decision.
"""
from __future__ import annotations

import sympy

from ..ir.graph import Extern, ExternResult, Graph, Input, Pointwise, Reduce
from ..ir.storage import padded_row, row_padded_strides
from ..ir.symbolic import contiguous_strides
from .matmul_views import matmul_views
from .plan import GraphPlan, PlanKind

def pad_library_rows(graph: Graph, schedule: GraphPlan, free_outputs: bool) -> None:
    """Pad the rows of every product output a GPU library may write (a plain product of a
    contraction plan, or the product part of one with an epilogue) whose rows are not
    16-byte multiples. `free_outputs`: the graph's outputs may take another layout than
    traced (an inference graph)."""
    from .library import split_epilogue

    outputs = set(graph.output_names())
    fixed = {name for n in graph.nodes.values() if isinstance(n, (Extern, ExternResult)) for name in n.inputs()}
    users = None
    for plan in schedule.kernels:
        if plan.kind != PlanKind.CONTRACTION:
            continue
        views = matmul_views(graph, plan)
        if views is None:
            users = users if users is not None else graph.users()
            split = split_epilogue(graph, plan, users)
            views = split.views if split is not None else None
        if views is None or views.batch or tuple(views.order) != tuple(range(len(views.order))):
            continue
        if sympy.sympify(graph[views.out].shape[-1]) == sympy.sympify(views.sizes[-2]):  # (not a reshape splitting rows)
            _pad(graph, schedule, views.out, "writes", fixed, outputs, free_outputs)
        for operand in (views.a, views.b):
            if operand.flat is None and isinstance(graph[operand.buffer], (Pointwise, Reduce)):
                _pad(graph, schedule, operand.buffer, "reads", fixed, outputs, free_outputs)


def _pad(graph: Graph, schedule: GraphPlan, name: str, how: str, fixed: set, outputs: set, free_outputs: bool) -> None:
    """Pad the rows of buffer `name` where they are not 16-byte multiples and nothing else fixes
    its layout (an input, an extern's read, a training graph's output, strides traced for a
    reason of their own)."""
    node = graph[name]
    if isinstance(node, Input) or name in fixed or (name in outputs and not free_outputs) or not node.shape:
        return
    traced = graph.output_strides.get(name)
    if traced is not None and tuple(traced) != tuple(contiguous_strides(node.shape)):
        return  # a layout chosen for a reason of its own (or padded already)
    row = padded_row(node.shape[-1], node.dtype.itemsize)
    if row is None:
        return
    graph.output_strides[name] = row_padded_strides(node.shape, row)
    schedule.decisions.append(f"{name}: rows padded from {node.shape[-1]} to {row} elements, so that a "
                              f"library product {how} 16-byte aligned rows")


__all__ = ["pad_library_rows"]
