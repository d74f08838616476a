"""A graph's tuning budget (`tuner.allot_budgets`, `PreparedTuning.start`): measuring time
shared by predicted kernel time, small shares not measured, and a started plan's candidates
checked against the target and cut to what its share measures. Nothing is compiled here."""
import math
import random

import pytest

from tilefuse.tune import tuner
from tilefuse.tune.cost import NOMINAL, choose_without_measuring, rank
from tilefuse.tune.tuner import MIN_SHARE_S, PreparedTuning, TuneOutcome, allot_budgets

from test_tuning_limits import _space, _too_big


def test_shares_follow_the_predicted_time_and_spend_the_budget():
    shares = allot_budgets([4.0, 2.0, 1.0, 1.0], 2.0, [1.0] * 4)
    assert shares == pytest.approx([1.0, 0.5, 0.25, 0.25])
    assert sum(shares) == pytest.approx(2.0)


def test_a_capped_plan_leaves_its_excess_to_the_others():
    shares = allot_budgets([100.0, 1.0, 1.0], 2.0, [0.5, 0.5, 0.5])
    assert shares == pytest.approx([0.5, 0.5, 0.5])  # (the budget is more than the plans can use)
    shares = allot_budgets([100.0, 3.0, 1.0], 1.0, [0.5, 0.5, 0.5])
    assert shares[0] == 0.5 and shares[1] == pytest.approx(0.375) and shares[2] == pytest.approx(0.125)


def test_every_plan_but_the_negligible_is_measured_at_least_briefly():
    shares = allot_budgets([100.0, 100.0, 2.0, 1.5, 0.1, 0.0, math.inf], 0.51, [0.25] * 7)
    assert shares[:2] == pytest.approx([0.25, 0.25])
    assert shares[2] == shares[3] == MIN_SHARE_S  # (their proportional share was spent: the floor)
    assert shares[4:] == [0.0] * 3  # under NEGLIGIBLE of the whole, nothing, or not a time


@pytest.mark.parametrize("seed", range(20))
def test_random_shares_respect_caps_floor_and_total(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 30)
    weights = [rng.choice([0.0, rng.random() * 10 ** rng.randint(-7, -2)]) for _ in range(n)]
    caps = [rng.choice([0.25, 0.5]) for _ in range(n)]
    total = rng.uniform(0.1, 4.0)
    shares = allot_budgets(weights, total, caps)
    mass = sum(weights)
    for s, w, c in zip(shares, weights, caps):
        if mass and w >= tuner.NEGLIGIBLE * mass:
            assert MIN_SHARE_S <= s <= c + 1e-12
        else:
            assert s == 0.0
    above = sum(max(0.0, s - MIN_SHARE_S) for s in shares)
    assert above <= total + 1e-9  # beyond the floors, the budget is not exceeded
    # a heavier plan never gets less than a lighter one with the same cap
    for i in range(n):
        for j in range(n):
            if caps[i] == caps[j] and weights[i] > weights[j]:
                assert shares[i] >= shares[j] - 1e-12


class _Bench:
    def __init__(self):
        self.compiling = []

    def misfit(self, schedule):
        return _too_big(schedule)

    def precompile(self, schedules):
        self.compiling.extend(schedules)


def _prepared():
    space = _space()
    ranked = rank(space, NOMINAL, keep=8)
    return PreparedTuning("kernel0", "key", space.kind, "1", None, ranked, _Bench(), NOMINAL, space)


def test_a_small_share_compiles_fewer_candidates_and_none_over_the_limits():
    p = _prepared()
    assert p.predicted == p.ranked[0][0] > 0
    p.start(0.2)
    kept = int(0.2 / tuner.SECONDS_PER_CANDIDATE + 0.5)
    assert 2 < kept < 8 and len(p.ranked) == kept == len(p.bench.compiling) and p.budget_s == 0.2
    assert not any(_too_big(s) for s in p.bench.compiling)
    p.start(0.5)  # started once
    assert len(p.bench.compiling) == kept


def test_a_full_share_keeps_the_levels_candidates():
    p = _prepared()
    p.start(None)
    assert len(p.ranked) == 8 and p.budget_s is None


def test_an_unmeasured_plan_is_the_models_choice():
    p = _prepared()
    out = p.unmeasured("not measured")
    assert out.source == "model" and out.schedule == choose_without_measuring(p.space, NOMINAL)
    assert not p.bench.compiling


def _prepare_graph(monkeypatch, names, fake_prepare, pool=True, same=None, bases=None, events=None, **knobs):
    """`compiler._prepare_tuning` over contraction plans named `names`, each prepared by
    `fake_prepare(step)` (a stand-in for `tuner.prepare_tuning`), with or without compile workers.
    `same`: {plan: an earlier plan it is identical to (the same dedupe key)}; `bases` receives
    each plan's (kernels, notes, dedupe key); `events` gets ("lower", plan) for each plan's base
    lowering."""
    import contextlib
    from types import SimpleNamespace

    from tilefuse import compiler
    from tilefuse.backends.triton import compile_pool
    from tilefuse.config import config
    from tilefuse.fusion.library import ProductChoice
    from tilefuse.fusion.plan import KernelPlan, PlanKind

    def prepare(graph, step, lowering, *, level, device, aten, start):
        assert not start
        return fake_prepare(step)

    monkeypatch.setattr(compiler, "prepare_tuning", prepare)
    monkeypatch.setattr(compile_pool, "start", lambda *a: pool)
    monkeypatch.setattr(compiler, "_statically_empty", lambda graph, step: False)
    same = same or {}
    def keyed(graph, step, lowering, options, stage):
        if events is not None:
            events.append(("lower", step.name))
        return [], [], "plan-" + same.get(step.name, step.name)

    monkeypatch.setattr(compiler, "_keyed_lowering", keyed)
    steps = []
    for name in names:
        k = KernelPlan(name, PlanKind.CONTRACTION, parallel=1)
        k.library = ProductChoice("generated")
        steps.append(k)
    lowering = SimpleNamespace(target=SimpleNamespace(on_cpu=False, interpret=False))
    return compiler._prepare_tuning(None, steps, lowering, config.options({"autotune": "1", **knobs}), None,
                                    lambda name: contextlib.nullcontext(), SimpleNamespace(now=lambda msg: None),
                                    {} if bases is None else bases)


def test_the_compiler_shares_a_graphs_budget_among_its_plans(monkeypatch):
    """`compiler._prepare_tuning` with stand-ins for the plans' preparations: the heavy plan is
    started with the largest share, a plan too light to measure and its copy are the model's
    choice, a copy of a measured plan is left to find the first one's result."""
    from tilefuse.backends.triton import compile_pool

    predicted = {"heavy": (1e-3, "k1"), "light": (1e-6, "k2"), "light_copy": (1e-6, "k2"),
                 "heavy_copy": (1e-3, "k1"), "middle": (2e-4, "k3")}

    def fake_prepare(step):
        p = _prepared()
        p.name, p.key = step.name, predicted[step.name][1]
        p.ranked = [(predicted[step.name][0], s) for _, s in p.ranked]
        return p

    out = _prepare_graph(monkeypatch, predicted, fake_prepare, tuning_budget_ms=600)
    assert set(out) == {"heavy", "middle", "light", "light_copy"}, out
    assert out["heavy"].started and out["middle"].started
    # each kept candidate costs its measurement and its part of the compile workers' time
    per_candidate = tuner.candidate_seconds(compile_pool.worker_count())
    assert out["middle"].candidate_s == per_candidate > tuner.SECONDS_PER_CANDIDATE
    assert len(out["middle"].ranked) == max(2, min(8, int(0.1 / per_candidate + 0.5)))
    assert out["heavy"].budget_s == pytest.approx(tuner.plan_budget(out["heavy"]))
    assert out["middle"].budget_s == pytest.approx(0.1, rel=1e-2)
    assert out["light"].source == "model" and out["light_copy"].source == "model"
    assert "heavy_copy" not in out
    # no graph budget: every plan started with its own
    out = _prepare_graph(monkeypatch, predicted, fake_prepare, tuning_budget_ms=0)
    assert set(out) == {"heavy", "middle", "light"} and all(p.started and p.budget_s is None for p in out.values())
    # no compile workers: shared all the same, each plan started when `tune_plan` reaches it
    out = _prepare_graph(monkeypatch, predicted, fake_prepare, pool=False, tuning_budget_ms=600)
    assert not out["heavy"].started and out["heavy"].budget_s == pytest.approx(tuner.plan_budget(out["heavy"]))
    assert out["light"].source == "model"


def test_a_plan_whose_candidates_fail_to_lower_takes_the_rules(monkeypatch):
    """An error while a plan's candidates are checked against the target is the rules' choice for
    that plan, never the graph's failure."""
    def fake_prepare(step):
        p = _prepared()
        p.name, p.key = step.name, step.name
        if step.name == "broken":
            def misfit(schedule):
                raise ValueError("a lowering bug")
            p.bench.misfit = misfit
        return p

    out = _prepare_graph(monkeypatch, ("broken", "fine"), fake_prepare)
    assert out["broken"].source == "rules" and "a lowering bug" in out["broken"].note
    assert out["fine"].started


def test_plans_found_in_the_tuning_cache_count_in_the_graphs_time(monkeypatch):
    """A light plan beside a heavy one found in the tuning cache is as negligible as it was
    before the heavy one was cached (through `compiler._prepare_tuning`, with stand-ins)."""
    assert allot_budgets([1e-6, 1e-3], 2.0, [0.5, 0.0]) == [0.0, 0.0]

    def fake_prepare(step):
        if step.name == "heavy":
            return TuneOutcome(_space().default, "cache", best_time=1e-3)
        p = _prepared()
        p.name, p.key = step.name, step.name
        p.ranked = [(1e-6, s) for _, s in p.ranked]
        return p

    out = _prepare_graph(monkeypatch, ("heavy", "light"), fake_prepare)
    assert out["heavy"].source == "cache"
    assert out["light"].source == "model" and "not measured" in out["light"].note
    # alone, the same light plan is the whole graph: measured
    out = _prepare_graph(monkeypatch, ("light",), fake_prepare)
    assert isinstance(out["light"], PreparedTuning) and out["light"].started


def test_a_memory_bound_plan_keeps_its_candidates_on_a_small_share():
    p = _prepared()
    p.kind = "memory"  # (cheap to compile, and the model ranks their tiles worst)
    p.start(MIN_SHARE_S)
    assert len(p.ranked) == tuner.MEMORY_LEVELS["1"][0] and p.budget_s == MIN_SHARE_S


def test_a_plan_that_cannot_start_keeps_its_time_and_never_raises():
    from tilefuse.tune.search import TuningError

    p = _prepared()
    p.phases["rank"], p.seconds = 0.5, 0.5

    def misfit(schedule):
        raise TuningError("nothing fits")

    p.bench.misfit = misfit
    out = p.try_start(0.2)
    assert out.source == "model" and "nothing fits" in out.note and out.phases["rank"] == 0.5

    def broken(why):
        raise RuntimeError("the model failed too")

    p = _prepared()
    p.bench.misfit, p.unmeasured, p.seconds = misfit, broken, 0.25
    out = p.try_start(0.2)
    assert out.source == "rules" and "the model failed too" in out.note and out.seconds >= 0.25


def test_a_plan_identical_to_an_earlier_one_is_not_prepared_but_weighs_as_a_copy(monkeypatch):
    """Every layer after a model's first repeats its plans: those are reused (`_reuse`), so
    `_prepare_tuning` neither lowers their candidates nor ranks their spaces — it records their
    base lowering and key for `_compile_steps` — and each counts as one more copy of the first
    in the graph's budget: three copies of a plan outweigh one plan predicted twice as slow."""
    prepared = []

    def fake_prepare(step):
        prepared.append(step.name)
        p = _prepared()
        p.name, p.key = step.name, "tuning-" + step.name
        p.ranked = [({"a": 1e-4, "b": 2e-4}[step.name], s) for _, s in p.ranked]
        return p

    names = ("a", "b", "a2", "a3")
    bases: dict = {}
    out = _prepare_graph(monkeypatch, names, fake_prepare, same={"a2": "a", "a3": "a"}, bases=bases,
                         tuning_budget_ms=100)
    assert prepared == ["a", "b"] and set(out) == {"a", "b"}
    assert set(bases) == set(names) and bases["a3"][2] == bases["a"][2] != bases["b"][2]
    assert out["a"].budget_s > out["b"].budget_s  # 3 copies x 1e-4 against 1 x 2e-4
    assert out["a"].budget_s == pytest.approx(0.1 * 3 / 5, rel=1e-2)
    # without the copies, the slower plan takes the larger share
    prepared.clear()
    out = _prepare_graph(monkeypatch, ("a", "b"), fake_prepare, tuning_budget_ms=100)
    assert out["a"].budget_s < out["b"].budget_s


def test_repeated_layers_are_prepared_once_and_compile_right(monkeypatch):
    """The whole path on the interpreter, with the graph's preparation switched on (it runs on
    GPUs): a stack of identical layers prepares each distinct plan once, the later layers take
    the base lowering and key recorded for them, and the result is eager's."""
    import torch

    import tilefuse
    from tilefuse import compiler
    from tilefuse.backends.triton import compile_pool

    calls = []
    real_prepare = compiler.prepare_tuning

    def counting(graph, step, lowering, **kw):
        calls.append(step.name)
        return real_prepare(graph, step, lowering, **kw)

    monkeypatch.setattr(compiler, "_tunes_on_device", lambda target, options: True)
    monkeypatch.setattr(compiler, "prepare_tuning", counting)
    monkeypatch.setattr(compile_pool, "start", lambda *a: False)
    keyed = []
    real_keyed = compiler._keyed_lowering
    monkeypatch.setattr(compiler, "_keyed_lowering", lambda *a: keyed.append(a[1].name) or real_keyed(*a))

    def layers(x, w):
        for _ in range(4):
            x = torch.nn.functional.layer_norm(torch.tanh(x @ w) + x, (x.shape[-1],))
        return x

    x, w = torch.randn(6, 24), torch.randn(24, 24) / 5
    with tilefuse.config.patch(target="interpret", graph_cache=False, fallback="error"):
        torch._dynamo.reset()
        out = torch.compile(layers, backend="tilefuse")(x, w)
    torch.testing.assert_close(out, layers(x.double(), w.double()).float(), rtol=1e-4, atol=1e-4)
    assert calls and len(calls) < len(keyed) / 2, (calls, keyed)
    assert len(keyed) == len(set(keyed))  # each plan lowered once for its key, not again in `_compile_steps`


def test_copies_of_a_cached_or_unmeasured_plan_keep_its_weight_and_choice(monkeypatch):
    """A repeated plan skipped before preparation weighs as its first did when each copy was
    prepared: copies of a tuning-cache hit count in the graph's time once each (so a light plan
    beside three cached copies stays negligible, as with the copies prepared), and a copy of a
    plan left unmeasured takes the same choice, should its reuse fail."""
    def fake_prepare(step):
        if step.name.startswith("a"):
            return TuneOutcome(_space().default, "cache", best_time=1e-3)
        p = _prepared()
        p.name, p.key = step.name, "tuning-" + step.name
        p.ranked = [({"b": 3e-6, "tiny": 1e-9}[step.name.rstrip("0123456789")], s) for _, s in p.ranked]
        return p

    names = ("a", "a2", "a3", "b")
    prepared_each = _prepare_graph(monkeypatch, names, fake_prepare, tuning_budget_ms=100)
    skipped = _prepare_graph(monkeypatch, names, fake_prepare, same={"a2": "a", "a3": "a"}, tuning_budget_ms=100)
    assert prepared_each["b"].source == skipped["b"].source == "model"  # negligible either way
    assert [skipped[n].source for n in ("a2", "a3")] == ["cache", "cache"]
    # without the copies' weight the same light plan is measured
    assert isinstance(_prepare_graph(monkeypatch, ("a", "b"), fake_prepare, tuning_budget_ms=100)["b"],
                      PreparedTuning)
    # a copy of a plan too light to measure: the first's choice, not a measurement of its own
    out = _prepare_graph(monkeypatch, ("a", "tiny", "tiny2"), fake_prepare, same={"tiny2": "tiny"},
                         tuning_budget_ms=100)
    assert out["tiny"].source == "model" and out["tiny2"].source == "model"
    assert out["tiny2"].schedule == out["tiny"].schedule and out["tiny2"].seconds == 0.0


def test_a_plan_an_earlier_graph_tuned_counts_by_its_measured_time(monkeypatch):
    """A plan published by an earlier graph is reused without preparing it; its measured time
    weighs in this graph's like a tuning-cache hit's."""
    from tilefuse import dedupe

    def fake_prepare(step):
        p = _prepared()
        p.name, p.key = step.name, "tuning-" + step.name
        p.ranked = [(1e-6, s) for _, s in p.ranked]
        return p

    key = "plan-from-earlier"
    earlier = dedupe.Shared("earlier_plan", [], [], TuneOutcome(_space().default, "measured", best_time=1e-3), [])
    monkeypatch.setattr(dedupe, "lookup", lambda k: earlier if k == key else None)
    out = _prepare_graph(monkeypatch, ("from-earlier", "b"), fake_prepare, tuning_budget_ms=100)
    assert "from-earlier" not in out and out["b"].source == "model"
    monkeypatch.setattr(dedupe, "lookup", lambda k: None)
    assert isinstance(_prepare_graph(monkeypatch, ("b",), fake_prepare, tuning_budget_ms=100)["b"], PreparedTuning)


def test_a_plans_best_candidates_compile_before_the_next_plan_is_lowered(monkeypatch):
    """With compile workers, a prepared plan's candidates that every `start` keeps (the model's
    cut to two, those that fit) start compiling at once (`PreparedTuning.start_early`), before the
    graph's later plans — repeats included — are lowered and its budget is shared; `start`
    then submits the rest its share keeps. Without workers nothing starts early."""
    events = []

    def fits(schedule):  # no limit: the model's two best are not the cut to two (the default is in it)
        return None

    class Recording(_Bench):
        def misfit(self, schedule):
            return fits(schedule)

        def precompile(self, schedules):
            events.append(("compile", list(schedules)))
            super().precompile(schedules)

    def fake_prepare(step):
        events.append(("prepare", step.name))
        p = _prepared()
        p.name, p.key, p.bench = step.name, "tuning-" + step.name, Recording()
        if step.name == "b":  # a light plan: its share keeps only two candidates
            p.ranked = [(t / 30, s) for t, s in p.ranked]
        return p

    out = _prepare_graph(monkeypatch, ("a", "b", "a2"), fake_prepare, same={"a2": "a"}, events=events,
                         tuning_budget_ms=600)
    kinds = [e[0] for e in events]
    assert kinds == ["lower", "prepare", "compile", "lower", "prepare", "compile", "lower", "compile", "compile"], \
        events  # each plan's early compiles come before the next plan's lowering, a2's repeat included
    early = {"a": events[2][1], "b": events[5][1]}
    fitting = [s for _, s in rank(_space(), NOMINAL, keep=tuner.MIN_KEPT) if not fits(s)]
    assert early["a"] == early["b"] == fitting and len(fitting) == tuner.MIN_KEPT
    assert [s for _, s in _prepared().ranked[:2]] != fitting  # (not merely the two best predicted)
    assert len(out["b"].ranked) == tuner.MIN_KEPT  # (the light plan's share keeps the fewest)
    for name in ("a", "b"):  # whatever the share, every early candidate is among those kept
        assert set(early[name]) <= {s for _, s in out[name].ranked} <= set(out[name].bench.compiling)
    events.clear()
    _prepare_graph(monkeypatch, ("a", "b"), fake_prepare, pool=False, events=events, tuning_budget_ms=600)
    assert [e[0] for e in events] == ["lower", "prepare", "lower", "prepare"]


def test_an_early_start_that_fails_leaves_the_plan_to_its_start(monkeypatch):
    p = _prepared()

    def misfit(schedule):
        raise ValueError("a lowering bug")

    p.bench.misfit = misfit
    p.start_early()
    assert not p.bench.compiling and not p.started
    assert p.try_start(0.2).source == "rules"


def test_lowering_candidates_leaves_the_plans_notes_as_they_were():
    """Checking and loading candidates lowers them, which annotates the plan; outside
    `prepare_tuning` (an early start, a start after the budget is shared) those notes are taken
    off again: only the final lowering's belong in the compile report."""
    from types import SimpleNamespace

    class Annotating(_Bench):
        def __init__(self):
            super().__init__()
            epilogue = SimpleNamespace(notes=["the epilogue's own"])  # (`impl=split` lowers it)
            self.plan = SimpleNamespace(notes=["the plan's own"],
                                        library=SimpleNamespace(split=SimpleNamespace(epilogue=epilogue)))

        def misfit(self, schedule):
            self.plan.notes.append(f"lowered {schedule}")
            self.plan.library.split.epilogue.notes.append("its epilogue lowered")
            return None

        def precompile(self, schedules):
            self.plan.notes.append("loaded")
            super().precompile(schedules)

    p = _prepared()
    p.bench = Annotating()
    p.start_early()
    assert p.bench.compiling and p.bench.plan.notes == ["the plan's own"]
    p.start(0.2)
    assert p.started and p.bench.plan.notes == ["the plan's own"]
    assert p.bench.plan.library.split.epilogue.notes == ["the epilogue's own"]
