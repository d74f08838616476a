"""A tuning candidate still compiling in a worker long after its plan's others were built is
left out (`tuner._Bench.ready`, `STRAGGLER_FACTOR`): a kernel that compiles several times longer
than its siblings is usually one whose registers spill (T5's decoder attention: 9.8 s against
3.3 s), and the plan's compile would wait for it. A compile is waited for while no other
candidate of the plan has finished compiling, and while it is still queued for a worker."""
import random
import time

import pytest

from tilefuse.tile.schedule import Schedule
from tilefuse.tune import tuner

A, B, C, D = (Schedule(BLOCK_M=m) for m in (16, 32, 64, 128))


class _Compile:
    """A kernel compiling in a worker from `start` (monotonic seconds; None: never queued) for
    `seconds`, as `TritonLauncher.compiling` reports it."""

    def __init__(self, start: float, seconds: float):
        self.start, self.seconds = start, seconds

    def compiling(self):
        now = time.monotonic()
        if now < self.start:
            return False, None, None  # queued
        if now - self.start >= self.seconds:
            return True, None, self.seconds
        return False, now - self.start, None


def _bench(compiles: dict):
    """A `_Bench` whose candidates are the keys of `compiles` (their kernels' compiles)."""
    bench = object.__new__(tuner._Bench)
    bench.plan = type("Plan", (), {"name": "kernel0"})()
    bench.loaded = {schedule: kernels for schedule, kernels in compiles.items()}
    bench.waited = []

    def kernels(schedule):  # the real one waits for the compile, then runs the kernels once
        while not all(k.compiling()[0] for k in compiles[schedule]):
            time.sleep(0.002)
        bench.waited.append(schedule)

    bench._kernels = kernels
    return bench


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(tuner, "STRAGGLER_MIN_S", 0.05)


def test_a_straggling_compile_is_left_out(quick):
    now = time.monotonic()
    first = random.uniform(0.04, 0.06)
    compiles = {A: [_Compile(now, first)], B: [_Compile(now, first * 1.2)],
                C: [_Compile(now, 30.0)], D: [_Compile(now, first * 0.5), _Compile(now, first * 1.1)]}
    bench = _bench(compiles)
    t0 = time.monotonic()
    ok, failed = bench.ready([(1.0, A), (2.0, B), (3.0, C), (4.0, D)])
    assert [s for _, s in ok] == [A, B, D]
    assert [s for s, _ in failed] == [C] and "still compiling" in failed[0][1]
    assert bench.waited == [A, B, D]
    # c is given up once it has run 1.5 × b's compile (the longest built), not after its 30 s
    assert time.monotonic() - t0 < 5 * first + 1.0


def test_the_best_ranked_candidate_is_left_out_too_once_another_compiled(quick):
    now = time.monotonic()
    compiles = {A: [_Compile(now, 30.0)], B: [_Compile(now, 0.01)]}
    ok, failed = _bench(compiles).ready([(1.0, A), (2.0, B)])
    assert [s for _, s in ok] == [B] and [s for s, _ in failed] == [A]


def test_a_long_compile_with_nothing_else_finished_is_waited_for(quick):
    now = time.monotonic()
    compiles = {A: [_Compile(now, 0.3)], B: [_Compile(now, 0.35)]}
    ok, failed = _bench(compiles).ready([(1.0, A), (2.0, B)])
    assert [s for _, s in ok] == [A, B] and not failed
    ok, failed = _bench({A: [_Compile(time.monotonic(), 0.2)]}).ready([(1.0, A)])
    assert [s for _, s in ok] == [A] and not failed


def test_a_queued_compile_is_waited_for_until_it_runs_too_long(quick):
    now = time.monotonic()
    compiles = {A: [_Compile(now, 0.02)], B: [_Compile(now + 0.2, 0.03)], C: [_Compile(now + 0.2, 30.0)]}
    ok, failed = _bench(compiles).ready([(1.0, A), (2.0, B), (3.0, C)])
    # B queued for longer than a straggler may run, then compiled quickly: built
    assert [s for _, s in ok] == [A, B] and [s for s, _ in failed] == [C]


def test_kernels_compiled_in_this_process_are_never_left_out(quick):
    """Without compile workers nothing reports a compile's time: every candidate is built."""
    bench = _bench({A: [], B: []})
    ok, failed = bench.ready([(1.0, A), (2.0, B)])
    assert [s for _, s in ok] == [A, B] and not failed
