"""Schedule spaces: the knobs a lowering exposes for tuning, declared next to the kernel.

A kernel family that can be tuned declares its space (`KernelFamily.space`, a
`<kind>_space(graph, plan, options)` function beside its lowering) as a `ScheduleSpace`: named
knobs with their candidate values, the configuration its fixed rules would choose
(`default`), and a validity check (shared memory, registers, sizes).
The tuner (`tune/`) ranks and measures configurations; the chosen one reaches the lowering as
`LoweringOptions.schedule`, which overrides its rules knob by knob. The helpers at the end
shrink a configuration that does not fit its target (`tile.fit`, `KernelFamily.shrink`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

from ..fusion.plan import PlanKind


@dataclass
class ScheduleSpace:
    kind: str  # "contraction" | "flash" | "memory"
    knobs: dict  # knob -> tuple of candidate values, in a stable order
    default: dict  # the lowering's rule-based choice
    sizes: dict = field(default_factory=dict)  # static problem sizes the cost model reads (M, N, K, ...)
    itemsize: int = 2  # bytes per element of the dot operands
    valid: Callable[[dict], bool] | None = None
    #: knobs that switch between kinds of kernel (a library call, a persistent program, a row
    #: held whole or looped): the tuner measures the best-predicted configuration of each of
    #: their values, since the cost model cannot rank such alternatives reliably
    families: tuple = ()
    #: the plan kind whose family declared the space (`tile.registry`): its cost prices it.
    #: (`kind` names the cost class — "memory", "contraction", "flash" — that the tuning
    #: budget and the tuning cache's records go by.)
    plan_kind: PlanKind | None = None

    def configs(self) -> list[dict]:
        """Every valid configuration, the default first."""
        out = [dict(self.default)]
        names = list(self.knobs)
        for values in itertools.product(*(self.knobs[n] for n in names)):
            cfg = dict(zip(names, values))
            if cfg != self.default and (self.valid is None or self.valid(cfg)):
                out.append(cfg)
        return out

    def __len__(self) -> int:
        return len(self.configs())


def describe(cfg: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items())


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


#: the smallest block a configuration that does not fit is shrunk to (`tile.fit`)
MIN_BLOCK = 16


def halved(cfg: dict, keys, floor: int = MIN_BLOCK) -> dict | None:
    """`cfg` with the largest of `keys` above `floor` halved (None: all at the floor)."""
    key = max((k for k in keys if cfg.get(k, 0) > floor), key=lambda k: cfg[k], default=None)
    return None if key is None else {**cfg, key: cfg[key] // 2}


def warps_within(cfg: dict, block: str) -> dict:
    """No more warps than the block has rows of 32 lanes."""
    return {**cfg, "warps": max(1, min(cfg.get("warps", 1), cfg[block] // 32))}


def shrink_dot_tiles(cfg: dict, resource: str, blocks) -> dict | None:
    """The next smaller configuration of a pipelined `dot` kernel (contraction, flash): pipeline
    stages down to two first for shared memory, else the largest of `blocks` halved, else one
    stage fewer."""
    stages = cfg.get("stages", 1)
    if resource == "shared memory" and stages > 2:  # two stages still overlap loads with the dot
        return {**cfg, "stages": stages - 1}
    return halved(cfg, blocks) or ({**cfg, "stages": stages - 1} if stages > 1 else None)


#: shared memory one Hopper SM gives a block (bytes; a target's own is in `tile.limits`), and
#: the warps it can hold
SMEM_PER_BLOCK = 227 * 1024
MAX_WARPS_PER_SM = 64

__all__ = ["ScheduleSpace", "describe", "memory_bytes", "halved", "warps_within", "shrink_dot_tiles", "MIN_BLOCK",
           "SMEM_PER_BLOCK", "MAX_WARPS_PER_SM"]
