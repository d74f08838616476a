"""Pass scheduling inside one reduction kernel: which pass over the reduction axis each stage
runs in, given which dependent reductions carry a rolling update."""
from __future__ import annotations

from ..ir.expr import Load, walk
from .plan import KernelPlan


def schedule_passes(plan: KernelPlan, use_repairs: bool) -> tuple[dict, set]:
    """The pass each stage runs in (rows: the pass after which they are computed; -1 before
    any), and the set of repaired stages that actually share their producer's pass."""
    members = {s.node: s for s in plan.stages}
    level: dict = {}
    repaired: set = set()
    for st in plan.stages:
        deps = {e.buffer for e in walk(st.body) if isinstance(e, Load) and e.buffer in level}
        need = -1
        for d in deps:
            dep = members[d]
            if dep.kind == "row":
                need = max(need, level[d] + 1 if st.kind != "row" else level[d])
            elif st.kind == "row":
                need = max(need, level[d])
            elif use_repairs and st.repair is not None and d == st.repair.producer:
                need = max(need, level[d])
            else:
                need = max(need, level[d] + 1)
        level[st.node] = need if st.kind == "row" else max(need, 0)
        if st.repair is not None and use_repairs and level[st.node] == level.get(st.repair.producer):
            repaired.add(st.node)
    return level, repaired
