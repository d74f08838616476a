"""A configuration that fits: lower a plan, check its kernels against the target's limits
(`tile.limits`), and while one does not fit, lower it again with a smaller configuration.

The configuration is the one the lowering would use (its rules, a knob such as
`flash_config` or `persistent_reduction_limit`, or a tuned schedule), as a schedule dict;
each step makes it smaller where the violated resource says — pipeline stages down to two
first for shared memory, else the largest block halved, and a persistent row becomes a
looped one.
The kernels that fit are returned with what was replaced and why; the caller decides how
loudly to say it (a warning for a knob, a debug log for the tuner). When even the smallest
configuration does not fit, `LimitError` says so: never a kernel over the limits.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from .flash import _chosen_config, split_factor
from .limits import Violation
from .lower import contraction_rules, pointwise_rules
from .reduction import reduction_rules
from .space import describe

#: halvings and steps before giving up (a 2**20 block reaches 16 in 16)
MAX_STEPS = 40
MIN_BLOCK = 16


class LimitError(RuntimeError):
    """No configuration of a plan fits its target's limits."""


@dataclass
class Fitted:
    kernels: list
    schedule: dict | None  # the schedule the kernels were lowered with
    replaced: dict | None = None  # the configuration that did not fit (None: the first one fit)
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
        current = current_config(graph, plan, options)
        if first is None:
            first, first_violation = current, found
        smaller = shrink(plan, current, found.resource, options)
        if smaller is None:
            break
        options = replace(options, schedule=smaller)
    raise LimitError(f"{plan.name}: no configuration fits the target: {first_violation}")


def current_config(graph, plan, options) -> dict:
    """The whole configuration the lowering uses for `plan` under `options`."""
    sch = dict(options.schedule or {})
    if plan.kind == "flash":
        cfg = dict(zip(("BLOCK_M", "BLOCK_N", "warps", "stages"), _chosen_config(graph, plan, options)))
        cfg["split"] = split_factor(graph, plan, options)
        return cfg
    if plan.kind == "reduction":
        cfg = reduction_rules(plan, options)
    elif plan.kind == "contraction":
        cfg = contraction_rules(graph, plan, options)
    else:
        cfg = pointwise_rules(plan, options)
    cfg.update(sch)
    return cfg


def _halved(cfg: dict, keys, floor: int = MIN_BLOCK) -> dict | None:
    """`cfg` with the largest of `keys` above `floor` halved (None: all at the floor)."""
    key = max((k for k in keys if cfg.get(k, 0) > floor), key=lambda k: cfg[k], default=None)
    return None if key is None else {**cfg, key: cfg[key] // 2}


def shrink(plan, cfg: dict, resource: str, options) -> dict | None:
    """The next smaller configuration of `plan` after `cfg` exceeded `resource`, or None."""
    if resource == "warps":
        warps = cfg.get("warps", 1)
        low = 1 << (max(1, warps).bit_length() - 1)  # a power of two at most `warps`
        return {**cfg, "warps": min(low, 32)} if low != warps or warps > 32 else None
    if plan.kind in ("flash", "contraction"):
        stages = cfg.get("stages", 1)
        if resource == "shared memory" and stages > 2:  # two stages still overlap loads with the dot
            return {**cfg, "stages": stages - 1}
        blocks = ("BLOCK_M", "BLOCK_N") if plan.kind == "flash" else ("BLOCK_M", "BLOCK_N", "BLOCK_K")
        return _halved(cfg, blocks) or ({**cfg, "stages": stages - 1} if stages > 1 else None)
    if plan.kind == "reduction":
        if cfg.get("XBLOCK", 1) > 1:
            return {**cfg, "XBLOCK": cfg["XBLOCK"] // 2}
        if cfg.get("persistent"):  # the row walked in tiles instead of held whole
            looped = reduction_rules(plan, replace(options, persistent_reduction_limit=0, schedule=None))
            return {**looped, "warps": min(cfg.get("warps", 1), looped["warps"])} | {"persistent": False}
        smaller = _halved(cfg, ("RBLOCK",))
        return _warps_within(smaller, "RBLOCK") if smaller else None
    smaller = _halved(cfg, ("XBLOCK",), floor=1)
    return _warps_within(smaller, "XBLOCK") if smaller else None


def _warps_within(cfg: dict, block: str) -> dict:
    """No more warps than the block has rows of 32 lanes."""
    return {**cfg, "warps": max(1, min(cfg.get("warps", 1), cfg[block] // 32))}


__all__ = ["fit_kernels", "Fitted", "LimitError", "current_config", "shrink"]
