"""Which products a library runs: the decision between ATen's matmul (cuBLAS, MKL) and a
generated kernel, made once per plan after planning.

A contraction plan with nothing fused into it is a plain matrix product over strided views
(`fusion.matmul_views`). For each such plan, the `matmul` option and the target decide:

* `"library"` — ATen's matmul runs it, decided here (`matmul="aten"`; or on a CPU, a product
  of symbolic sizes, or any from `CPU_LIBRARY_MACS` multiply-adds on where the tuner does not
  measure: `autotune=0`);
* `"measured"` — the tuner measures the library against the generated kernel (`matmul="auto"`:
  the contraction space's `impl` knob; on a CPU at the default level a race of two, the rules'
  generated kernel and the library, `tune.tuner.library_race`: which wins depends on the host
  and the dtype — oneDNN's bf16 product has a fixed cost of about 12 µs, MKL's sgemm runs
  AVX2 code on AMD processors);
* `"generated"` — a generated kernel (`matmul="generated"`, not a plain product, or on a CPU
  a product under `CPU_LIBRARY_MACS`).

A GPU plan that is not a plain product but splits (`split_epilogue`) is measured split and
fused under `matmul="auto"`, and runs split under `matmul="aten"`.

On a CPU a large product with an epilogue fused after it (a bias, an activation) may be split:
the product runs in ATen and the epilogue becomes a pointwise plan reading its result. Where
the tuner races the two (static sizes, the default level) the split is measured against the
fused kernel (`impl=split`); elsewhere it is decided here (`LibraryCall` followed by that plan
in the schedule). On a GPU the same split — the product,
with a bias folded in where there is one, in cuBLAS; the rest of the epilogue as its own
pointwise kernel — is measured against the fused kernel (`ProductChoice.split`, the
contraction space's `impl=split`): a fused epilogue is free only while the product's main
loop hides it, and with a short K or a costly epilogue (GPT-2's tanh GELU after a K = 768
product) the library's product plus one pass over its result is faster. Under autocast the
bias is an fp32 parameter rounded to bf16 first: the call takes it with that conversion. Where
the plan stores the biased sum itself (a training step saves a GELU's input for its backward),
the library writes that buffer and the epilogue reads it back.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from ..ir.expr import Binary, Cast, Load, subs_index, transform, walk
from .matmul_views import (MatmulViews, biased_product_views, describe, matmul_views, product_views,
                           through_conversions)
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
    #: GPU: the product through the library and the rest as a pointwise plan, measured
    #: against the fused kernel (`impl=split`); None when the plan cannot be split so
    split: "EpilogueSplit | None" = None


@dataclass(frozen=True)
class EpilogueSplit:
    """A contraction plan as a library product (`views`, into `views.out`) and a pointwise
    plan computing the rest of its epilogue from that buffer."""

    views: MatmulViews
    epilogue: KernelPlan


@dataclass
class LibraryCall:
    """A schedule step the library runs: the product part of a plan split on a CPU (the plan's
    epilogue follows as a pointwise plan). `notes` are the plan's, with the split's."""

    name: str
    views: MatmulViews
    notes: list


def choose_product(graph, plan: KernelPlan, matmul: str, cpu: bool, users: dict | None = None,
                   race: bool = False) -> ProductChoice:
    """How `plan` runs under the `matmul` option on a CPU (`cpu`; `race`: the tuner measures a
    large static product against the library) or a GPU (`users`: the graph's readers of each
    buffer, `Graph.users()`, computed once by the caller)."""
    views = matmul_views(graph, plan) if matmul != "generated" else None
    if views is None:
        split = split_epilogue(graph, plan, users) if matmul in ("auto", "aten") and not cpu else None
        if split is None:
            return ProductChoice(GENERATED)
        return ProductChoice(LIBRARY if matmul == "aten" else MEASURED, split=split)
    if matmul == "aten":
        return ProductChoice(LIBRARY, views)
    if cpu and matmul == "auto":
        if not cpu_prefers_library(views):
            return ProductChoice(GENERATED)
        return ProductChoice(MEASURED if race and _static(views) else LIBRARY, views)
    return ProductChoice(MEASURED, views)


def cpu_prefers_library(views: MatmulViews) -> bool:
    """Whether a CPU product is large enough for the library to be worth its call (symbolic
    sizes count as large)."""
    macs = sympy.Mul(*views.sizes)
    return not macs.is_Integer or int(macs) >= CPU_LIBRARY_MACS


def _static(views: MatmulViews) -> bool:
    return sympy.Mul(*views.sizes).is_Integer


def split_epilogue(graph, plan: KernelPlan, users: dict | None = None, biased: bool = True) -> EpilogueSplit | None:
    """The plan as a library product and a pointwise epilogue, or None. The product part is the
    plain product into its own node's buffer (`product_views`), or (`biased`) the product with
    the bias that `addmm`'s decomposition adds, into that sum's node (`biased_product_views`):
    the epilogue's reads of `product + bias` then read that buffer instead, rounded as eager
    rounds `addmm`'s result (a fused kernel keeps the sum in fp32)."""
    if plan.kind != PlanKind.CONTRACTION or len(plan.stages) < 2 or plan.flash is not None:
        return None
    product = graph[plan.stages[0].node]
    views, summed = product_views(graph, plan), None
    if views is None:
        found = biased_product_views(graph, plan, users if users is not None else graph.users()) if biased else None
        if found is None:
            return None
        views, summed = found
    # the library writes the biased sum; a stage storing it (BERT's `gelu(dense(h))` in a
    # training step, which saves the sum for the backward) leaves the epilogue, whose other
    # stages read it back
    epilogue = [st for st in plan.stages[1:] if summed is None or st.node != summed.name]
    names = {st.node for st in epilogue}
    if not epilogue or any(st.kind != StageKind.ROW or {e.buffer for e in walk(st.body) if isinstance(e, Load)} & names
                           for st in epilogue):
        return None
    bodies = [st.body for st in epilogue]
    if summed is not None:
        bodies = [_read_sum(graph, body, product, summed) for body in bodies]
        if any(product.name in {e.buffer for e in walk(body) if isinstance(e, Load)} for body in bodies):
            return None  # the product is read without the bias too: it has no buffer of its own
    stages = [Stage(st.node, StageKind.POINTWISE, body, store=True) for st, body in zip(epilogue, bodies)]
    return EpilogueSplit(views, KernelPlan(f"{plan.name}_epilogue", PlanKind.POINTWISE, sympy.Mul(*product.shape),
                                           stages=stages,
                                           notes=[f"epilogue of {plan.name} after its product {views.out} (ATen)"]))


def _read_sum(graph, body, product, summed):
    """`body` with each `product[idx] + bias(idx)` — the sum node `summed` computes at its own
    index, here at `idx` — replaced by a read of `summed` at `idx`. The bias is compared as
    the plan's bodies hold it, with conversion nodes (autocast's cast of the bias) inlined."""
    inner = through_conversions(graph, summed.body.x if isinstance(summed.body, Cast) else summed.body)
    own = [c.expr for c in next(e for e in walk(inner) if isinstance(e, Load) and e.buffer == product.name).index]

    def fn(e):
        if not (isinstance(e, Binary) and e.op == "add"):
            return None
        for prod, bias in ((e.a, e.b), (e.b, e.a)):
            if isinstance(prod, Load) and prod.buffer == product.name:
                expected = subs_index(inner, {s: c.expr for s, c in zip(own, prod.index)})
                if expected == e or expected == Binary("add", e.b, e.a, e.dtype):
                    return Cast(Load(summed.name, prod.index, summed.dtype), e.dtype)
        return None

    return transform(body, fn)


def epilogue_split(graph, plan: KernelPlan, matmul: str, users: dict | None = None) -> EpilogueSplit | None:
    """The split (`split_epilogue`) of a CPU contraction whose product part is large enough for
    ATen (as `cpu_prefers_library` decides), else None. Epilogue stages that read one another
    stay in the generated kernel (a pointwise plan reads no member)."""
    if matmul != "auto" or matmul_views(graph, plan):
        return None  # (a plain product, reshaped or not, is one ATen call already)
    split = split_epilogue(graph, plan, users, biased=False)  # (a bf16 addmm stays fused on CPUs)
    return split if split is not None and cpu_prefers_library(split.views) else None


def choose_library_calls(graph, schedule: GraphPlan, matmul: str, cpu: bool, race: bool = False) -> None:
    """Decide, for every plan of `schedule`, whether a library runs its product: each plan gets
    its `ProductChoice` (`plan.library`), and on a CPU a plan whose product goes to ATen with
    its epilogue kept generated is replaced by a `LibraryCall` and the epilogue's plan — or,
    where the tuner races (`race`) and the sizes are static, keeps the split as a candidate
    measured against the fused kernel."""
    steps = []
    users = None if cpu else graph.users()  # (once: finding addmm's sum behind an epilogue reads it)
    for step in schedule.steps:
        split = epilogue_split(graph, step, matmul, users) if cpu and isinstance(step, KernelPlan) else None
        if split is not None and race and _static(split.views):
            step.library = ProductChoice(MEASURED, split=split)
            steps.append(step)
            continue
        if split is not None:
            views, epilogue = split.views, split.epilogue
            step.notes.append(f"{step.name}: product through ATen ({describe(views)}), "
                              f"epilogue {epilogue.members} -> {epilogue.name}")
            epilogue.library = choose_product(graph, epilogue, matmul, cpu)
            steps += [LibraryCall(step.name, views, step.notes), epilogue]
            continue
        if isinstance(step, KernelPlan):
            step.library = choose_product(graph, step, matmul, cpu, users, race)
        steps.append(step)
    schedule.steps = steps


__all__ = ["ProductChoice", "EpilogueSplit", "LibraryCall", "choose_product", "split_epilogue", "choose_library_calls",
           "epilogue_split", "cpu_prefers_library", "CPU_LIBRARY_MACS", "LIBRARY", "MEASURED", "GENERATED"]
