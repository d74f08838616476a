"""Tests for the measurement search (tilefuse.tune.search): a UCB bandit driven by a fake
timer, so every run is deterministic and takes milliseconds."""
from __future__ import annotations

import math
import random

import pytest

from tilefuse.tune.search import (
    MIN_SAMPLES,
    Candidate,
    SearchResult,
    TuningError,
    schedule_key,
    search,
)

# True mean times (seconds) of six configurations; BLOCK=64 is the fastest, 128 is close.
TRUE = {16: 3.0e-3, 32: 1.3e-3, 64: 1.0e-3, 128: 1.1e-3, 256: 2.0e-3, 512: 5.0e-3}
# A cost model that is only roughly right: it ranks 128 first and 64 third.
PREDICTED = {16: 2.5e-3, 32: 1.2e-3, 64: 1.25e-3, 128: 0.9e-3, 256: 1.5e-3, 512: 4.0e-3}


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeBench:
    """``measure``: a sample of the true time with seeded multiplicative noise; each call
    advances the fake clock by ``cost_s`` (plus ``compile_s`` the first time a config runs)."""

    def __init__(self, true=TRUE, noise=0.03, seed=0, clock=None, cost_s=0.01, compile_s=0.0, fail=None):
        self.true = true
        self.noise = noise
        self.rng = random.Random(seed)
        self.clock = clock
        self.cost_s = cost_s
        self.compile_s = compile_s
        self.fail = fail or {}
        self.calls: list[tuple[int, float]] = []  # (BLOCK, clock at start)
        self.compiled: set[int] = set()

    def __call__(self, config: dict) -> float:
        block = config["BLOCK"]
        start = self.clock() if self.clock else 0.0
        self.calls.append((block, start))
        if self.clock is not None:
            self.clock.now += self.cost_s + (self.compile_s if block not in self.compiled else 0.0)
        self.compiled.add(block)
        if block in self.fail:
            outcome = self.fail[block](sum(1 for b, _ in self.calls if b == block))
            if outcome is not None:
                return outcome
        return self.true[block] * max(0.5, 1.0 + self.rng.gauss(0.0, self.noise))

    def n(self, block: int) -> int:
        return sum(1 for b, _ in self.calls if b == block)


def candidates(true=TRUE, predicted=PREDICTED) -> list[Candidate]:
    return [Candidate({"BLOCK": b}, predicted.get(b)) for b in true]


def arm(result: SearchResult, block: int):
    return result.per_arm[schedule_key({"BLOCK": block})]


# ------------------------------------------------------------------------ finding the best


@pytest.mark.parametrize("seed", range(20))
def test_finds_best_arm(seed):
    bench = FakeBench(seed=seed)
    result = search(candidates(), bench, budget_s=math.inf, max_measurements=150)
    assert result.best == {"BLOCK": 64}
    assert result.best_time == pytest.approx(TRUE[64], rel=0.05)
    assert result.measured == len(bench.calls) <= 150
    assert result.failures == []
    # The winner is exploited: it has more samples than any other arm.
    assert arm(result, 64).n == max(a.n for a in result.per_arm.values())


@pytest.mark.parametrize("seed", range(10))
def test_early_stopping_drops_clear_losers_after_few_samples(seed):
    bench = FakeBench(seed=seed)
    result = search(candidates(), bench, budget_s=math.inf, max_measurements=150)
    for block in (16, 256, 512):  # 2x, 3x and 5x slower than the best
        a = arm(result, block)
        assert a.status == "dropped"
        assert a.n <= 3, (block, a.samples)
        assert {"BLOCK": block} in result.dropped
    assert arm(result, 64).status == "alive"


@pytest.mark.parametrize("seed", range(10))
def test_close_contender_is_explored_not_dropped_early(seed):
    true = {64: 1.0e-3, 128: 1.03e-3, 512: 3.0e-3}  # 128 is within the 3 % noise of 64
    bench = FakeBench(true=true, seed=seed)
    result = search(candidates(true, {}), bench, budget_s=math.inf, max_measurements=60)
    assert arm(result, 512).status == "dropped" and arm(result, 512).n == 2
    # 3 % apart is not clearly slower: 128 stays in the race until the end.
    assert arm(result, 128).status == "alive"
    assert result.stop_reason == "max_measurements"
    assert result.best == {"BLOCK": 64}


def test_search_stops_once_one_arm_survives():
    bench = FakeBench(true={16: 1e-3, 32: 4e-3, 64: 9e-3}, noise=0.01)
    result = search(candidates(bench.true, {}), bench, budget_s=math.inf, max_measurements=1000)
    assert result.stop_reason == "one survivor"
    assert result.best == {"BLOCK": 16}
    assert result.measured < 15
    assert arm(result, 16).n >= MIN_SAMPLES


def test_single_candidate_is_measured_min_samples_times():
    bench = FakeBench(true={64: 2e-3})
    result = search([{"BLOCK": 64}], bench, budget_s=10.0)
    assert result.best == {"BLOCK": 64}
    assert result.measured == MIN_SAMPLES
    assert result.stop_reason == "one survivor"


def test_indistinguishable_arms_converge_before_the_budget():
    bench = FakeBench(true={16: 1e-3, 32: 1e-3}, noise=0.0)
    result = search(candidates(bench.true, {}), bench, budget_s=math.inf, max_measurements=100_000)
    assert result.stop_reason == "converged"
    assert result.measured < 10_000
    assert result.best in ({"BLOCK": 16}, {"BLOCK": 32})


def test_search_is_scale_free():
    # Times scaled by a power of two (exact in floating point): the same decisions.
    def run(scale):
        true = {b: t * scale for b, t in TRUE.items()}
        pred = {b: t * scale for b, t in PREDICTED.items()}
        bench = FakeBench(true=true, seed=3)
        return search(candidates(true, pred), bench, budget_s=math.inf, max_measurements=80), bench

    (small, bench_small), (large, bench_large) = run(1.0 / 1024), run(1024.0)
    assert [b for b, _ in bench_small.calls] == [b for b, _ in bench_large.calls]
    assert small.best == large.best == {"BLOCK": 64}


# ---------------------------------------------------------------------------- the budget


def test_budget_is_honoured_with_a_fake_clock():
    clock = FakeClock()
    bench = FakeBench(clock=clock, cost_s=0.01, compile_s=0.02)
    start = clock.now
    result = search(candidates(), bench, budget_s=0.3, clock=clock)
    assert result.stop_reason == "budget"
    # No measurement starts once the budget is spent; the one in flight may finish after it.
    assert all(t - start < 0.3 for _, t in bench.calls)
    assert clock.now - start <= 0.3 + 0.01 + 0.02
    assert result.elapsed_s == pytest.approx(clock.now - start)
    assert result.measured == len(bench.calls)


def test_a_spent_budget_still_warms_every_candidate_when_asked():
    """A plan's small share of its graph's budget: every candidate gets its two samples (the
    fastest may be the model's last), then the budget stops the search."""
    clock = FakeClock()
    bench = FakeBench(clock=clock, cost_s=0.01)
    result = search(candidates(), bench, budget_s=0.02, clock=clock, warm_all=True)
    assert result.stop_reason == "budget"
    assert all(bench.n(b) >= 2 for b in TRUE)
    assert result.best == {"BLOCK": 64}
    clock, bench = FakeClock(), FakeBench(clock=FakeClock(), cost_s=0.01)
    bench.clock = clock
    result = search(candidates(), bench, budget_s=0.02, clock=clock)
    assert result.stop_reason == "budget" and len(bench.calls) == 2


def test_small_budget_spends_itself_in_cost_model_order():
    bench = FakeBench()
    preds = {b: PREDICTED[b] for b in (16, 32, 64, 128)}  # 256 and 512 unranked: last
    result = search(candidates(TRUE, preds), bench, budget_s=math.inf, max_measurements=8)
    # Two samples each (the drop rule needs two), best predicted first.
    assert [b for b, _ in bench.calls] == [128, 128, 32, 32, 64, 64, 16, 16]
    assert result.stop_reason == "max_measurements"
    assert arm(result, 256).status == arm(result, 512).status == "pending"
    assert result.best == {"BLOCK": 64}


def test_max_measurements_is_honoured():
    bench = FakeBench()
    result = search(candidates(), bench, budget_s=math.inf, max_measurements=7)
    assert result.measured == len(bench.calls) == 7


def test_zero_budget_measures_nothing_and_says_so():
    bench = FakeBench(clock=FakeClock())
    with pytest.raises(TuningError, match="within the budget"):
        search(candidates(), bench, budget_s=0.0, clock=bench.clock)
    assert bench.calls == []


def test_invalid_arguments():
    with pytest.raises(TuningError, match="no candidates"):
        search([], FakeBench(), budget_s=1.0)
    with pytest.raises(ValueError, match="max_measurements"):
        search(candidates(), FakeBench(), budget_s=math.inf)
    with pytest.raises(ValueError):
        search(candidates(), FakeBench(), budget_s=-1.0)
    with pytest.raises(ValueError):
        search(candidates(), FakeBench(), budget_s=1.0, max_measurements=0)


# ---------------------------------------------------------------------------- failures


def _raise(msg):
    def outcome(_call):
        raise RuntimeError(msg)

    return outcome


def test_failing_candidates_are_recorded_and_skipped():
    bench = FakeBench(
        fail={
            512: _raise("out of shared memory"),
            32: lambda _call: float("nan"),
            16: lambda _call: -1.0,
        }
    )
    result = search(candidates(), bench, budget_s=math.inf, max_measurements=100)
    assert result.best == {"BLOCK": 64}
    failed = {c["BLOCK"]: err for c, err in result.failures}
    assert set(failed) == {512, 32, 16}
    assert "RuntimeError: out of shared memory" in failed[512]
    assert "nan" in failed[32] and "-1.0" in failed[16]
    for block in failed:
        assert arm(result, block).status == "failed"
        assert bench.n(block) == 1  # never measured again


def test_arm_failing_on_a_later_sample_is_dropped_even_if_fastest():
    # BLOCK=64 runs once, then crashes (a flaky kernel): it must not win.
    def flaky(call):
        if call > 1:
            raise RuntimeError("illegal address")

    bench = FakeBench(fail={64: flaky})
    result = search(candidates(), bench, budget_s=math.inf, max_measurements=100)
    assert arm(result, 64).status == "failed"
    assert arm(result, 64).n == 1
    assert result.best == {"BLOCK": 128}


def test_all_failing_raises_tuning_error():
    bench = FakeBench(fail={b: _raise(f"compile error {b}") for b in TRUE})
    with pytest.raises(TuningError, match="all 6 candidates failed") as info:
        search(candidates(), bench, budget_s=math.inf, max_measurements=100)
    assert "compile error 128" in str(info.value)  # first errors are named
    assert len(bench.calls) == 6


# ---------------------------------------------------------------------------- progress


def test_progress_is_called_after_each_measurement():
    clock = FakeClock()
    bench = FakeBench(clock=clock, fail={512: _raise("boom")})
    calls = []
    result = search(
        candidates(), bench, budget_s=0.5, clock=clock,
        progress=lambda done, total, best: calls.append((done, total, best)),
    )
    done = [c[0] for c in calls]
    assert done == list(range(1, result.measured + 1))
    assert all(total is None or total >= d for d, total, _ in calls)
    assert calls[-1][2] == pytest.approx(result.best_time)
    assert all(math.isfinite(best) for _, _, best in calls)  # the first candidate succeeded
    # With a fixed cost per measurement, the estimate is the number the budget allows.
    assert calls[-1][1] == pytest.approx(50, abs=1)


def test_progress_total_is_max_measurements_without_a_time_budget():
    totals = []
    search(candidates(), FakeBench(), budget_s=math.inf, max_measurements=12,
           progress=lambda done, total, best: totals.append(total))
    assert set(totals) == {12}


# ---------------------------------------------------------------------------- candidates


def test_candidates_are_keyed_by_config():
    a = Candidate({"BLOCK_M": 64, "BLOCK_N": 32}, predicted=1e-3)
    b = Candidate({"BLOCK_N": 32, "BLOCK_M": 64}, predicted=2e-3)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != Candidate({"BLOCK_M": 64, "BLOCK_N": 64})
    with pytest.raises(TypeError, match="hashable"):
        Candidate({"BLOCK": [1, 2]})


def test_duplicate_candidates_are_measured_as_one_arm():
    bench = FakeBench(true={64: 1e-3, 128: 2e-3})
    cands = [Candidate({"BLOCK": 64}, 1e-3), {"BLOCK": 64}, Candidate({"BLOCK": 128}, 3e-3)]
    result = search(cands, bench, budget_s=math.inf, max_measurements=20)
    assert len(result.per_arm) == 2
    assert arm(result, 64).predicted == 1e-3


def test_report_names_the_best_config():
    bench = FakeBench(fail={512: _raise("boom")})
    result = search(candidates(), bench, budget_s=math.inf, max_measurements=40)
    text = result.report()
    assert "best BLOCK=64" in text and "failed" in text and "boom" in text
