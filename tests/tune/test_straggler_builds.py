"""A tuning candidate still compiling in a worker long after another candidate of its plan
finished compiling is left out (`tuner._Bench.ready`, `STRAGGLER_FACTOR`): a kernel that compiles
several times longer than its siblings is usually one whose registers spill (T5's decoder
attention: 9.8 s against 3.3 s), and the plan's compile would wait for it. A compile is waited
for while fewer of the plan's other candidates have finished compiling than are still
compiling, while it is still queued for a worker, and whenever the pool cannot be relied on
(`compile_pool.wait` decides then). A
candidate left out may still be raced by the suspect-time rebuild (`tuner._measure`)."""
import time

import pytest

from tilefuse.cache.disk import cache_key
from tilefuse.tile.schedule import Schedule
from tilefuse.tune import tuner
from tilefuse.tune.cost import NOMINAL

A, B, C, D = (Schedule(BLOCK_M=m) for m in (16, 32, 64, 128))


class _Compile:
    """A kernel compiling in a worker from `start` (monotonic seconds) for `seconds`, reported as
    `TritonKernel.compiling` does: done with no time once launched (the launch ends the worker's
    part), no time for a failed compile, None while the pool cannot be relied on."""

    def __init__(self, start: float, seconds: float, failed: bool = False, unreliable: bool = False,
                 launch_fails: bool = False):
        self.start, self.seconds, self.failed, self.unreliable = start, seconds, failed, unreliable
        self.launch_fails = launch_fails
        self.launched = False

    def compiling(self):
        if self.unreliable:
            return None
        now = time.monotonic()
        if self.launched:
            return True, None, None
        if now < self.start:
            return False, None, None  # queued
        if now - self.start >= self.seconds:
            return True, None, None if self.failed else self.seconds
        return False, now - self.start, None


def _bench(compiles: dict):
    """A `_Bench` whose candidates are the keys of `compiles` (their kernels' compiles)."""
    bench = object.__new__(tuner._Bench)
    bench.plan = type("Plan", (), {"name": "kernel0"})()
    bench.loaded = dict(compiles)
    bench.compile_s, bench.left_out, bench.waited = {}, set(), []

    def kernels(schedule):  # the real one waits for the compile, then launches the kernels once
        while not all(k.unreliable or k.compiling()[0] for k in compiles[schedule]):
            time.sleep(0.002)
        for k in compiles[schedule]:
            k.launched = True  # (a launch ends the worker's part, failed or not)
        if any(k.failed or k.launch_fails for k in compiles[schedule]):
            raise RuntimeError("the compile failed")
        bench.waited.append(schedule)

    bench._kernels = kernels
    return bench


def _built(ok):
    return [s for _, s in ok]


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(tuner, "STRAGGLER_MIN_S", 0.05)


def test_a_straggling_compile_is_left_out():
    now = time.monotonic()
    compiles = {A: [_Compile(now, 0.05)], B: [_Compile(now, 0.06)], C: [_Compile(now, 30.0)],
                D: [_Compile(now, 0.02), _Compile(now, 0.055)]}
    bench = _bench(compiles)
    t0 = time.monotonic()
    ok, failed = bench.ready([(1.0, A), (2.0, B), (3.0, C), (4.0, D)])
    assert _built(ok) == [A, B, D] and bench.waited == [A, B, D]
    assert [s for s, _ in failed] == [C] and "still compiling" in failed[0][1] and bench.left_out == {C}
    assert time.monotonic() - t0 < 10.0  # C is given up long before its 30 s


def test_slow_compiles_are_no_stragglers_while_most_are_slow():
    """One candidate compiled quickly and four are still compiling: a host where compiles are
    slow (the first graph's workers warming up), not four spilling kernels — all are built
    (a window attention's forward was left with its one quick candidate, 1.28× slower)."""
    now = time.monotonic()
    compiles = {A: [_Compile(now, 0.01)], B: [_Compile(now, 0.3)], C: [_Compile(now, 0.32)],
                D: [_Compile(now, 0.34)]}
    ok, failed = _bench(compiles).ready([(1.0, A), (2.0, B), (3.0, C), (4.0, D)])
    assert _built(ok) == [A, B, C, D] and not failed


def test_candidates_compiled_elsewhere_do_not_hold_the_rule_off():
    """A candidate with nothing compiling in a worker (a library call, a kernel found on disk)
    counts neither as finished nor as compiling: beside two quick ones it does not stop a
    spilling compile from being left out."""
    now = time.monotonic()
    compiles = {A: [_Compile(now, 0.01)], B: [], C: [], D: [_Compile(now, 30.0)]}
    bench = _bench(compiles)
    ok, failed = bench.ready([(1.0, A), (2.0, B), (3.0, C), (4.0, D)])
    assert _built(ok) == [A, B, C] and [s for s, _ in failed] == [D]


def test_a_candidate_built_earlier_is_the_reference():
    """The first launch ends a kernel's worker compile (its time is no longer reported): the
    time is remembered when the candidate is built."""
    now = time.monotonic()
    bench = _bench({A: [_Compile(now, 0.03)], B: [_Compile(now, 30.0)]})
    ok, failed = bench.ready([(1.0, A), (2.0, B)])
    assert _built(ok) == [A] and [s for s, _ in failed] == [B]
    assert bench.compile_s == {A: 0.03}


def test_the_best_ranked_candidate_is_left_out_too_once_another_compiled():
    now = time.monotonic()
    ok, failed = _bench({A: [_Compile(now, 30.0)], B: [_Compile(now, 0.01)]}).ready([(1.0, A), (2.0, B)])
    assert _built(ok) == [B] and [s for s, _ in failed] == [A]


def test_a_long_compile_with_nothing_else_finished_is_waited_for():
    now = time.monotonic()
    ok, failed = _bench({A: [_Compile(now, 0.3)], B: [_Compile(now, 0.35)]}).ready([(1.0, A), (2.0, B)])
    assert _built(ok) == [A, B] and not failed
    ok, failed = _bench({A: [_Compile(time.monotonic(), 0.2)]}).ready([(1.0, A)])
    assert _built(ok) == [A] and not failed


def test_a_failed_compile_is_no_reference():
    now = time.monotonic()
    compiles = {A: [_Compile(now, 0.01, failed=True)], B: [_Compile(now, 0.3)]}
    ok, failed = _bench(compiles).ready([(1.0, A), (2.0, B)])
    assert _built(ok) == [B] and [s for s, _ in failed] == [A] and "compile failed" in failed[0][1]


def test_a_queued_compile_is_waited_for_until_it_runs_too_long():
    now = time.monotonic()
    compiles = {A: [_Compile(now, 0.02)], B: [_Compile(now + 0.2, 0.03)], C: [_Compile(now + 0.2, 30.0)]}
    ok, failed = _bench(compiles).ready([(1.0, A), (2.0, B), (3.0, C)])
    # B queued for longer than a straggler may run, then compiled quickly: built
    assert _built(ok) == [A, B] and [s for s, _ in failed] == [C]


def test_nothing_is_left_out_where_the_pool_cannot_be_relied_on():
    """No worker ready yet, or the pool closed: the launch's own wait decides (it takes the
    compile back, or gives the pool up), so every candidate is built."""
    now = time.monotonic()
    compiles = {A: [_Compile(now, 0.01)], B: [_Compile(now, 0.3, unreliable=True)]}
    ok, failed = _bench(compiles).ready([(1.0, A), (2.0, B)])
    assert _built(ok) == [A, B] and not failed
    ok, failed = _bench({A: [], B: []}).ready([(1.0, A), (2.0, B)])  # (kernels compiled in this process)
    assert _built(ok) == [A, B] and not failed


def test_a_left_out_candidate_can_still_be_raced():
    """The suspect-time rebuild (the best built candidate far slower than predicted) builds the
    candidates left out too: their compiles have usually finished by then."""
    now = time.monotonic()
    bench = _bench({A: [_Compile(now, 0.01)], B: [_Compile(now, 0.5)]})
    bench.target = None
    times = {A: 1.0, B: 1e-6}
    bench.measure = lambda schedule: times[schedule]
    space = type("Space", (), {"kind": "compute"})()
    p = tuner.PreparedTuning("kernel0", cache_key("straggler", time.time()), "compute", "1", None,
                             [(1e-6, A), (1e-6, B)], bench, NOMINAL, space, budget_s=0.05)
    out = tuner._measure(p)
    assert bench.left_out == {B} and bench.waited == [A, B]
    assert out.schedule == B


def test_stragglers_are_built_after_all_when_nothing_else_runs():
    now = time.monotonic()
    compiles = {A: [_Compile(now, 0.4)], B: [_Compile(now, 0.01, launch_fails=True)]}
    bench = _bench(compiles)
    ok, failed = bench.ready([(1.0, A), (2.0, B)])
    assert _built(ok) == [A] and [s for s, _ in failed] == [B]


def test_a_straggler_left_out_is_no_reference_once_it_finishes(monkeypatch):
    """C is left out against A's compile and finishes while D, queued late, compiles: D is
    judged against A (allowed 0.25 s) and left out, not against C's 0.3 s (allowed 0.45 s)."""
    monkeypatch.setattr(tuner, "STRAGGLER_MIN_S", 0.25)
    now = time.monotonic()
    compiles = {A: [_Compile(now, 0.02)], C: [_Compile(now, 0.3)], D: [_Compile(now + 0.28, 0.35)]}
    ok, failed = _bench(compiles).ready([(1.0, A), (2.0, C), (3.0, D)])
    assert _built(ok) == [A] and [s for s, _ in failed] == [C, D]


def test_the_pool_reports_a_compile_as_it_goes():
    from concurrent.futures import Future
    from types import SimpleNamespace

    from tilefuse.backends.triton.compile_pool import WAIT_S, compile_progress

    assert compile_progress(None) == (True, None, None)
    future = Future()
    future.pool = SimpleNamespace(closed=False, ready_at=[0.5], last_progress=time.monotonic())
    future.started = None
    assert compile_progress(future) == (False, None, None)  # queued
    future.started = time.monotonic() - 1.5
    done, running, took = compile_progress(future)
    assert not done and 1.4 < running < 60 and took is None
    future.pool.ready_at = []  # no worker ready yet: `wait` takes it back
    assert compile_progress(future) is None
    future.pool.ready_at, future.pool.closed = [0.5], True
    assert compile_progress(future) is None
    future.pool.closed = False
    future.started = time.monotonic() - WAIT_S - 1  # a compile past the pool's patience
    assert compile_progress(future) is None
    future.started, future.pool.last_progress = None, time.monotonic() - WAIT_S - 1  # a queue standing still
    assert compile_progress(future) is None
    future.took = 2.5
    future.set_result(("", "digest"))
    assert compile_progress(future) == (True, None, 2.5)
