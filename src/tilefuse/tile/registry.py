"""The kernel families by plan kind: `family(plan.kind)` is the one place that maps a kind of
kernel plan to its lowering, schedule space, configuration rules and cost (`tile.family`).

A plan kind without a family is an `UnknownKind` error naming it, never a silent default.
"""
from __future__ import annotations

from ..fusion.plan import PlanKind
from . import contraction, flash, pointwise, reduction
from .family import KernelFamily

#: plan kind -> its family
FAMILIES: dict[PlanKind, KernelFamily] = {f.kind: f for f in (pointwise.FAMILY, reduction.FAMILY, contraction.FAMILY,
                                                         flash.FAMILY)}


class UnknownKind(ValueError):
    """A kernel plan of a kind no family lowers."""


def family(kind: PlanKind) -> KernelFamily:
    """The family that lowers, tunes and prices plans of `kind`."""
    found = FAMILIES.get(kind)
    if found is None:
        raise UnknownKind(f"no kernel family for plan kind {kind!r} (known: {', '.join(sorted(FAMILIES))})")
    return found


__all__ = ["FAMILIES", "UnknownKind", "family", "KernelFamily"]
