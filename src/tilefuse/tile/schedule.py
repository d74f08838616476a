"""A schedule: the values of a kernel family's knobs (tiles, warps, pipeline stages, ...) for one
kernel plan, as one immutable value.

A `Schedule` is what a schedule space declares (its default and each configuration,
`tile.space`), what the cost model prices and the search measures (`tune/`), what the tuning
cache stores (`as_dict()`: the record's JSON keeps its format), what a lowering reads from
`LoweringOptions.schedule` over its rules (`schedule_over`), what `tile.fit` shrinks, and where the
launch's warps and pipeline stages come from. It is a read-only mapping from knob names to
values: `schedule["BLOCK_M"]`, `schedule.get("tma", 0)`, `"split" in schedule`; a changed
schedule is a new one (`replace(**changes)`).

Knobs keep the order they were declared in (the order `describe` prints them in); equality and
the hash do not depend on it, and a schedule equals a plain dict of the same knobs.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, init=False, repr=False, eq=False)
class Schedule(Mapping):
    #: (knob, value) pairs, in declaration order, each knob once
    items_: tuple = ()
    # the same as a dict, and the hash once asked for: the tuner ranks thousands of schedules
    # per graph
    _knobs: dict = field(default_factory=dict, compare=False)
    _hash: int | None = field(default=None, compare=False)

    def __init__(self, knobs: Mapping[str, Any] | Iterable[tuple[str, Any]] = (), **more: Any):
        merged = dict(knobs)
        merged.update(more)
        object.__setattr__(self, "items_", tuple(merged.items()))
        object.__setattr__(self, "_knobs", merged)
        object.__setattr__(self, "_hash", None)

    # -- the mapping ---------------------------------------------------------------------------
    def __getitem__(self, knob: str) -> Any:
        return self._knobs[knob]

    def get(self, knob: str, default: Any = None) -> Any:
        return self._knobs.get(knob, default)

    def __contains__(self, knob: object) -> bool:
        return knob in self._knobs

    def __iter__(self) -> Iterator[str]:
        return iter(self._knobs)

    def __len__(self) -> int:
        return len(self.items_)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Schedule):
            return self._knobs == other._knobs
        if isinstance(other, Mapping):
            return len(self) == len(other) and self._knobs == dict(other.items())
        return NotImplemented

    def __hash__(self) -> int:
        if self._hash is None:
            object.__setattr__(self, "_hash", hash(frozenset(self.items_)))
        return self._hash

    def __reduce__(self):  # (pickled by its knobs; the dict and the hash are rebuilt)
        return (Schedule, (self.items_,))

    def __repr__(self) -> str:
        return f"Schedule({', '.join(f'{k}={v!r}' for k, v in self.items_)})"

    # -- new schedules -------------------------------------------------------------------------
    def replace(self, **changes: Any) -> "Schedule":
        """This schedule with `changes` (a knob it lacks is added after the others)."""
        return Schedule(self, **changes) if changes else self

    def pick(self, knobs: Iterable[str]) -> "Schedule":
        """The schedule of `knobs` only (in their order)."""
        return Schedule((k, self[k]) for k in knobs)

    def without(self, *knobs: str) -> "Schedule":
        return Schedule((k, v) for k, v in self.items_ if k not in knobs)

    # -- what the launch and the tuning cache read ---------------------------------------------
    @property
    def warps(self) -> int:
        """Warps per program (`num_warps` of the launch; 1 where the family has no such knob)."""
        return self.get("warps", 1)

    @property
    def stages(self) -> int:
        """Software-pipeline stages of the K loop (`num_stages` of the launch; 1: none)."""
        return self.get("stages", 1)

    def as_dict(self) -> dict:
        """The knobs as a plain dict (the tuning cache's JSON record)."""
        return dict(self._knobs)

    def describe(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.items_)


def schedule_over(rules: Mapping[str, Any], schedule: Mapping[str, Any] | None) -> Schedule:
    """`rules` with the knobs of `schedule` (a tuned or fitted choice; None: the rules alone) over
    them: the whole schedule a lowering uses."""
    base = rules if isinstance(rules, Schedule) else Schedule(rules)
    return base.replace(**schedule) if schedule else base


__all__ = ["Schedule", "schedule_over"]
