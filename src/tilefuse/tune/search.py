"""The measurement search: which schedule of a kernel to measure next, when to give up on
one, and when to stop.

This module owns the bandit. It knows nothing about kernels, backends or devices: it gets
candidate schedules (knob → value mappings, ranked by a cost model; each becomes a
:class:`~tilefuse.tile.schedule.Schedule`) and a ``measure(schedule) -> seconds`` callable
that compiles and times one schedule, and returns the fastest schedule it found within a
budget of wall time and measurements.

The algorithm is UCB1 turned to minimisation, over normalised times:

1. Arms are the candidates in the cost model's order (best predicted first; unranked ones
   last, in the order given). Each arm is measured ``initial_samples`` (2) times in a row in
   that order, so a small budget spends itself on the candidates the cost model likes best.
   Two, not one: the drop rule below needs two samples of an arm, and a single sample says
   nothing about noise; after its second sample a clearly slower arm is dropped at once
   instead of lingering untouched (UCB would rarely pick it again) and keeping the search
   from stopping early.
2. Times are divided by the best arm's mean, so every bound below is relative and scale-free
   (a 10 µs kernel and a 10 ms kernel are searched alike). The noise scale ``σ`` is the
   pooled relative standard deviation of the samples (each sample over its own arm's mean),
   shrunk towards a prior of ``noise_prior`` (5 %) worth ``NOISE_PRIOR_DOF`` (4) degrees of
   freedom — a few samples that happen to agree must not make the bounds overconfident —
   and never below ``MIN_NOISE`` (1 %). After ``T`` successful samples an arm with ``n``
   samples and normalised mean ``m`` has the confidence half-width
   ``w = σ·m·sqrt(confidence·ln T / n)``.
3. The next arm measured is the one with the lowest optimistic (lower) bound ``m - w``.
4. Early stopping: an arm with at least two samples is dropped once its lower bound ``m - w``
   exceeds the best arm's (lowest mean, at least two samples) upper bound by ``margin``.
5. The search stops before starting a measurement when the budget is spent (``clock()`` has
   advanced ``budget_s`` since the start: a measurement in progress is never interrupted),
   when ``max_measurements`` calls were made, when one arm survives with ``min_samples``
   samples, or when every survivor is measured to within ``margin / 2`` (all are then within
   about ``2·margin`` of the best: more samples would not change the choice materially).

A candidate whose measurement raises (it fails to compile or to run), or returns anything but
a positive finite number, is dropped with the error recorded; it never crashes the search.
If no candidate is measured successfully, :class:`TuningError` says why.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import logs
from ..tile.schedule import Schedule

__all__ = [
    "CONFIDENCE",
    "INITIAL_SAMPLES",
    "MARGIN",
    "MIN_NOISE",
    "MIN_SAMPLES",
    "NOISE_PRIOR",
    "NOISE_PRIOR_DOF",
    "ArmStats",
    "Candidate",
    "SearchResult",
    "TuningError",
    "schedule_key",
    "search",
]

#: the UCB1 exploration constant (UCB1 uses sqrt(2·ln T / n): confidence = 2)
CONFIDENCE = 2.0
#: relative margin (fraction of the best mean time) by which an arm's lower bound must exceed
#: the best arm's upper bound before the arm is dropped
MARGIN = 0.02
#: prior relative timing noise, and its weight in degrees of freedom: the pooled noise
#: estimate starts here and moves to the samples' own spread as they accumulate
NOISE_PRIOR = 0.05
NOISE_PRIOR_DOF = 4
#: floor of the relative noise scale (the bounds never assume timings better than 1 %)
MIN_NOISE = 0.01
#: samples the last surviving arm needs before the search stops early
MIN_SAMPLES = 3
#: samples every arm gets, in the cost model's order, before the bandit chooses
INITIAL_SAMPLES = 2


class TuningError(RuntimeError):
    """No configuration could be measured (all failed, or none within the budget)."""


def schedule_key(schedule: Mapping[str, Any]) -> tuple:
    """A hashable, order-independent key of a schedule: its (knob, value) pairs sorted by knob
    name."""
    try:
        key = tuple(sorted(schedule.items(), key=lambda kv: str(kv[0])))
        hash(key)
    except TypeError as e:
        raise TypeError(f"schedule {dict(schedule)!r} must map knob names to hashable values") from e
    return key


class Candidate:
    """A schedule (knob → value) with an optional predicted cost in seconds (lower is better).
    Equal and hashed by its schedule, not by the prediction."""

    __slots__ = ("schedule", "key", "predicted")

    def __init__(self, schedule: Mapping[str, Any], predicted: float | None = None):
        self.key = schedule_key(schedule)
        self.schedule = schedule if isinstance(schedule, Schedule) else Schedule(schedule)
        self.predicted = None if predicted is None else float(predicted)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Candidate) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        pred = "" if self.predicted is None else f", predicted={self.predicted:.3g}"
        return f"Candidate({self.schedule!r}{pred})"


@dataclass
class ArmStats:
    """What the search learnt about one candidate.

    ``status`` is ``"pending"`` (never measured: the search stopped first), ``"alive"`` (in
    the race when the search stopped), ``"dropped"`` (early-stopped as clearly slower) or
    ``"failed"`` (``error`` says why; earlier samples, if any, are kept)."""

    schedule: Schedule
    predicted: float | None
    rank: int  # position in the cost model's order, 0 = best predicted
    samples: list[float] = field(default_factory=list)
    status: str = "pending"
    error: str | None = None

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def mean(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else math.inf

    @property
    def min(self) -> float:
        return min(self.samples) if self.samples else math.inf


@dataclass
class SearchResult:
    """The outcome of :func:`search`.

    ``measured`` counts calls of ``measure`` (failed ones included); ``dropped`` lists the
    schedules early-stopped, in the order they were dropped; ``failures`` pairs each failed
    schedule with its error; ``per_arm`` maps :func:`schedule_key` of every candidate to its
    :class:`ArmStats`; ``stop_reason`` says why the search ended."""

    best: Schedule
    best_time: float
    measured: int
    dropped: list[Schedule]
    failures: list[tuple[Schedule, str]]
    per_arm: dict[tuple, ArmStats]
    elapsed_s: float = 0.0
    stop_reason: str = ""

    def report(self) -> str:
        """A small text table of the arms, fastest first, for logs and ``explain``."""
        lines = [
            (
                f"best {_fmt(self.best)}: {self.best_time * 1e6:.2f} us "
                f"({self.measured} measurements, {self.elapsed_s:.2f} s, stopped: {self.stop_reason})"
            )
        ]
        arms = sorted(self.per_arm.values(), key=lambda a: (a.mean, a.rank))
        for a in arms:
            mean = f"{a.mean * 1e6:10.2f} us" if a.samples else f"{'-':>13}"
            pred = f"{a.predicted * 1e6:10.2f} us" if a.predicted is not None else f"{'-':>13}"
            extra = f"  {a.error}" if a.error else ""
            lines.append(
                f"  {a.status:8} n={a.n:<3} mean={mean} predicted={pred}  {_fmt(a.schedule)}{extra}"
            )
        return "\n".join(lines)


def _fmt(schedule: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in schedule.items())


def _arms(candidates: Iterable[Candidate | Mapping[str, Any]]) -> list[ArmStats]:
    """Candidates as arms in the cost model's order, duplicates (same schedule) removed."""
    cands = [c if isinstance(c, Candidate) else Candidate(c) for c in candidates]
    order = sorted(
        range(len(cands)),
        key=lambda i: (cands[i].predicted is None, cands[i].predicted or 0.0, i),
    )
    seen: set[tuple] = set()
    arms = []
    for i in order:
        c = cands[i]
        if c.key in seen:
            continue
        seen.add(c.key)
        arms.append(ArmStats(schedule=c.schedule, predicted=c.predicted, rank=len(arms)))
    return arms


class _Bounds:
    """Normalised means and confidence half-widths of the arms, recomputed after each
    measurement."""

    def __init__(self, arms: list[ArmStats], confidence: float, noise_prior: float):
        alive = [a for a in arms if a.status == "alive"]
        self.best = min(alive, key=lambda a: (a.mean, a.rank)) if alive else None
        self.scale = self.best.mean if self.best is not None else 1.0
        # Pooled relative noise over every arm whose samples are valid (dropped ones included).
        sq, dof = NOISE_PRIOR_DOF * noise_prior**2, NOISE_PRIOR_DOF
        for a in arms:
            if a.status in ("alive", "dropped") and a.n >= 2:
                m = a.mean
                sq += sum((x / m - 1.0) ** 2 for x in a.samples)
                dof += a.n - 1
        self.noise = max(MIN_NOISE, math.sqrt(sq / dof))
        total = sum(a.n for a in arms if a.status in ("alive", "dropped"))
        self._log_t = math.log(max(total, 2))
        self._confidence = confidence

    def mean(self, a: ArmStats) -> float:
        return a.mean / self.scale

    def width(self, a: ArmStats) -> float:
        return self.noise * self.mean(a) * math.sqrt(self._confidence * self._log_t / a.n)

    def lower(self, a: ArmStats) -> float:
        return self.mean(a) - self.width(a)

    def upper(self, a: ArmStats) -> float:
        return self.mean(a) + self.width(a)


def search(
    candidates: Iterable[Candidate | Mapping[str, Any]],
    measure: Callable[[Schedule], float],
    *,
    budget_s: float,
    max_measurements: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
    progress: Callable[[int, int | None, float], None] | None = None,
    confidence: float = CONFIDENCE,
    margin: float = MARGIN,
    noise_prior: float = NOISE_PRIOR,
    min_samples: int = MIN_SAMPLES,
    initial_samples: int = INITIAL_SAMPLES,
    warm_all: bool = False,
) -> SearchResult:
    """Measure ``candidates`` with ``measure`` and return the fastest (see the module
    docstring for the algorithm).

    ``candidates`` are :class:`Candidate` objects or plain schedules (unranked).
    ``measure(schedule)`` returns one timing sample in seconds.
    ``budget_s`` is wall time as told by ``clock``; ``max_measurements`` caps calls of
    ``measure``. ``progress(done, total, best_time)`` is called after each measurement with
    the number of measurements made, an estimate of how many the search will make at most
    (from ``max_measurements`` and the budget at the rate so far; None while unknown), and
    the best mean time so far (``inf`` before the first success). The search may stop before
    ``total`` when it converges. ``warm_all``: the budget stops the search only once every
    candidate has its initial samples (a small budget then still compares them all).
    """
    arms = _arms(candidates)
    if not arms:
        raise TuningError("no candidates to measure")
    if not budget_s >= 0:
        raise ValueError(f"budget_s must be a number of seconds >= 0, got {budget_s!r}")
    if max_measurements is not None and max_measurements < 1:
        raise ValueError(f"max_measurements must be >= 1, got {max_measurements!r}")
    if initial_samples < 1 or min_samples < 1:
        raise ValueError("initial_samples and min_samples must be >= 1")
    if math.isinf(budget_s) and max_measurements is None:
        raise ValueError("an unlimited budget_s needs max_measurements")

    start = clock()
    measured = 0
    dropped: list[Schedule] = []
    failures: list[tuple[Schedule, str]] = []

    while True:
        bounds = _Bounds(arms, confidence, noise_prior)
        # Arms still owed their initial samples, in the cost model's order.
        warming = [
            a for a in arms if a.status == "pending" or (a.status == "alive" and a.n < initial_samples)
        ]
        elapsed = clock() - start
        reason = _stop_reason(arms, warming, bounds, measured, elapsed, budget_s, max_measurements, margin,
                              min_samples, warm_all)
        if reason:
            break
        arm = warming[0] if warming else _next_arm(arms, bounds)
        try:
            value = float(measure(arm.schedule))
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"measure returned {value!r}, expected a positive number of seconds")
        except Exception as e:  # noqa: BLE001 - a configuration that fails never stops the search
            arm.status = "failed"
            arm.error = f"{type(e).__name__}: {e}"
            failures.append((arm.schedule, arm.error))
            logs.log("tune", "failed %s: %s", _fmt(arm.schedule), arm.error)
        else:
            arm.samples.append(value)
            arm.status = "alive"
        measured += 1
        bounds = _Bounds(arms, confidence, noise_prior)
        for loser in _losers(arms, bounds, margin):
            loser.status = "dropped"
            dropped.append(loser.schedule)
            logs.log(
                "tune", "dropped %s after %d samples (mean %.3g s, the best arm's %.3g s)",
                _fmt(loser.schedule), loser.n, loser.mean, bounds.scale,
            )
        if progress is not None:
            best_time = bounds.best.mean if bounds.best is not None else math.inf
            total = _total_estimate(measured, clock() - start, budget_s, max_measurements)
            progress(measured, total, best_time)

    elapsed = clock() - start
    valid = [a for a in arms if a.status in ("alive", "dropped")]
    if not valid:
        n_failed = sum(a.status == "failed" for a in arms)
        n_pending = sum(a.status == "pending" for a in arms)
        detail = "; ".join(f"{_fmt(s)}: {err}" for s, err in failures[:3])
        if n_pending:
            raise TuningError(
                f"no candidate was measured successfully within the budget "
                f"({n_failed} failed, {n_pending} not tried; stopped: {reason})"
                + (f"; first errors: {detail}" if detail else "")
            )
        raise TuningError(f"all {n_failed} candidates failed to compile or run; first errors: {detail}")
    best = min(valid, key=lambda a: (a.mean, a.rank))
    for a in valid:
        logs.log("tune", "  %s: %d samples, mean %.3g s, fastest %.3g s", _fmt(a.schedule), a.n, a.mean,
                 min(a.samples))
    logs.log("tune", "best %s: %.3g s after %d measurements (%s)",
             _fmt(best.schedule), best.mean, measured, reason)
    return SearchResult(
        best=best.schedule,
        best_time=best.mean,
        measured=measured,
        dropped=dropped,
        failures=failures,
        per_arm={schedule_key(a.schedule): a for a in arms},
        elapsed_s=elapsed,
        stop_reason=reason,
    )


def _stop_reason(
    arms, warming, bounds, measured, elapsed, budget_s, max_measurements, margin, min_samples, warm_all=False
) -> str:
    """Why the search stops now, or "" to go on."""
    alive = [a for a in arms if a.status == "alive"]
    if not warming and not alive:
        return "no candidates left"
    if max_measurements is not None and measured >= max_measurements:
        return "max_measurements"
    if elapsed >= budget_s and not (warm_all and warming):
        return "budget"
    if not warming and len(alive) == 1 and alive[0].n >= min_samples:
        return "one survivor"
    if (
        not warming
        and len(alive) > 1
        and all(a.n >= min_samples and bounds.width(a) < margin / 2 for a in alive)
    ):
        return "converged"
    return ""


def _next_arm(arms: list[ArmStats], bounds: _Bounds) -> ArmStats:
    """The alive arm with the lowest optimistic bound (ties: the cost model's order)."""
    alive = [a for a in arms if a.status == "alive"]
    return min(alive, key=lambda a: (bounds.lower(a), a.rank))


def _losers(arms: list[ArmStats], bounds: _Bounds, margin: float) -> list[ArmStats]:
    best = bounds.best
    if best is None or best.n < 2:
        return []
    limit = bounds.upper(best) + margin
    return [
        a for a in arms
        if a.status == "alive" and a is not best and a.n >= 2 and bounds.lower(a) > limit
    ]


def _total_estimate(
    measured: int, elapsed: float, budget_s: float, max_measurements: int | None
) -> int | None:
    total = math.inf if max_measurements is None else float(max_measurements)
    if math.isfinite(budget_s) and elapsed > 0:
        rate = elapsed / measured
        total = min(total, measured + max(0.0, budget_s - elapsed) // rate)
    return None if math.isinf(total) else max(measured, int(total))
