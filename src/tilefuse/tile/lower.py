"""Lowering of kernel plans to tile IR, through the plan's kernel family (`tile.registry`).

* pointwise (`tile.pointwise`): a 1-D tile of XBLOCK elements per program;
* reduction (`tile.reduction`): a [XBLOCK, RBLOCK] tile; the reduction axis held whole or
  walked in RBLOCK steps (a symbolic length: both, chosen at launch by the actual length);
* contraction (`tile.contraction`): a [BLOCK_M, BLOCK_N] output tile per program, a loop over
  K in BLOCK_K steps with `dot`, then the epilogue stages on the accumulator;
* flash (`tile.flash`): one program per block of query rows walking the keys, or a split
  kernel over ranges of keys and its merge.
"""
from __future__ import annotations

from ..fusion.plan import KernelPlan
from ..ir.graph import Graph
from .builder import land
from .common import LoweringOptions, lane_ranges
from .ir import TileKernel
from .registry import family


def lower_plan_kernels(graph: Graph, plan: KernelPlan, options: LoweringOptions) -> list[TileKernel]:
    """The kernels implementing one plan: one, or a split flash kernel and its merge."""
    return family(plan.kind).lower(graph, plan, options)


def schedule_space(graph: Graph, plan: KernelPlan, options: LoweringOptions):
    """The plan's tunable space (None: nothing to tune, the rules decide)."""
    return family(plan.kind).space(graph, plan, options)


def lower_plan(graph: Graph, plan: KernelPlan, options: LoweringOptions) -> TileKernel:
    """The plan's one kernel (a plan lowered to several — a split flash kernel and its merge —
    is an error here: `lower_plan_kernels`)."""
    kernels = lower_plan_kernels(graph, plan, options)
    if len(kernels) != 1:
        raise ValueError(f"{plan.name} lowers to {len(kernels)} kernels ({', '.join(k.name for k in kernels)}): "
                         "use lower_plan_kernels")
    return kernels[0]


__all__ = ["lower_plan", "lower_plan_kernels", "schedule_space", "LoweringOptions", "land", "lane_ranges"]
