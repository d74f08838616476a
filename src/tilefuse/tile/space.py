"""Schedule spaces: the knobs a lowering exposes for tuning, declared next to the kernel.

A kernel family that can be tuned declares its space (`KernelFamily.space`, a
`<kind>_space(graph, plan, options)` function beside its lowering) as a `ScheduleSpace`: named
knobs with their candidate values, the schedule its fixed rules would choose
(`default`), and a validity check (shared memory, registers, sizes).
Each configuration is a `Schedule` (`tile.schedule`). The tuner (`tune/`) ranks and measures
them; the chosen one reaches the lowering as `LoweringOptions.schedule`, which overrides its
rules knob by knob. The helpers at the end shrink a schedule that does not fit its target
(`tile.fit`, `KernelFamily.shrink`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

from ..fusion.plan import PlanKind
from .schedule import Schedule


@dataclass
class ScheduleSpace:
    kind: str  # "contraction" | "flash" | "memory"
    knobs: dict  # knob -> tuple of candidate values, in a stable order
    default: Schedule  # the lowering's rule-based choice
    sizes: dict = field(default_factory=dict)  # static problem sizes the cost model reads (M, N, K, ...)
    itemsize: int = 2  # bytes per element of the dot operands
    valid: Callable[[Schedule], bool] | None = None
    #: knobs that switch between kinds of kernel (a library call, a persistent program, a row
    #: held whole or looped): the tuner measures the best-predicted schedule of each of
    #: their values, since the cost model cannot rank such alternatives reliably
    families: tuple = ()
    #: the plan kind whose family declared the space (`tile.registry`): its cost prices it.
    #: (`kind` names the cost class — "memory", "contraction", "flash" — that the tuning
    #: budget and the tuning cache's records go by.)
    plan_kind: PlanKind | None = None

    #: `schedules()`, worked out once (a space is not changed once declared; the tuner asks
    #: for its schedules several times per plan)
    _schedules: list | None = field(default=None, init=False, repr=False, compare=False)
    #: the cost model's ranking of them, with the ceilings it was ranked under (`tune.cost.rank`)
    ranking: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        self.default = Schedule(self.default)  # (a plain dict is taken)

    def schedules(self) -> list[Schedule]:
        """Every valid schedule, the default first."""
        if self._schedules is None:
            out = [self.default]
            names = list(self.knobs)
            for values in itertools.product(*(self.knobs[n] for n in names)):
                schedule = Schedule(zip(names, values))
                if schedule != self.default and (self.valid is None or self.valid(schedule)):
                    out.append(schedule)
            self._schedules = out
        return list(self._schedules)

    def __len__(self) -> int:
        return len(self.schedules())


def describe(schedule) -> str:
    return ",".join(f"{k}={v}" for k, v in schedule.items())


def memory_bytes(graph, plan):
    """Bytes a memory-bound kernel must move at least: every buffer its stages read (once) and
    every output it stores; None when a size is symbolic."""
    import sympy

    from ..ir.expr import Load, walk

    names = set()
    for st in plan.stages:
        names |= {e.buffer for e in walk(st.body) if isinstance(e, Load)}
    members = {st.node for st in plan.stages}
    total = 0
    for name in (names - members) | {st.node for st in plan.stages if st.store}:
        node = graph.nodes.get(name)
        if node is None:
            continue
        n = sympy.Mul(*node.shape)
        if not sympy.sympify(n).is_Integer:
            return None
        total += int(n) * node.dtype.itemsize
    return total


#: the smallest block a schedule that does not fit is shrunk to (`tile.fit`)
MIN_BLOCK = 16


def halved(schedule: Schedule, keys, floor: int = MIN_BLOCK) -> Schedule | None:
    """`schedule` with the largest of `keys` above `floor` halved (None: all at the floor)."""
    key = max((k for k in keys if schedule.get(k, 0) > floor), key=lambda k: schedule[k], default=None)
    return None if key is None else schedule.replace(**{key: schedule[key] // 2})


def warps_within(schedule: Schedule, block: str) -> Schedule:
    """No more warps than the block has rows of 32 lanes."""
    return schedule.replace(warps=max(1, min(schedule.warps, schedule[block] // 32)))


def shrink_dot_tiles(schedule: Schedule, resource: str, blocks) -> Schedule | None:
    """The next smaller schedule of a pipelined `dot` kernel (contraction, flash): pipeline
    stages down to two first for shared memory, else the largest of `blocks` halved, else one
    stage fewer."""
    stages = schedule.stages
    if resource == "shared memory" and stages > 2:  # two stages still overlap loads with the dot
        return schedule.replace(stages=stages - 1)
    return halved(schedule, blocks) or (schedule.replace(stages=stages - 1) if stages > 1 else None)


#: shared memory one Hopper SM gives a block (bytes; a target's own is in `tile.limits`), and
#: the warps it can hold
SMEM_PER_BLOCK = 227 * 1024
MAX_WARPS_PER_SM = 64

__all__ = ["ScheduleSpace", "Schedule", "describe", "memory_bytes",
           "halved", "warps_within", "shrink_dot_tiles", "MIN_BLOCK",
           "SMEM_PER_BLOCK", "MAX_WARPS_PER_SM"]
