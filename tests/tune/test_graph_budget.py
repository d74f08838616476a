"""A graph's measuring budget is shared among its kernels by their predicted times
(`tune.tuner.share_budget`): the kernels that take the time get the seconds and the candidates,
small ones a minimum; no kernel gets more than its level allows; a library call and the rules'
default survive the cut. Checked with stand-ins for the prepared tunings (no GPU needed)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tilefuse.tile.schedule import Schedule
from tilefuse.tune import tuner
from tilefuse.tune.tuner import MIN_CANDIDATES, MIN_KERNEL_S, PreparedTuning, _trimmed, share_budget


class Bench:
    def __init__(self):
        self.compiled = []

    def precompile(self, schedules):
        self.compiled.append(list(schedules))


def _prepared(name, best_us, n=8, kind="compute", library=False):
    schedules = [Schedule(BLOCK=16 * (k + 1), impl="generated") for k in range(n)]
    if library:
        schedules[-1] = Schedule(BLOCK=16, impl="aten")
    ranked = [(best_us * 1e-6 * (1 + 0.1 * k), s) for k, s in enumerate(schedules)]
    space = SimpleNamespace(default=schedules[3], families=("impl",) if library else ())
    return PreparedTuning(name, name, kind, "1", None, ranked, Bench(), None, space)


def test_the_budget_follows_the_predicted_times():
    big, small, tiny = _prepared("product", 900.0), _prepared("norm", 20.0, kind="memory"), _prepared("cast", 1.0)
    share_budget([big, small, tiny], "1")
    own_compute, own_memory = tuner.LEVELS["1"], tuner.MEMORY_LEVELS["1"]
    assert big.budget == pytest.approx(min(own_compute[1], tuner.GRAPH_BUDGET_S["1"] * 900 / 921))
    assert MIN_KERNEL_S <= small.budget <= own_memory[1]
    assert tiny.budget == MIN_KERNEL_S
    assert len(big.ranked) == own_compute[0]
    assert MIN_CANDIDATES <= len(tiny.ranked) < len(big.ranked)
    # sorted best first still, and nothing was compiled before `start`
    assert [t for t, _ in tiny.ranked] == sorted(t for t, _ in tiny.ranked)
    assert not any(p.bench.compiled for p in (big, small, tiny))
    tiny.start()
    tiny.start()
    assert tiny.bench.compiled == [[s for _, s in tiny.ranked]]


def test_a_graph_of_one_kernel_keeps_the_level_budget():
    only = _prepared("gemm", 50.0)
    share_budget([only], "1")
    assert only.budget == tuner.LEVELS["1"][1] and len(only.ranked) == tuner.LEVELS["1"][0]


def test_max_autotune_is_not_shared():
    p = _prepared("gemm", 50.0)
    share_budget([p, _prepared("other", 500.0)], "max")
    assert p.budget is None and len(p.ranked) == 8


def test_the_cut_keeps_the_library_and_the_default():
    p = _prepared("product", 1.0, library=True)
    kept = _trimmed(p.ranked, 2, p.space)
    schedules = [s for _, s in kept]
    assert p.space.default in schedules
    assert any(s["impl"] == "aten" for s in schedules)
    assert schedules[0] == p.ranked[0][1]  # the model's best first
    assert [t for t, _ in kept] == sorted(t for t, _ in kept)
