"""Which products a library runs: the decision between ATen's matmul (cuBLAS, MKL) and a
generated kernel, made once per plan after planning.

A contraction plan with nothing fused into it is a plain matrix product over strided views
(`fusion.matmul_views`). For each such plan, the `matmul` option and the target decide:

* `"library"` — ATen's matmul runs it, decided here (`matmul="aten"`; or on a CPU, where MKL or
  OpenBLAS beats a generated kernel from `CPU_LIBRARY_MACS` multiply-adds on, `matmul="auto"`);
* `"measured"` — the tuner measures the library against the generated kernel (`matmul="auto"`
  on a GPU: the contraction space's `impl` knob);
* `"generated"` — a generated kernel (`matmul="generated"`, or not a plain product).

On a CPU a large product with an epilogue fused after it (a bias, an activation) is split:
the product runs in ATen and the epilogue becomes a pointwise plan reading its result
(`LibraryCall` followed by that plan in the schedule).
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from ..ir.expr import Load, walk
from .matmul_views import MatmulViews, describe, matmul_views, product_views
from .plan import KernelPlan, PlanKind, GraphPlan, Stage, StageKind

#: plain matmuls (nothing fused) at least this many multiply-adds run in ATen's matmul on CPU
#: (MKL/OpenBLAS beats a generated kernel there); smaller ones, and any with a fused prologue or
#: epilogue, are generated. Symbolic sizes count as large.
CPU_LIBRARY_MACS = 32 ** 3

LIBRARY, MEASURED, GENERATED = "library", "measured", "generated"


@dataclass(frozen=True)
class ProductChoice:
    """How a plan's product runs: `how` is "library", "measured" or "generated"; `views` the
    plan as a library call (None when it is not a plain product)."""

    how: str
    views: MatmulViews | None = None


@dataclass
class LibraryCall:
    """A schedule step the library runs: the product part of a plan split on a CPU (the plan's
    epilogue follows as a pointwise plan). `notes` are the plan's, with the split's."""

    name: str
    views: MatmulViews
    notes: list


def choose_product(graph, plan: KernelPlan, matmul: str, cpu: bool) -> ProductChoice:
    """How `plan` runs under the `matmul` option on a CPU (`cpu`) or a GPU."""
    views = matmul_views(graph, plan) if matmul != "generated" else None
    if views is None:
        return ProductChoice(GENERATED)
    if matmul == "aten" or (cpu and matmul == "auto" and cpu_prefers_library(views)):
        return ProductChoice(LIBRARY, views)
    return ProductChoice(MEASURED, views)


def cpu_prefers_library(views: MatmulViews) -> bool:
    macs = sympy.Mul(*views.sizes)
    return not macs.is_Integer or int(macs) >= CPU_LIBRARY_MACS


def epilogue_split(graph, plan: KernelPlan, matmul: str) -> tuple | None:
    """(product views, epilogue plan) for a CPU contraction whose product part is a plain matmul
    large enough for ATen (as `cpu_prefers_library` decides) with epilogue stages fused after
    it, else None. The product goes to its own buffer in the node's dtype (the rounding the
    generated kernel applies before its epilogue); the epilogue, whose stages read the product
    at their own position, becomes a pointwise kernel reading that buffer. Epilogue stages that
    read one another stay in the generated kernel (a pointwise plan reads no member)."""
    if matmul != "auto" or plan.kind != PlanKind.CONTRACTION or len(plan.stages) < 2 or plan.flash is not None \
            or matmul_views(graph, plan):
        return None  # (a plain product, reshaped or not, is one ATen call already)
    epilogue = plan.stages[1:]
    names = {st.node for st in epilogue}
    if any(st.kind != StageKind.ROW or {e.buffer for e in walk(st.body) if isinstance(e, Load)} & names for st in epilogue):
        return None
    views = product_views(graph, plan)
    if views is None or not cpu_prefers_library(views):
        return None
    product = graph[plan.stages[0].node]
    stages = [Stage(st.node, StageKind.POINTWISE, st.body, store=True) for st in epilogue]
    return views, KernelPlan(f"{plan.name}_epilogue", PlanKind.POINTWISE, sympy.Mul(*product.shape), stages=stages,
                             notes=[f"epilogue of {plan.name} after its product {product.name} (ATen)"])


def choose_library_calls(graph, schedule: GraphPlan, matmul: str, cpu: bool) -> None:
    """Decide, for every plan of `schedule`, whether a library runs its product: each plan gets
    its `ProductChoice` (`plan.library`), and on a CPU a plan whose product goes to ATen with
    its epilogue kept generated is replaced by a `LibraryCall` and the epilogue's plan."""
    steps = []
    for step in schedule.steps:
        split = epilogue_split(graph, step, matmul) if cpu and isinstance(step, KernelPlan) else None
        if split is not None:
            views, epilogue = split
            step.notes.append(f"{step.name}: product through ATen ({describe(views)}), "
                              f"epilogue {epilogue.members} -> {epilogue.name}")
            epilogue.library = choose_product(graph, epilogue, matmul, cpu)
            steps += [LibraryCall(step.name, views, step.notes), epilogue]
            continue
        if isinstance(step, KernelPlan):
            step.library = choose_product(graph, step, matmul, cpu)
        steps.append(step)
    schedule.steps = steps


__all__ = ["ProductChoice", "LibraryCall", "choose_product", "choose_library_calls", "epilogue_split",
           "cpu_prefers_library", "CPU_LIBRARY_MACS", "LIBRARY", "MEASURED", "GENERATED"]
