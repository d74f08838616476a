"""Pass scheduling inside one reduction kernel: which pass over the reduction axis each stage
runs in, given which dependent reductions carry a rolling update (`fusion.repair`) or a
moment expansion (`fusion.moments`)."""
from __future__ import annotations

from ..ir.expr import Load, walk
from .moments import MomentRepair
from .plan import KernelPlan, StageKind


def schedule_passes(plan: KernelPlan, use_repairs: bool) -> tuple[dict, set]:
    """The pass each stage runs in (rows: the pass after which they are computed; -1 before
    any), and the set of stages carried by a rolling update in their producer's pass."""
    level, repaired, _ = schedule_stages(plan, use_repairs)
    return level, repaired


def schedule_stages(plan: KernelPlan, use_repairs: bool) -> tuple[dict, set, set]:
    """As `schedule_passes`, plus the set of moment-expanded stages that run in the pass of
    their producers: their moments are carried in that pass and combined after its loop, once
    the producers (reductions of the pass, or rows computed after it) are final."""
    members = {s.node: s for s in plan.stages}
    level: dict = {}
    repaired: set = set()
    expanded: set = set()
    for st in plan.stages:
        deps = {e.buffer for e in walk(st.body) if isinstance(e, Load) and e.buffer in level}
        moments = use_repairs and isinstance(st.repair, MomentRepair)
        # a rolling update needs its producer's running value per tile, which an expanded
        # stage only has after the loop
        rolling = (use_repairs and st.repair is not None and not moments
                   and st.repair.producer not in expanded)
        need = -1
        for d in deps:
            dep = members[d]
            if moments and d in st.repair.producers:
                need = max(need, level[d])
            elif dep.kind == StageKind.ROW:
                need = max(need, level[d] + 1 if st.kind != StageKind.ROW else level[d])
            elif st.kind == StageKind.ROW:
                need = max(need, level[d])
            elif rolling and d == st.repair.producer:
                need = max(need, level[d])
            else:
                need = max(need, level[d] + 1)
        level[st.node] = need if st.kind == StageKind.ROW else max(need, 0)
        if rolling and level[st.node] == level.get(st.repair.producer):
            repaired.add(st.node)
        if moments and level[st.node] == max(level[p] for p in st.repair.producers):
            expanded.add(st.node)
    return level, repaired, expanded
