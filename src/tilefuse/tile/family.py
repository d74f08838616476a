"""The kernel-family interface: what one kind of kernel plan supplies to the stages after
planning.

A family (`tile.pointwise`, `tile.reduction`, `tile.contraction`, `tile.flash`) serves the
plans of one `KernelPlan.kind` and exports one `KernelFamily` value, `FAMILY`; `tile.registry`
finds it by the plan's kind. The lowering (`tile.lower`), the fitting to a target's limits
(`tile.fit`), the tuner (`tune.tuner`) and the cost model (`tune.cost`) ask the family instead
of testing the kind themselves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..fusion.plan import PlanKind


@dataclass(frozen=True)
class KernelFamily:
    #: the `KernelPlan.kind` this family lowers
    kind: PlanKind
    #: `(graph, plan, options)` → the plan's tile kernels (one, or a split kernel and its merge)
    lower: Callable
    #: `(graph, plan, options)` → the plan's `ScheduleSpace` (None: nothing to tune)
    space: Callable
    #: `(graph, plan, options)` → the whole `Schedule` the lowering uses under `options` (its
    #: rules, a knob, or `options.schedule` over them: what the lowering itself reads, `tile.fit`)
    schedule: Callable
    #: `(plan, schedule, resource, options)` → the next smaller schedule after `schedule`
    #: exceeded the target's `resource` ("shared memory", "elements", ...), or None (`tile.fit`;
    #: too many warps is every family's case, handled there)
    shrink: Callable
    #: `(space, schedule, ceilings)` → predicted seconds of one launch (`tune.cost.predict`; the
    #: ceilings are a `tune.cost.Ceilings`)
    cost: Callable
    #: whether the tuner measures this family's C++ kernels (its knobs mean something on a CPU)
    tuned_on_cpu: bool = True


__all__ = ["KernelFamily"]
