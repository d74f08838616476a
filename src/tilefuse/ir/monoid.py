"""The reduction vocabulary: one typed `Monoid` for each way a `Reduce` combines its body.

Every layer asks the monoid instead of comparing names: the IR printer prints its name; the
reference interpreter takes its identity (an empty range), its pairwise `combine` and its
vectorised `reduce`; fusion asks whether it is a sum or a numeric producer it can re-base
on; the tile lowering takes its identity per dtype (the value padding lanes contribute), the
monoid the tile carries it with (`tile`: any/all as max/min over int32 0/1) and whether it
yields an index (`arg`); the backends spell the tile monoids they are handed.

    monoid  identity   combine                                   idempotent  the tile carries it as
    sum     0          a + b                                     no          sum
    prod    1          a * b                                     no          prod
    max     lowest     maximum (NaN wins)                        yes         max
    min     highest    minimum (NaN wins)                        yes         min
    argmax  lowest     (value, index) pairs: the larger value,   yes         argmax
                       NaN largest, the lower index on ties
    argmin  highest    the same with the smaller value           yes         argmin
    any     0 (False)  logical or                                yes         max over int32 0/1
    all     1 (True)   logical and                               yes         min over int32 0/1

"Lowest"/"highest" are -inf/+inf for floats, 0/1 for bool and the integer bounds otherwise
(`dtypes.value_range`). Identities are the Python values the lowerings have always emitted (0,
not 0.0, for a float sum): the tile IR text that kernel dedupe keys on stays as it was.

A frozen dataclass rather than an Enum: a monoid is a record of facts the layers read (fields,
not a branch per member), and the composite monoids the IR is meant to grow — a tuple of
monoids, welford's (count, mean, M2) — are values built from others, which an Enum's closed
member list cannot hold. The named monoids are module constants interned by name:
`monoid("sum") is SUM`, and a copy or a pickle gives the same object back. A monoid never
equals a string: a comparison left over from the string vocabulary is then simply false, so
`tests/ir/test_monoid.py` checks that none is left.

Nothing here imports PyTorch: `combine` and `reduce` call tensor methods on what they are given.
"""
from __future__ import annotations

from dataclasses import dataclass

from .dtypes import DType, int32, value_range


@dataclass(frozen=True, repr=False)
class Monoid:
    name: str
    #: how the identity follows from the dtype: "zero", "one", "lowest" or "highest"
    neutral: str
    #: the tensor method reducing the last axis with PyTorch's semantics (the interpreter)
    reducer: str
    #: combining a value with itself gives it back (max, min, argmax, argmin, any, all)
    idempotent: bool
    #: the IR binary op that combines two values ("" for the arg-reductions, which combine
    #: (value, index) pairs)
    op: str = ""
    #: the strict comparison that makes an operand win ("gt" for max/argmax, "lt" for min/argmin)
    better: str = ""
    #: yields the flat index of the winning element of the range, not a value
    arg: bool = False
    #: combines truth values; the result is `accumulator != 0`
    logical: bool = False
    #: the monoid the tile carries it with when it is not itself (any/all: max/min over 0/1)
    carrier: "Monoid | None" = None
    #: an empty range reduces to the identity (PyTorch refuses max/min/argmax/argmin of nothing)
    empty_ok: bool = True

    # ------------------------------------------------------------------ facts
    @property
    def tile(self) -> "Monoid":
        """The monoid a tile reduction and a carried accumulator combine with."""
        return self.carrier if self.carrier is not None else self

    @property
    def extremum(self) -> bool:
        """max or min: picks one of its operands by comparing them (comparisons drop NaN, so
        it must carry NaN explicitly; `max(c·x) = c·max(x)` for c > 0)."""
        return bool(self.better) and not self.arg

    @property
    def numeric(self) -> bool:
        """Combines numbers into a number of the same kind (sum, prod, max, min): no index,
        no truth value."""
        return not (self.arg or self.logical)

    def identity(self, dtype: DType):
        """The neutral element in `dtype` (for an arg-reduction: of the values it compares)."""
        if self.neutral == "zero":
            return 0
        if self.neutral == "one":
            return 1
        lowest, highest = value_range(dtype)
        return lowest if self.neutral == "lowest" else highest

    def acc_dtype(self, body_dtype: DType) -> DType:
        """The dtype a tile accumulates in: int32 0/1 for truth values, the body's otherwise."""
        return int32 if self.logical else body_dtype

    # ------------------------------------------------------------------ evaluation (tensors)
    def combine(self, a, b):
        """a ⊕ b elementwise on tensors; an arg-reduction combines (value, index) pairs: the
        better value wins, NaN counts as the largest, ties go to the lower index."""
        if not self.arg:
            return getattr(a, self.op)(b)
        (v1, i1), (v2, i2) = a, b
        n1, n2 = v1 != v1, v2 != v2
        wins = (getattr(v2, self.better)(v1) & ~n1) | (n2 & ~n1)
        take = wins | (((v1 == v2) | (n1 & n2)) & (i2 < i1))
        return v2.where(take, v1), i2.where(take, i1)

    def reduce(self, x):
        """x reduced along its last axis with PyTorch's semantics (NaN propagates through
        max/min; argmax/argmin give the first index of the winner)."""
        out = getattr(x, self.reducer)(-1)
        if self.extremum and x.dtype.is_floating_point:
            out = out.masked_fill(x.isnan().any(-1), float("nan"))
        return out

    # ------------------------------------------------------------------ naming
    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"monoid({self.name!r})"

    def __reduce__(self):
        return monoid, (self.name,)

    def __tilefuse_reduce__(self):  # a stored compiled graph names it (`runtime.artifact`) ...
        return (self.name,)

    @classmethod
    def __tilefuse_rebuild__(cls, name):  # ... and gets the interned monoid back
        return monoid(name)


SUM = Monoid("sum", "zero", "sum", idempotent=False, op="add")
PROD = Monoid("prod", "one", "prod", idempotent=False, op="mul")
MAX = Monoid("max", "lowest", "amax", idempotent=True, op="maximum", better="gt", empty_ok=False)
MIN = Monoid("min", "highest", "amin", idempotent=True, op="minimum", better="lt", empty_ok=False)
ARGMAX = Monoid("argmax", "lowest", "argmax", idempotent=True, better="gt", arg=True, empty_ok=False)
ARGMIN = Monoid("argmin", "highest", "argmin", idempotent=True, better="lt", arg=True, empty_ok=False)
ANY = Monoid("any", "zero", "any", idempotent=True, op="logical_or", logical=True, carrier=MAX)
ALL = Monoid("all", "one", "all", idempotent=True, op="logical_and", logical=True, carrier=MIN)

#: every named monoid, by name, in the order the IR has always listed its combiners
MONOIDS: dict[str, Monoid] = {m.name: m for m in (SUM, PROD, MAX, MIN, ARGMAX, ARGMIN, ANY, ALL)}


def monoid(name) -> Monoid:
    """The monoid called `name` (a monoid is returned as it is): the one lookup frontends use."""
    if isinstance(name, Monoid):
        return name
    try:
        return MONOIDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown combiner {name!r} (known: {', '.join(MONOIDS)})") from None


__all__ = ["Monoid", "MONOIDS", "monoid", "SUM", "PROD", "MAX", "MIN", "ARGMAX", "ARGMIN", "ANY", "ALL"]
