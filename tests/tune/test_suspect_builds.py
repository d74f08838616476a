"""A plan whose build budget left only candidates that run far slower than the model predicts
(a tile that spills its registers: T5's attention took 2.1 ms for a predicted 11 µs) builds
and measures the candidates the budget cut (`tuner._measure`, `SUSPECT_RATIO`); a plan whose
built candidates run near the prediction does not wait for the rest."""
from tilefuse.cache.disk import cache_key
from tilefuse.tune import tuner
from tilefuse.tune.cost import NOMINAL, rank
from tilefuse.tune.tuner import PreparedTuning

from test_tuning_limits import _space


class _Bench:
    """Builds only the first candidate within the budget on its first call (the rest compile
    on); every candidate runs at `slow` or `fast` times its prediction."""

    def __init__(self, ranked, slow: float, fast: float = 2.0):
        self.predicted = {schedule: predicted for predicted, schedule in ranked}
        self.first = ranked[0][1]
        self.slow, self.fast = slow, fast
        self.calls, self.measured = 0, set()

    def ready(self, ranked, budget_s):
        self.calls += 1
        return (ranked[:1] if self.calls == 1 else list(ranked)), []

    def measure(self, schedule):
        self.measured.add(schedule)
        return self.predicted[schedule] * (self.slow if schedule == self.first else self.fast)


def _prepared(slow: float):
    space = _space()
    ranked = rank(space, NOMINAL, keep=6)
    assert len(ranked) >= 3
    bench = _Bench(ranked, slow)
    return PreparedTuning("kernel0", cache_key("suspect", slow), space.kind, "1", None, ranked, bench, NOMINAL, space,
                          budget_s=0.05), bench


def test_a_catastrophically_slow_survivor_builds_the_rest():
    p, bench = _prepared(slow=150.0)
    out = tuner._measure(p)
    assert bench.calls == 2 and len(bench.measured) > 1
    assert out.schedule != bench.first  # a candidate the budget had cut wins
    assert out.best_time < 10 * p.ranked[0][0] * 2


def test_a_survivor_near_the_prediction_is_kept():
    p, bench = _prepared(slow=3.0)
    out = tuner._measure(p)
    assert bench.calls == 1 and bench.measured == {bench.first}
    assert out.schedule == bench.first


def test_a_cpu_plan_keeps_what_its_budget_built():
    """A CPU's kernels rank by the model's (GPU) times: a measured time far from them says
    nothing about a spilling tile, and the build budget stands."""
    p, bench = _prepared(slow=150.0)
    bench.target = type("CpuTarget", (), {"on_cpu": True})()
    out = tuner._measure(p)
    assert bench.calls == 1 and out.schedule == bench.first
