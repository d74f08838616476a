"""Kernel plans: the planner's output, the tile layer's input.

One `KernelPlan` is one generated kernel, of a `PlanKind` (pointwise, reduction, contraction,
flash: the key of its kernel family in `tile.registry`). It has a parallel iteration space (`parallel`, the
numel of its outputs' leading part), an optional reduction axis (`reduction`, the extents of
the reduced dims), and ordered stages, each of a `StageKind`:

* `reduce` stages — reductions over the reduction axis, held whole in a tile when the axis
  fits (persistent row) or carried across a loop over tiles; `level` orders dependent ones
  (a reduction that reads another is computed in a later pass over the axis);
* `full` stages — outputs indexed by the reduction axis too (RMSNorm's normalised row),
  computed in the pass after the reductions they read;
* `row` stages — outputs indexed by the parallel space only, computed as soon as the pass
  they need has finished (their `level` is that pass, -1 for none) and readable by later
  stages in registers (LayerNorm's mean feeding its variance);
* `contraction` — a Reduce(sum) of a product computed as a blocked `dot`, with `row` stages
  as its epilogue;
* `scatter` — an in-place indexed write into a graph input (a pointwise kernel over the
  written values whose stores go to data-dependent positions);
* `score` — a flash plan's score tile, computed with a `dot` per tile of keys and never
  stored (`fusion.flash`).

The kinds are `Vocabulary` enums: each member is also its name as a string, so kernel names,
reports, cache keys and stored graphs read the same as they did with plain strings.

A `reduce` stage with a `repair` reads an earlier reduction of the same kernel but can still be
carried in the same pass over the axis: the derived rolling update re-bases its partial sum
whenever the earlier reduction's running value changes (see `fusion.repair`), or, for a body
polynomial in the earlier results, independent moments are carried and combined after the
loop (see `fusion.moments`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..ir.expr import Expr


class Vocabulary(str, enum.Enum):
    """A closed set of names that is also its strings: a member equals, hashes, formats and
    serialises (JSON, cache keys, the explain output, kernel names) as its value, so typing a
    field with it changes no text anything stores or prints."""

    __str__ = str.__str__
    __format__ = str.__format__


class PlanKind(Vocabulary):
    """What a `KernelPlan` computes: the key of its kernel family (`tile.registry`)."""

    POINTWISE = "pointwise"
    REDUCTION = "reduction"
    CONTRACTION = "contraction"
    #: attention-shaped: a score `dot`, dependent reductions over the keys and an output `dot`
    #: (`fusion.flash`)
    FLASH = "flash"


class StageKind(Vocabulary):
    """What one stage of a plan is (see the module's docstring)."""

    REDUCE = "reduce"
    FULL = "full"
    ROW = "row"
    CONTRACTION = "contraction"
    POINTWISE = "pointwise"
    SCATTER = "scatter"
    #: a flash plan's score tile (`S = Q·Kᵀ`, held in registers)
    SCORE = "score"


@dataclass
class Stage:
    node: str
    kind: StageKind
    body: Expr
    level: int = 0
    store: bool = True
    repair: object = None  # fusion.repair.Repair or fusion.moments.MomentRepair: same pass as its producer
    #: a "scatter" stage's target input and the (inlined) position each value is written to
    scatter: tuple | None = None

    def __post_init__(self):
        self.kind = StageKind(self.kind)  # (a plain name is taken, and checked)


@dataclass
class Contraction:
    """A Reduce(sum) of `a * b`: `m_dim`/`n_dim` are output dims that only `a`/`b` read,
    `batch_dims` the rest; `a` and `b` are the factor expressions (prologues included)."""

    a: Expr
    b: Expr
    m_dim: int
    n_dim: int
    batch_dims: tuple


@dataclass
class KernelPlan:
    name: str
    kind: PlanKind
    parallel: object  # sympy numel of the parallel space
    reduction: tuple = ()  # extents of reduced dims (reduction kernels)
    stages: list[Stage] = field(default_factory=list)
    contraction: Contraction | None = None
    notes: list[str] = field(default_factory=list)
    flash: object = None  # fusion.flash.FlashInfo for attention-shaped kernels
    origin: object = None  # ir.origin.Origin: the ops and source lines it computes (`fusion.naming`)
    library: object = None  # fusion.library.ProductChoice: whether a library runs its product (None: undecided)

    def __post_init__(self):
        self.kind = PlanKind(self.kind)  # (a plain name is taken, and checked)

    @property
    def members(self) -> list[str]:
        return [s.node for s in self.stages]

    @property
    def stores(self) -> list[str]:
        return [s.node for s in self.stages if s.store]

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.node == name)

    @property
    def contraction_stage(self) -> Stage:
        """The stage of the plan's product (a flash plan's second product, `P·V`)."""
        return next(s for s in self.stages if s.kind == StageKind.CONTRACTION)


@dataclass
class ExternStep:
    node: str
    reason: str = ""
    label: str = ""  # its name in profiles (`fusion.naming`)


@dataclass
class GraphPlan:
    """The planner's output for one graph: its steps in order, the nodes inlined into them, and
    the decisions made (for `explain`). Not to be confused with a kernel's `tile.schedule.Schedule`."""

    steps: list  # KernelPlan | ExternStep | fusion.library.LibraryCall, in execution order
    inlined: set = field(default_factory=set)
    decisions: list[str] = field(default_factory=list)

    @property
    def kernels(self) -> list[KernelPlan]:
        return [s for s in self.steps if isinstance(s, KernelPlan)]

    def describe(self) -> str:
        lines = []
        for s in self.steps:
            if isinstance(s, KernelPlan):
                parts = ", ".join(f"{st.node}:{st.kind}{'' if st.store else '(reg)'}" for st in s.stages)
                lines.append(f"{s.name} [{s.kind}] {parts}")
                lines.extend(f"    {n}" for n in s.notes)
            else:
                lines.append(f"extern {s.node}: {s.reason}")
        return "\n".join(lines)
