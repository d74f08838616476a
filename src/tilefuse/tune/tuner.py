"""Autotuning of one kernel plan: find its schedule in the tuning cache, or rank the
plan's schedule space with the cost model, measure the best candidates with the bandit search
within a time budget, and store the winner.

`TILEFUSE_AUTOTUNE`: `0` — no measurement, the cost model's choice (the rules' default unless
the model predicts a clear win); `1` (default) — the model's best 8 candidates (6 for a
memory-bound kernel), measured for at most 0.5 s (0.25 s), within a budget per graph (below);
`max` — up to 32 candidates, measured for up to 60 s. Only kernels with static sizes are
measured, on synthetic inputs of the plan's shapes.

**A graph's budget** (`1` only, the `tuning_budget_ms` knob): tuning is worth what the kernel's time is
worth, so a graph's measuring time is shared among its plans in proportion to the model's
predicted time of each (times the number of identical plans it stands for: one tuning serves
every layer), each share capped at the plan's own budget above, and candidates are kept in
proportion to the share for compute-bound plans (at least two, and the best of each kind of
kernel: the library's product among them; a memory-bound plan keeps its level's candidates,
cheap to compile). Every plan is measured at least briefly — the model's error on one
kernel (a layer norm's backward predicted at 12 µs ran 49–84 µs by its tiles) is larger than
its margins — except those under `NEGLIGIBLE` of the graph's predicted time: the model
chooses their schedules, and only the candidates started early are lowered and compiled
(`allot_budgets`, `PreparedTuning.start_early`, `PreparedTuning.start`).

Tuning is two steps, so that a graph's compiles overlap: `prepare_tuning` ranks a plan's
candidates and starts compiling their kernels (Triton: in `compile_pool`'s worker processes;
C++: in the build pool), and `tune_plan` then waits for them, runs each once, and measures —
the budget counts measurements only, never a compile. The compiler prepares every plan of a
graph before it measures the first. The machinery is backend-neutral: the same spaces,
search and cache tune the C++ kernels of the CPU backend (host-timed), at `max` — each
candidate is a C++ compile, and the CPU backend's default keeps a new kernel under a second;
at the default level the CPU measures only a large static product against the library (a
race of two, `library_race`).

No schedule over the target's limits (`tile.limits`) is compiled: candidates are lowered and
checked before the search measures any, and a tuning-cache record that is not one of the
space's schedules, or does not fit, is discarded and tuned again. The chosen schedule (a
`tile.schedule.Schedule`) is what the compiler lowers the plan with.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field, replace

from .. import logs
from ..tile.lower import LoweringOptions, lower_plan_kernels, schedule_space
from ..tile.registry import family
from ..tile.schedule import Schedule
from ..tile.space import describe
from .cache import TuningCache, tuning_key
from .cost import NOMINAL, Ceilings, choose_without_measuring, measure_ceilings, rank
from .search import Candidate, TuningError, search

#: level -> (candidates measured, seconds of measurement); candidates are compiled (in parallel)
#: and run once before the budget starts, so the default's half second is all timing: a graph's
#: dozen distinct kernels tune in a few seconds
LEVELS = {"1": (8, 0.5), "max": (32, 60.0)}
#: memory-bound kernels (reductions, pointwise) gain little from tuning: a smaller search
MEMORY_LEVELS = {"1": (6, 0.25), "max": (16, 20.0)}
#: the CPU backend (C++ kernels, a compile per candidate): measured only when asked for
CPU_LEVELS = {"max": (12, 20.0)}
#: the CPU's default level races a product's generated kernel (the rules' schedule) against the
#: library (`library_race`): two candidates, briefly
CPU_RACE_LEVELS = {"1": (2, 0.05)}
#: level -> seconds for building the candidates before measuring (all of them, when a pool of
#: compile workers builds them side by side; the best-ranked, when they compile one by one)
BUILD_S = {"1": 8.0, "max": 60.0}
#: a plan whose best built candidate ran this many times slower than the model predicted, while
#: the build budget left candidates unbuilt, builds and measures those too (on the H200 the
#: best candidates run 1.5–15× the model's time; a spilling tile of T5's attention ran 185×)
SUSPECT_RATIO = 32.0
#: the least a measured plan gets (its default and the best of each kind of kernel, briefly)
MIN_SHARE_S = 0.02
#: a plan under this fraction of its graph's predicted time is not measured (the model chooses)
NEGLIGIBLE = 0.002
#: the fewest candidates a measured plan keeps, however small its share: the first of them start
#: compiling as soon as the plan is ranked (`PreparedTuning.start_early`)
MIN_KEPT = 2
#: seconds of measurement per candidate kept (a plan with a small share measures fewer)
SECONDS_PER_CANDIDATE = 0.04
#: CPU seconds a candidate's compile costs (a Triton kernel: LLVM and ptxas, 0.5–2 s on an H200
#: host; the compile workers share them out)
COMPILE_S_PER_CANDIDATE = 1.0
#: a candidate whose compile in a worker has run this many times as long as the longest finished
#: compile of another candidate of its plan (and at least `STRAGGLER_MIN_S`) is left out: a
#: kernel that compiles several times longer than its siblings is usually one whose registers
#: spill (T5's decoder attention on an H100: its two candidates compiled in 3.3 s and 9.8 s, one
#: of them with 4.4 KB of stack), and the plan's compile would wait for it; only once at least as
#: many of the others have finished as are still compiling (an outlier, not a slow host)
STRAGGLER_FACTOR = 1.5
STRAGGLER_MIN_S = 2.0
#: at most this many samples per candidate (the bandit's bookkeeping grows with the samples, and a
#: fast kernel would otherwise take thousands within the budget)
SAMPLES_PER_CANDIDATE = {"1": 6, "max": 16}


@dataclass
class TuneOutcome:
    schedule: Schedule | None  # None: the plan has nothing to tune (the lowering's rules choose)
    source: str  # "rules" | "model" | "cache" | "measured"
    seconds: float = 0.0  # time spent tuning (lookups and measurements)
    measured: int = 0  # measurements taken
    best_time: float | None = None  # measured seconds per launch of the chosen configuration
    note: str = ""
    #: where `seconds` went, for the compile-time report: "rank" (the space ranked, the default
    #: lowered for the key), "check" (candidates lowered and checked against the target),
    #: "submit" (their sources generated and sent to the compile workers), "build" (waiting for
    #: them and their first run), "measure" (the search)
    phases: dict = field(default_factory=dict)

    def describe(self) -> str:
        if self.schedule is None:
            return f"schedule by the lowering's rules ({self.note})" if self.note else ""
        what = {"model": "cost model (not measured)", "cache": "tuning cache hit (not re-measured)",
                "measured": f"measured {self.measured} runs in {self.seconds:.1f} s"}.get(self.source, self.source)
        best = f", {self.best_time * 1e6:.1f} us" if self.best_time else ""
        why = f" ({self.note})" if self.note else ""
        return f"schedule {describe(self.schedule)} — {what}{best}{why}"


def shallower_pipeline(schedule: Schedule, err: Exception, schedules=None) -> Schedule | None:
    """The schedule with one pipeline stage fewer, for a candidate Triton refused for want of
    shared memory (None for any other failure, one stage already, or a stage count outside
    `schedules`, the space's configurations: the tuning cache accepts only those). The limits
    check counts a product's pipelined operands; a persistent kernel whose epilogue loads tiles
    of its own (a residual, a dropout mask) holds those while the next tile's operands load, so
    Triton may need more than that — as the runtime does for a refused launch, the same tiles
    with a shallower pipeline are tried instead of dropping the candidate."""
    stages = schedule.get("stages")
    if type(err).__name__ != "OutOfResources" or "shared memory" not in str(err) \
            or not isinstance(stages, int) or stages <= 1:
        return None
    shallower = schedule.replace(stages=stages - 1)
    return shallower if schedules is None or shallower in schedules else None


_ceilings: dict = {}


def device_ceilings(device) -> Ceilings:
    """Measured once per device and process, and cached on disk across processes."""
    if device.type != "cuda":
        return NOMINAL
    key = str(device)
    if key not in _ceilings:
        from ..cache.disk import DiskCache, cache_key, environment_fingerprint

        cache = DiskCache("tune-ceilings")
        entry = cache.get_or_create(cache_key("ceilings", environment_fingerprint()),
                                    lambda: {"ceilings.json": measure_ceilings(device).to_json().encode()})
        try:
            _ceilings[key] = Ceilings.from_json(entry["ceilings.json"].decode()) if entry else measure_ceilings(device)
        except (KeyError, TypeError, ValueError):
            _ceilings[key] = measure_ceilings(device)
    return _ceilings[key]


@dataclass
class PreparedTuning:
    """A plan's tuning up to its measurements: the candidates the model ranked, whose kernels
    are compiling (`tune_plan(prepared=...)` measures them)."""

    name: str
    key: str
    kind: str
    level: str
    levels: dict | None
    ranked: list
    bench: "_Bench"
    ceilings: Ceilings
    space: object
    seconds: float = 0.0
    budget_s: float | None = None  # its share of the graph's budget (None: its level's budget)
    started: bool = False  # candidates checked against the target and compiling
    candidate_s: float = SECONDS_PER_CANDIDATE  # what each kept candidate costs of a share (`candidate_seconds`)
    phases: dict = field(default_factory=dict)  # as `TuneOutcome.phases`

    @property
    def predicted(self) -> float:
        """The model's predicted seconds per launch of the best candidate."""
        return self.ranked[0][0] if self.ranked else 0.0

    def start(self, budget_s: float | None = None) -> None:
        """Keep the candidates that fit the target (as many as `budget_s` measures well) and
        start compiling them."""
        if self.started:
            return
        t0 = time.perf_counter()
        self.budget_s = budget_s
        keep, _ = _level(self.levels, self.kind, self.level)
        if budget_s is not None and self.kind != "memory":
            # (a memory-bound kernel keeps its candidates: they compile in a fraction of a second,
            # and the model ranks their tiles worst — a layer norm's backward ran 1.8x slower with two)
            keep = max(MIN_KEPT, min(keep, int(budget_s / self.candidate_s + 0.5)))
        with real_tensors(), _notes_kept(self.bench):
            everything = rank(self.space, self.ceilings)
            head = rank(self.space, keep=keep, scored=everything) if keep < len(self.ranked) else self.ranked
            self.ranked = _fitting(head, everything, keep, self.bench.misfit, self.name)
        self._submit(t0, [schedule for _, schedule in self.ranked])
        self.started = True

    def start_early(self) -> None:
        """Start compiling the candidates every `start` keeps, before the graph's budget is
        shared: those of the model's cut to `MIN_KEPT` (the best, or the rules' default and the
        best of each kind of kernel) that fit the target. A cut to more candidates contains
        them, and a plan keeps at least `MIN_KEPT`, so whatever its share `start` keeps these
        (a plan the budget leaves unmeasured wasted their compiles). The graph's other plans are
        lowered and ranked meanwhile, so its compiles begin that much sooner."""
        if self.started:
            return
        t0 = time.perf_counter()
        try:
            with real_tensors(), _notes_kept(self.bench):
                cut = rank(self.space, self.ceilings, keep=MIN_KEPT)
                head = [schedule for _, schedule in cut if not self.bench.misfit(schedule)]
        except Exception as err:  # noqa: BLE001 — `try_start` meets it again and decides
            logs.log("tune", "%s: not started early: %s: %s", self.name, type(err).__name__, err)
            return
        self._submit(t0, head)

    def _submit(self, t0: float, schedules: list) -> None:
        """Count the check since `t0`, then start compiling `schedules` (the submit phase)."""
        t1 = time.perf_counter()
        add_phase(self.phases, "check", t1 - t0)
        with _notes_kept(self.bench):
            self.bench.precompile(schedules)
        add_phase(self.phases, "submit", time.perf_counter() - t1)
        self.seconds += time.perf_counter() - t0

    def try_start(self, budget_s: float | None = None) -> "TuneOutcome | None":
        """`start`, or the outcome that replaces this plan's measurement when it cannot start:
        the model's choice when no candidate fits the target, the rules' when lowering one
        fails (tuning is an optimisation: never the reason a graph fails)."""
        try:
            self.start(budget_s)
            return None
        except TuningError as err:
            logs.log("tune", "%s: %s", self.name, err)
            why = str(err)[:200]
        except Exception as err:  # noqa: BLE001
            logs.log("tune", "%s: tuning failed, the rules choose: %s: %s", self.name, type(err).__name__, err)
            return self._rules(err)
        try:
            return self.unmeasured(why)
        except Exception as err:  # noqa: BLE001
            return self._rules(err)

    def _rules(self, err: Exception) -> "TuneOutcome":
        return TuneOutcome(None, "rules", self.seconds, note=f"tuning failed: {type(err).__name__}: {err}"[:200],
                           phases=dict(self.phases))

    def unmeasured(self, why: str) -> "TuneOutcome":
        """The model's choice instead of a measurement."""
        return TuneOutcome(choose_without_measuring(self.space, self.ceilings), "model", self.seconds, note=why,
                           phases=dict(self.phases))


@contextlib.contextmanager
def _notes_kept(bench):
    """Lowering candidates annotates the plan (and, for `impl=split`, its epilogue's plan): their
    notes as they were before (only the final lowering's belong in the compile report), as
    `prepare_tuning` keeps them."""
    plan = getattr(bench, "plan", None)
    split = getattr(getattr(plan, "library", None), "split", None)
    plans = [p for p in (plan, getattr(split, "epilogue", None)) if p is not None]
    kept = [list(p.notes) for p in plans]
    try:
        yield
    finally:
        for p, notes in zip(plans, kept):
            p.notes[:] = notes


def prepare_tuning(graph, plan, options: LoweringOptions, *, level: str, device,
                   aten=None, start: bool = True) -> "PreparedTuning | TuneOutcome":
    """Rank the plan's candidates and (`start`) start compiling them; a `TuneOutcome` where
    nothing is left to measure (rules, the model's choice, a tuning-cache hit). Unstarted, the
    candidates are the model's ranking, not yet checked against the target
    (`PreparedTuning.start`)."""
    t0 = time.perf_counter()
    notes = list(plan.notes)
    try:
        out = _prepare(graph, plan, options, level, device, aten)
        if start and isinstance(out, PreparedTuning):
            out = out.try_start() or out
    except Exception as err:  # noqa: BLE001 — tuning is an optimisation: never the reason a graph fails
        logs.log("tune", "%s: tuning failed, the rules choose: %s: %s", plan.name, type(err).__name__, err)
        out = TuneOutcome(None, "rules", note=f"tuning failed: {type(err).__name__}: {err}"[:200])
    finally:
        plan.notes[:] = notes  # lowering candidates annotates the plan: keep only the final lowering's notes
    spent = time.perf_counter() - t0
    out.seconds = spent  # (a start's own count is inside this window)
    add_phase(out.phases, "rank", spent - sum(out.phases.values()))
    return out


def add_phase(phases: dict, name: str, seconds: float) -> None:
    """Add `seconds` to a `TuneOutcome.phases` entry."""
    phases[name] = phases.get(name, 0.0) + seconds


def tune_plan(graph, plan, options: LoweringOptions, *, level: str, device, aten=None,
              prepared: "PreparedTuning | TuneOutcome | None" = None, progress=None) -> TuneOutcome:
    """`aten`: builds the plan's library step — the whole plan (a plain matmul), measured as
    `impl=aten`, or its product, measured with the epilogue's kernels after it as `impl=split`.
    `prepared`: this plan's `prepare_tuning` (else it is prepared here). `progress(runs, total,
    best seconds)`: told after each measurement."""
    if prepared is None:
        prepared = prepare_tuning(graph, plan, options, level=level, device=device, aten=aten)
    if isinstance(prepared, TuneOutcome):
        return prepared
    t0 = time.perf_counter()
    before = prepared.seconds  # (a start here adds to it: counted once, in this call's window)
    notes = list(plan.notes)
    try:
        prepared.start(prepared.budget_s)  # (started by its graph's budget, or here with its share)
        with real_tensors():
            outcome = _measure(prepared, progress)
    except TuningError as err:  # nothing measurable: the model's choice, and say why
        logs.log("tune", "%s: %s", plan.name, err)
        outcome = TuneOutcome(choose_without_measuring(prepared.space, prepared.ceilings), "model",
                              note=str(err)[:200])
    except Exception as err:  # noqa: BLE001 — tuning is an optimisation: never the reason a graph fails
        logs.log("tune", "%s: tuning failed, the rules choose: %s: %s", plan.name, type(err).__name__, err)
        outcome = TuneOutcome(None, "rules", note=f"tuning failed: {type(err).__name__}: {err}"[:200])
    finally:
        plan.notes[:] = notes
    outcome.seconds = before + time.perf_counter() - t0
    outcome.phases = dict(prepared.phases)
    return outcome


def _prepare(graph, plan, options: LoweringOptions, level: str, device, aten):
    target = options.target
    if target.interpret or target.generate is None or options.flash_config or options.flash_split:
        return TuneOutcome(None, "rules")  # the interpreter's tiles, or the user's own choice
    space = schedule_space(graph, plan, options)
    if space is None or (target.on_cpu and not family(plan.kind).tuned_on_cpu):
        return TuneOutcome(None, "rules")
    static = all(v is not None for v in space.sizes.values())
    measurable = static and (level in LEVELS and device.type == "cuda" or level in CPU_LEVELS and target.on_cpu)
    levels = CPU_LEVELS if target.on_cpu else None
    if target.on_cpu and not measurable and static and level in CPU_RACE_LEVELS and "impl" in space.knobs:
        space, levels, measurable = library_race(space), CPU_RACE_LEVELS, True
    if target.on_cpu and not measurable:  # the model's terms are the GPU's: the rules choose
        return TuneOutcome(None, "rules")
    with real_tensors():
        ceilings = device_ceilings(device) if measurable else NOMINAL
    if not measurable:
        return TuneOutcome(choose_without_measuring(space, ceilings), "model")
    # a mask read from data is measured as visited everywhere (its block summary off): the
    # synthetic inputs (zeros for booleans) say nothing of which tiles the real mask kills, and
    # the per-tile cost is what the schedule decides
    options = replace(options, block_summary=False)
    default_kernels = lower_plan_kernels(graph, plan, replace(options, schedule=space.default))
    source = canonical_source("\n".join(target.generate(tk) for tk in default_kernels), default_kernels)
    dtypes = sorted({str(graph[n].dtype) for tk in default_kernels for n in tk.reads if n in graph.nodes})
    extra = {k: list(v) for k, v in space.knobs.items()}  # a new knob invalidates old results
    if target.on_cpu:  # (which C++ kernel or library call wins depends on the processor and its threads)
        extra["host"] = cpu_description()
    key = tuning_key(source, space.sizes, dtypes, {"name": ceilings.name, "kind": space.kind}, extra=extra)
    bench = _Bench(graph, plan, options, device, aten)
    bench.schedules = space.schedules()  # (a shallower retry stays a configuration the cache accepts)
    with real_tensors():
        found = candidates(space, key, level, ceilings, TuningCache(), plan.name, levels=levels,
                           misfit=bench.misfit, fit=False)
    if isinstance(found, TuneOutcome):
        return found
    return PreparedTuning(plan.name, key, space.kind, level, levels, found, bench, ceilings, space)


def cpu_description() -> str:
    """The processor (`toolchain.cpu_id`: its model and features) and the threads ATen and the
    kernels use."""
    import torch

    from ..backends.cpu import toolchain

    return f"{toolchain.cpu_id()}, {torch.get_num_threads()} threads"


def library_race(space):
    """`space` cut down to the rules' generated kernel and the library (`impl`): on a CPU, where
    which of the two wins depends on the host (MKL's sgemm runs AVX2 code on AMD processors,
    oneDNN's bf16 product costs about 12 µs a call however small; on a 2-core Zen host a
    generated 64×64×64 bf16 product took 13.5 µs against the library's 25, a 1024³ fp32 one
    5.7 ms against 9.9, while a 256³ bf16 one took 95 µs against 62), the two are measured."""
    from ..tile.space import ScheduleSpace

    default = space.default
    knobs = {name: (default[name],) for name in space.knobs if name != "impl" and name in default}
    knobs["impl"] = tuple(space.knobs["impl"])
    return ScheduleSpace(space.kind, knobs, default, sizes=dict(space.sizes), itemsize=space.itemsize,
                         families=("impl",), plan_kind=space.plan_kind)


def allot_budgets(weights: list, total: float, caps: list, floor: float = MIN_SHARE_S,
                  negligible: float = NEGLIGIBLE) -> list:
    """Shares of `total` seconds in proportion to `weights` (a plan's predicted time times the
    plans it stands for), none above its `caps` entry (what that plan can use: the excess goes
    to the rest by the same proportions) and none under `floor`, which every plan gets (a few
    candidates measured briefly: the model's error on one kernel exceeds its margins) unless
    its weight is under `negligible` of the whole: 0, not measured."""
    finite = [w if w > 0 and math.isfinite(w) else 0.0 for w in weights]
    mass = sum(finite)
    shares = [0.0] * len(weights)
    live = [i for i, w in enumerate(finite) if mass and w >= negligible * mass]
    left = total
    while live and left > 1e-12:
        weight = sum(finite[i] for i in live)
        offer = {i: left * finite[i] / weight for i in live}
        capped = [i for i in live if offer[i] >= caps[i]]
        if not capped:
            for i in live:
                shares[i] = offer[i]
            break
        for i in capped:  # fill the capped ones, share the rest among the others
            left -= caps[i]
            shares[i] = caps[i]
        live = [i for i in live if i not in capped]
    return [max(s, min(floor, c)) if mass and w >= negligible * mass else 0.0
            for s, w, c in zip(shares, finite, caps)]


def candidate_seconds(workers: int) -> float:
    """The wall seconds one more kept candidate costs a compile: its measurement and its part of
    the compile workers' time (`workers` compiling side by side; 1: in this process). The
    candidates' compiles, not their measurements, were most of a cold compile's tuning (nanoGPT
    on an H200: 4.1 s waiting for builds, 0.6 s measuring)."""
    return SECONDS_PER_CANDIDATE + COMPILE_S_PER_CANDIDATE / max(1, workers)


def plan_budget(p: PreparedTuning) -> float:
    """The most seconds one plan measures for at its level."""
    return _level(p.levels, p.kind, p.level)[1]


def _measure(p: PreparedTuning, progress=None) -> TuneOutcome:
    build_s = BUILD_S.get(p.level, 8.0)
    t0 = time.perf_counter()
    ranked, failures = p.bench.ready(p.ranked, build_s)
    add_phase(p.phases, "build", time.perf_counter() - t0)
    if not ranked:
        raise TuningError(f"all {len(failures)} candidates failed to compile or run; first: "
                          f"{describe(failures[0][0])}: {failures[0][1]}")
    t1 = time.perf_counter()
    out = search_candidates(ranked, p.bench.measure, TuningCache(), p.key, p.level, p.kind, p.name,
                            levels=p.levels, failures=failures, progress=progress, budget_s=p.budget_s)
    add_phase(p.phases, "measure", time.perf_counter() - t1)
    # (a candidate left out while it compiled has usually finished by now: it may be raced below)
    left_out = getattr(p.bench, "left_out", set())
    tried = {schedule for _, schedule in ranked} | {schedule for schedule, _ in failures if schedule not in left_out}
    left = [c for c in p.ranked if c[1] not in tried]
    expected = min(predicted for predicted, _ in ranked)
    # (a CPU's kernels only rank by the model's times, which are a GPU's: no ratio to trust there)
    on_gpu = not getattr(getattr(p.bench, "target", None), "on_cpu", False)
    if on_gpu and left and out.best_time is not None and expected > 0 and out.best_time > SUSPECT_RATIO * expected:
        # the build budget left only candidates that run far slower than the model expects (a
        # tile whose registers spill: T5's attention took 2.1 ms for a predicted 11 µs, where
        # the configurations chosen in other runs took a fraction): the rest are built and raced
        logs.log("tune", "%s: the best built candidate took %.0f us, %.0f times the model's %.1f us; building "
                 "the %d candidate(s) left", p.name, out.best_time * 1e6, out.best_time / expected,
                 expected * 1e6, len(left))
        t2 = time.perf_counter()
        more, more_failures = p.bench.ready(left, build_s)
        add_phase(p.phases, "build", time.perf_counter() - t2)
        if not more:
            logs.log("tune", "%s: none of the %d left ran: %s", p.name, len(left),
                     "; ".join(f"{describe(c)}: {e}" for c, e in more_failures[:3]))
            return out
        # the survivor races the new ones (its samples so far were its own search's); a candidate
        # left out before and built or failed now is no longer reported as left out
        retried = {c for _, c in more} | {c for c, _ in more_failures}
        failures = [f for f in failures if f[0] not in retried]
        survivor = [c for c in ranked if c[1] == out.schedule]
        t3 = time.perf_counter()
        out = search_candidates(survivor + more, p.bench.measure, TuningCache(), p.key, p.level, p.kind, p.name,
                                levels=p.levels, failures=failures + more_failures, progress=progress,
                                budget_s=p.budget_s)
        add_phase(p.phases, "measure", time.perf_counter() - t3)
    return out


@contextlib.contextmanager
def real_tensors():
    """Compilation runs inside AOTAutograd's fake-tensor mode, with the Python dispatcher on;
    measuring needs real tensors (as Inductor's autotuning does, this leaves that mode for the
    duration) and ATen's own kernels: under the Python dispatcher `matmul(a, b, out=c)`
    computes a new tensor and copies it into `c`, which made a library product measured while
    tuning the LM head a third slower than it runs."""
    import torch

    with contextlib.ExitStack() as stack:
        try:
            from torch._subclasses.fake_tensor import unset_fake_temporarily
        except ImportError:  # a PyTorch without it: nothing to leave
            pass
        else:
            stack.enter_context(unset_fake_temporarily())
        no_python_dispatcher = getattr(torch._C, "_DisablePythonDispatcher", None)
        if no_python_dispatcher is not None:
            stack.enter_context(no_python_dispatcher())
        yield


def select_schedule(space, key: str, level: str, ceilings: Ceilings, measure, cache, name: str,
                    levels: dict | None = None, misfit=None) -> TuneOutcome:
    """A cache hit, else the search over the model's best candidates (stored for next time).
    `misfit(schedule)`: why a schedule does not fit the target (None: it does); a cached one
    that does not is discarded, and candidates that do not are never measured."""
    t0 = time.perf_counter()
    found = candidates(space, key, level, ceilings, cache, name, levels, misfit)
    if isinstance(found, TuneOutcome):
        return found
    outcome = search_candidates(found, measure, cache, key, level, space.kind, name, levels)
    outcome.seconds = time.perf_counter() - t0
    return outcome


def candidates(space, key: str, level: str, ceilings: Ceilings, cache, name: str, levels: dict | None = None,
               misfit=None, fit: bool = True) -> "list | TuneOutcome":
    """The tuning cache's record for `key` (a `TuneOutcome`), else the model's best candidates
    that fit, as [(predicted seconds, schedule)] (`fit=False`: the model's best, checked
    against the target later)."""
    t0 = time.perf_counter()
    schedules = space.schedules()

    def accept(schedule: Schedule) -> str | None:
        if schedule not in schedules:
            return "not a configuration of the kernel's schedule space"
        return misfit(schedule) if misfit is not None else None

    hit = cache.lookup(key, accept=accept)
    if hit is not None:
        return TuneOutcome(hit["schedule"], "cache", time.perf_counter() - t0, best_time=hit.get("time_s"))
    keep, _ = _level(levels, space.kind, level)
    ranked = rank(space, ceilings, keep=keep)
    if misfit is not None and fit:
        ranked = _fitting(ranked, rank(space, ceilings), keep, misfit, name)
    return ranked


def _level(levels: dict | None, kind: str, level: str) -> tuple:
    return (levels or (MEMORY_LEVELS if kind == "memory" else LEVELS))[level]


def search_candidates(ranked: list, measure, cache, key: str, level: str, kind: str, name: str,
                      levels: dict | None = None, failures: list | None = None, progress=None,
                      budget_s: float | None = None) -> TuneOutcome:
    """Measure the ranked candidates within the level's budget (or `budget_s`) and store the
    winner under `key`. `progress(runs, total, best seconds)` is told after each measurement."""
    t0 = time.perf_counter()
    _, budget = _level(levels, kind, level)
    budget = budget if budget_s is None else budget_s
    # (a share of a graph's budget, or a race of two: every candidate kept is measured, however
    # small the share or slow the first — a 10 ms library call would spend a race's budget alone)
    result = _search(ranked, measure, budget, name, SAMPLES_PER_CANDIDATE.get(level, 8) * len(ranked), progress,
                     warm_all=budget_s is not None or levels is CPU_RACE_LEVELS)
    failures = list(failures or []) + list(result.failures)
    cache.store(key, result.best, result.best_time, {"kind": kind, "candidates": len(ranked) + len(failures)})
    logs.log("tune", "%s: %s in %d measurements (%s)", name, describe(result.best), result.measured,
             ", ".join(f"{describe(c)}: {e}" for c, e in failures[:3]))
    failed = (f"{len(failures)} candidate(s) failed, first: {describe(failures[0][0])}: "
              f"{failures[0][1]}"[:200] if failures else "")
    return TuneOutcome(result.best, "measured", time.perf_counter() - t0, measured=result.measured,
                       best_time=result.best_time, note=failed)


def _fitting(ranked: list, everything: list, keep: int, misfit, name: str) -> list:
    """The ranked candidates that fit the target, topped up to `keep` from the rest of the
    space in the model's order; a space with none that fits is a `TuningError`."""
    out, dropped = [], []
    ranked_schedules = {schedule for _, schedule in ranked}
    rest = [x for x in everything if x[1] not in ranked_schedules]
    for k, (predicted, schedule) in enumerate(ranked + rest):
        if k >= len(ranked) and len(out) >= keep:
            break
        why = misfit(schedule)
        if why:
            dropped.append((schedule, why))
        else:
            out.append((predicted, schedule))
    for schedule, why in dropped:
        logs.log("tune", "%s: candidate %s dropped: %s", name, describe(schedule), why)
    if not out:
        raise TuningError(f"no candidate fits the target: {describe(dropped[0][0])}: {dropped[0][1]}"
                          if dropped else "no candidate")
    return sorted(out, key=lambda x: x[0])


def _search(ranked, measure, budget, name, max_measurements=None, progress=None, warm_all=False):
    arms = [Candidate(schedule, predicted) for predicted, schedule in ranked]
    return search(arms, measure, budget_s=budget, max_measurements=max_measurements, progress=progress,
                  warm_all=warm_all)


def synthetic_buffer(graph, name: str, spec, device):
    """An uninitialised tensor of `spec`'s shape, strides and dtype on `device` (a "meta" device
    gives the layout without memory)."""
    import torch

    from ..ir import symbolic
    from ..ir.interpret import torch_dtype

    shape = tuple(int(symbolic.evaluate(d, {})) for d in spec.shape)
    strides = getattr(spec, "strides", None) or graph.output_strides.get(name)
    dtype = torch_dtype(spec.dtype)
    if strides is not None:
        return torch.empty_strided(shape, tuple(int(symbolic.evaluate(s, {})) for s in strides), dtype=dtype,
                                   device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def precompile_kernel(graph, tk, launcher) -> bool:
    """Start compiling a loaded kernel ahead of its first launch, for the static shapes of its
    buffers (a kernel whose sizes are only known at run time compiles when it launches)."""
    start = getattr(launcher, "precompile", None)
    if start is None:
        return False
    try:
        buffers = {name: synthetic_buffer(graph, name, tk.scratch.get(name) or graph[name], "meta")
                   for name in list(tk.reads) + list(tk.writes)}
    except (KeyError, TypeError, ValueError):  # a symbolic size
        return False
    try:
        return start(buffers, {})
    except Exception as err:  # noqa: BLE001 — an optimisation: the kernel compiles when it launches
        logs.log("cache", "%s: not compiled ahead: %s: %s", tk.name, type(err).__name__, err)
        return False


class _Bench:
    """Builds the plan's kernels for a schedule (once) and times one launch of all of
    them on synthetic buffers of the plan's shapes (random floats; zeros for integer and
    boolean inputs, so that any index they hold is in range)."""

    #: the space's configurations (None: any), for `shallower_pipeline`
    schedules = None

    def __init__(self, graph, plan, options, device, aten=None):
        self.graph, self.plan, self.options, self.device, self.aten = graph, plan, options, device, aten
        self.target = options.target
        self.built: dict = {}
        self.loaded: dict = {}
        self.buffers: dict = {}
        self.timer = self.target.timer(device)  # (GPU: holds its L2 flush buffer while this plan is measured)
        self.lowerings: dict = {}
        self.check = self.target.check if self.target.limits is not None else None
        self.compile_s: dict = {}  # schedule -> seconds its kernels took in the workers (those built)
        self.left_out: set = set()  # schedules `ready` left out while they still compiled

    def lowered(self, schedule: Schedule) -> list:
        """The plan's tile kernels under `schedule` (lowered once); under `impl=split` the
        epilogue's kernels (the library's product runs before them: `aten`)."""
        if schedule not in self.lowerings:
            if schedule.get("impl") == "split":
                self.lowerings[schedule] = lower_plan_kernels(self.graph, self.plan.library.split.epilogue,
                                                              self.options)
            else:
                self.lowerings[schedule] = lower_plan_kernels(self.graph, self.plan,
                                                              replace(self.options, schedule=schedule))
        return self.lowerings[schedule]

    def misfit(self, schedule: Schedule) -> str | None:
        """Why `schedule` does not fit the target (None: it does, or a library call is measured)."""
        if self.check is None or schedule.get("impl") == "aten":
            return None
        for tk in self.lowered(schedule):
            found = self.check(tk)
            if found is not None:
                return str(found)
        return None

    def precompile(self, schedules) -> None:
        """Load the kernels of `schedules` and start compiling them (a C++ kernel starts building
        when loaded; a Triton kernel compiles in a worker process where there are any)."""
        for schedule in schedules:
            if schedule.get("impl") == "aten":
                continue
            try:
                for tk, launcher in zip(self.lowered(schedule), self._launchers(schedule)):
                    precompile_kernel(self.graph, tk, launcher)
            except Exception as err:  # noqa: BLE001 — `ready` meets the error again and drops the candidate
                logs.log("tune", "%s: candidate %s did not load: %s", self.plan.name, describe(schedule), err)

    def ready(self, ranked: list, budget_s: float = math.inf, stragglers: bool = True) -> tuple[list, list]:
        """Each candidate built and run once, in rank order, outside the measuring budget, until
        `budget_s` is spent (compiles in workers overlap, so this is the wait for the slowest; in
        this process they add up, and the best-ranked that were built are measured): (the ranked
        candidates that ran, [(schedule, error)] for those that did not). `stragglers`: leave out
        a candidate whose compile straggles (`_straggling`); when nothing else ran, those are
        built after all."""
        ok, failed = [], []
        t0 = time.perf_counter()
        ranked = list(ranked)  # (a candidate refused for shared memory is followed by a shallower one)
        k = -1
        while k + 1 < len(ranked):
            k += 1
            predicted, schedule = ranked[k]
            if ok and time.perf_counter() - t0 > budget_s:
                logs.log("tune", "%s: %d candidate(s) not built within %.0f s", self.plan.name, len(ranked) - k,
                         budget_s)
                break
            out = {s for s, _ in failed}
            late = self._straggling(schedule, [s for _, s in ranked if s != schedule and s not in out]) \
                if stragglers else None
            if late is not None:
                failed.append((schedule, late))
                self.left_out.add(schedule)
                logs.log("tune", "%s: candidate %s left out: %s", self.plan.name, describe(schedule), late)
                continue
            took = self._compiled_in(schedule)  # (read before the first launch, which ends the worker's part)
            try:
                self._kernels(schedule)
            except Exception as err:  # noqa: BLE001 — a candidate that fails is dropped, not fatal
                failed.append((schedule, f"{type(err).__name__}: {err}"[:500]))
                logs.log("tune", "%s: candidate %s failed: %s", self.plan.name, describe(schedule), failed[-1][1])
                shallower = shallower_pipeline(schedule, err, self.schedules)
                if shallower is not None and all(shallower != s for _, s in ranked):
                    ranked.insert(k + 1, (predicted, shallower))
                    logs.log("tune", "%s: trying %s instead", self.plan.name, describe(shallower))
            else:
                ok.append((predicted, schedule))
                if took is not None:
                    self.compile_s[schedule] = took
        if not ok and stragglers and any(s in self.left_out for s, _ in failed):
            # (the others failed to run after all: the stragglers are waited for, as without the rule)
            again = [c for c in ranked if c[1] in self.left_out]
            ok, more = self.ready(again, budget_s, stragglers=False)
            done = {s for _, s in ok} | {s for s, _ in more}
            failed = [f for f in failed if f[0] not in done] + more
        return ok, failed

    def _compile_states(self, schedule: Schedule) -> list | None:
        """`compiling()` of the schedule's loaded kernels that compile in a worker; None where
        one of them cannot be relied on (the pool closed, or no worker ready yet)."""
        states = [launch.compiling() for launch in self.loaded.get(schedule, ())
                  if getattr(launch, "compiling", None) is not None]
        return None if any(state is None for state in states) else states

    def _compiled_in(self, schedule: Schedule) -> float | None:
        """Seconds the workers took to compile the schedule's kernels: remembered once it was
        built, else known once every compile succeeded (None before, or where no worker compiled
        them)."""
        if schedule in self.compile_s:
            return self.compile_s[schedule]
        states = self._compile_states(schedule)
        if not states or not all(done and took is not None for done, _, took in states):
            return None
        return max(took for _, _, took in states)

    def _straggling(self, schedule: Schedule, others: list, poll_s: float = 0.02) -> str | None:
        """Wait while the schedule's kernels compile in workers: None once they are done (or
        none compiles there, or the pool cannot be relied on: the launch's `compile_pool.wait`
        decides then), or why the candidate is left out — one of its compiles has run
        `STRAGGLER_FACTOR` times as long as the longest finished compile of another candidate
        of the plan (`others`, those not failed; and at least `STRAGGLER_MIN_S`), once at least
        as many of the others have finished compiling as are still compiling. A compile still
        queued for a worker is waited for."""
        while True:
            states = self._compile_states(schedule)
            if states is None or all(done for done, _, _ in states):
                return None
            running = max((r for done, r, _ in states if not done and r is not None), default=0.0)
            finished = [t for t in map(self._compiled_in, others) if t is not None]
            # (an outlier among its siblings: while fewer of the others compiling in workers have
            # finished than are still compiling, a slow compile is the norm on this host — the
            # first graph's workers still warming, a busy machine — not a spilling kernel)
            if finished and len(finished) >= self._still_compiling(others):
                allowed = max(STRAGGLER_MIN_S, STRAGGLER_FACTOR * max(finished))
                if running > allowed:
                    return (f"still compiling after {running:.1f} s, over the {allowed:.1f} s allowed (the "
                            f"longest compile of another candidate: {max(finished):.1f} s)")
            time.sleep(poll_s)

    def _still_compiling(self, schedules: list) -> int:
        """How many of `schedules` have a kernel still compiling (or queued) in a worker; those
        with nothing there (a library call, a kernel found on disk) count neither way."""
        count = 0
        for schedule in schedules:
            states = self._compile_states(schedule)
            count += bool(states) and not all(done for done, _, _ in states)
        return count

    def _buffer(self, name, spec):
        if name in self.buffers:
            return self.buffers[name]
        t = synthetic_buffer(self.graph, name, spec, self.device)
        if t.dtype.is_floating_point:
            import torch

            # a private generator: tuning leaves the user's random stream (torch.manual_seed,
            # the program's dropout seeds) where it was, cold cache or warm
            t.normal_(generator=torch.Generator(device=t.device).manual_seed(len(self.buffers)))
        else:
            t.zero_()
        self.buffers[name] = t
        return t

    def _launchers(self, schedule: Schedule) -> list:
        if schedule not in self.loaded:
            self.loaded[schedule] = [self._load(tk) for tk in self.lowered(schedule)]
        return self.loaded[schedule]

    def _kernels(self, schedule: Schedule):
        if schedule not in self.built and schedule.get("impl") in ("aten", "split"):
            step = self.aten()  # the whole plan (aten), or its product (split)
            for name in step.reads + step.writes:
                self._buffer(name, self.graph[name])
            for _ in range(3):  # the library's first calls choose its algorithm and workspace
                step.launch(self.buffers, {})
            if schedule["impl"] == "aten":
                self.built[schedule] = [step.launch]
            else:
                self.built[schedule] = [step.launch] + self._built_launchers(schedule)
        if schedule not in self.built:
            self.built[schedule] = self._built_launchers(schedule)
        return self.built[schedule]

    def _built_launchers(self, schedule: Schedule) -> list:
        launchers = self._launchers(schedule)
        kernels = self.lowered(schedule)
        scratch = {name: spec for tk in kernels for name, spec in tk.scratch.items()}  # as the runtime does
        for tk in kernels:
            for name in list(tk.reads) + list(tk.writes):
                self._buffer(name, scratch.get(name) or self.graph[name])
        self._run(launchers)  # compiles (or waits for the worker's compile): not timed
        return launchers

    def _run(self, launchers):
        for launch in launchers:
            launch(self.buffers, {})

    def _load(self, tk):
        printed = getattr(self.check, "source", None)  # the limits check printed it already (C++)
        launcher = self.target.load(tk, (printed and printed(tk)) or self.target.generate(tk))
        as_is = getattr(launcher, "measured_as_is", None)  # a candidate that cannot launch is dropped
        return as_is() if as_is is not None else launcher

    def measure(self, schedule: Schedule) -> float:
        """One sample: the target's timing of one launch of the schedule's kernels (`Target.timer`:
        on a GPU the median of 5 launches after an L2 flush each, on a CPU host time)."""
        launchers = self._kernels(schedule)
        return self.timer(lambda: self._run(launchers))


def canonical_source(source: str, kernels) -> str:
    """`source` with the names that differ between kernels identical in all else — their own
    names and their buffers' — replaced by positional ones, so that one tuning result serves
    every copy of a kernel (the q, k and v projections of a layer; every layer of a model)."""
    import re

    mapping: dict[str, str] = {}
    for tk in kernels:
        for name in [tk.name] + [p.name for p in tk.params if p.kind == "buffer"] + list(tk.scratch):
            mapping.setdefault(name, f"n{len(mapping)}")
    if not mapping:
        return source
    names = "|".join(re.escape(n) for n in sorted(mapping, key=len, reverse=True))
    # a buffer appears as itself, as `ptr_<name>` and in its run-time stride parameters
    pattern = re.compile(rf"\b(ptr_)?({names})(?=\b|_)")
    return pattern.sub(lambda m: (m.group(1) or "") + mapping[m.group(2)], source)


__all__ = ["tune_plan", "prepare_tuning", "PreparedTuning", "candidate_seconds", "select_schedule", "candidates", "search_candidates",
           "TuneOutcome", "device_ceilings", "precompile_kernel", "synthetic_buffer", "LEVELS"]
