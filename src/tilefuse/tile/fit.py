"""A schedule that fits: lower a plan, check its kernels against the target's limits
(`tile.limits`), and while one does not fit, lower it again with a smaller schedule.

The schedule is the one the lowering would use (its rules, a knob such as `flash_config` or
`persistent_reduction_limit`, or a tuned schedule), as a `Schedule` (`tile.schedule`);
each step makes it smaller where the violated resource says, as the plan's kernel family
decides (`KernelFamily.shrink`) — pipeline stages down to two first for shared memory, else
the largest block halved, and a persistent row becomes a looped one.
The kernels that fit are returned with what was replaced and why; the caller decides how
loudly to say it (a warning for a knob, a debug log for the tuner). When even the smallest
schedule does not fit, `LimitError` says so: never a kernel over the limits.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from .limits import Violation
from .registry import family
from .schedule import Schedule
from .space import describe

#: halvings and steps before giving up (a 2**20 block reaches 16 in 16)
MAX_STEPS = 40


class LimitError(RuntimeError):
    """No schedule of a plan fits its target's limits."""


@dataclass
class Fitted:
    kernels: list
    schedule: Schedule | None  # the schedule the kernels were lowered with (None: the rules')
    replaced: Schedule | None = None  # the schedule that did not fit (None: the first one fit)
    violation: Violation | None = None  # why it did not

    def describe(self) -> str:
        if self.replaced is None:
            return ""
        v = self.violation
        return (f"{v.kernel} with {describe(self.replaced)}: {v.message}; "
                f"compiled with {describe(self.schedule)} instead")


def fit_kernels(graph, plan, options, check: Callable, lower: Callable) -> Fitted:
    """`lower(graph, plan, options)` → kernels, each `check(kernel)` → a Violation or None."""
    notes = list(plan.notes)
    first = first_violation = None
    for _ in range(MAX_STEPS):
        plan.notes[:] = notes  # each lowering annotates the plan: keep only the last one's notes
        kernels = lower(graph, plan, options)
        found = next((v for v in map(check, kernels) if v is not None), None)
        if found is None:
            return Fitted(kernels, options.schedule, first, first_violation)
        current = current_schedule(graph, plan, options)
        if first is None:
            first, first_violation = current, found
        smaller = shrink(plan, current, found.resource, options)
        if smaller is None:
            break
        options = replace(options, schedule=smaller)
    raise LimitError(f"{plan.name}: no configuration fits the target: {first_violation}")


def current_schedule(graph, plan, options) -> Schedule:
    """The whole schedule the lowering uses for `plan` under `options`."""
    return family(plan.kind).schedule(graph, plan, options)


def shrink(plan, schedule: Schedule, resource: str, options) -> Schedule | None:
    """The next smaller schedule of `plan` after `schedule` exceeded `resource`, or None: too
    many warps is every family's case (a power of two, at most 32), the rest the family's."""
    if resource == "warps":
        warps = schedule.warps
        low = 1 << (max(1, warps).bit_length() - 1)  # a power of two at most `warps`
        return schedule.replace(warps=min(low, 32)) if low != warps or warps > 32 else None
    return family(plan.kind).shrink(plan, schedule, resource, options)


__all__ = ["fit_kernels", "Fitted", "LimitError", "current_schedule", "shrink"]
