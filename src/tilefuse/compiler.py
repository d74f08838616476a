"""The driver: runs the stages in order and records what each did.

FX graph → graph IR (frontend) → passes → verify → kernel plans (fusion) → tile IR (tile) →
Triton source (backends) → compiled graph (runtime). `compile_fx` returns the compiled graph
and a `CompileReport` that `tilefuse.explain` prints.
"""
from __future__ import annotations

import contextlib
import re
import time
import warnings
from dataclasses import dataclass, field, replace

import sympy
import torch

from . import dedupe, graph_cache, logs
from .summary_sharing import share_summaries
from .backends.targets import parallel_units, target_for
from .config import KNOBS, ConfigError, ConfigWarning, Options, config
from .frontend.to_ir import lower_fx
from .fusion import ExternStep, plan_graph
from .fusion.layout import assign_layouts
from .fusion.row_padding import pad_library_rows
from .fusion.library import GENERATED, LIBRARY, MEASURED, LibraryCall, ProductChoice, choose_library_calls
from .fusion.matmul_views import describe as describe_matmul
from .fusion.naming import kernel_origin
from .fusion.plan import KernelPlan, PlanKind
from .ir.verify import verify
from .passes import run_passes
from .passes.split_reduction import split_reductions
from .runtime.artifact import artifact_function
from .runtime.aten_matmul import AtenMatmul
from .runtime.compiled import CompiledGraph, ExternCall, KernelStep
from .runtime.dispatch import SizeDispatch
from .tile.lower import LoweringOptions, lower_plan_kernels
from .tile.fit import fit_kernels
from .tile.ir import KernelKind, without_checks
from .tile.variants import all_kernels
from .tile.verify import verify_tile_kernel
from .progress import CompileProgress
from .tune.tuner import CPU_LEVELS, CPU_RACE_LEVELS, NEGLIGIBLE, PreparedTuning, TuneOutcome, allot_budgets, candidate_seconds, \
    plan_budget, precompile_kernel, prepare_tuning, tune_plan


@dataclass
class KernelReport:
    name: str
    kind: str
    nodes: list
    source: str
    tile: object  # its TileKernel, printed when asked for (`tile_ir`: printing costs ms a kernel), or text
    notes: list
    tune_seconds: float = 0.0
    ops: list = field(default_factory=list)  # the ATen ops it computes, in program order
    source_lines: list = field(default_factory=list)  # the user's lines they come from
    compile_seconds: float = 0.0  # its plan's time from tuning to the build's start (on its first kernel)
    shares: str = ""  # the identical kernel whose tuning and build it uses ("": its own)
    shared_by: int = 0  # how many kernels use this one's build besides itself

    @property
    def tile_ir(self) -> str:
        """The kernel's tile IR as text ("" for a library call)."""
        if self.tile is None or isinstance(self.tile, str):
            return self.tile or ""
        self.tile = str(self.tile)
        return self.tile


@dataclass
class CompileReport:
    graph_name: str
    graph_ir: str = ""
    backend: str = ""
    kernels: list = field(default_factory=list)
    externs: list = field(default_factory=list)  # (node, target, reason)
    decisions: list = field(default_factory=list)
    stage_seconds: dict = field(default_factory=dict)
    plans: str = ""  # the kernel plans as text (GraphPlan.describe)
    failure: str = ""  # why compilation failed (the graph then ran as the fallback knob says)
    runs_as_written: str = ""  # the program's own error found while compiling (`ProgramError`)
    settings: dict = field(default_factory=dict)  # the options it was compiled with
    tuning: dict = field(default_factory=dict)  # how plans got their schedule: source -> count
    tune_phases: dict = field(default_factory=dict)  # the tune stage's seconds by phase (`TuneOutcome.phases`)
    cached: str = ""  # the graph cache's key (its first digits) when the graph was loaded from it
    #: the graph cache's key under which this graph is stored ("": none; `front_cache` names it)
    graph_key: str = ""
    cuda_graphs: str = ""  # how the graph runs under the cuda_graphs knob ("": the knob is off)
    #: captured tensors computed from their index formulas (`frontend.index_constants`), described
    index_formulas: list = field(default_factory=list)


class _Stages:
    """`with stage("tile"):` adds the block's wall time to the report's per-stage totals."""

    def __init__(self, report: CompileReport):
        self.report = report

    @contextlib.contextmanager
    def __call__(self, name):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            times = self.report.stage_seconds
            times[name] = times.get(name, 0.0) + time.perf_counter() - t0


def choose_backend(device: torch.device, options: Options) -> str:
    """`options.target`, or for "auto": Triton for CUDA tensors, C++ kernels otherwise."""
    if options.target != "auto":
        return options.target
    return "triton" if device.type == "cuda" else "cpu"


def compile_fx(gm: torch.fx.GraphModule, device: torch.device, name: str = "graph", options: Options | None = None,
               inference: bool = False):
    """Compile an FX graph under `options` (the API's value; None: the configuration's).
    `inference`: nothing but the caller sees the graph's outputs (no backward reads them), so
    they may take a faster layout than the traced one (`fusion.row_padding`)."""
    options = options if options is not None else config.options()
    report = CompileReport(name)
    stage = _Stages(report)
    backend = choose_backend(device, options)
    if backend == "triton" and device.type != "cuda":
        raise ConfigError("target='triton' needs CUDA tensors; use 'cpu' or 'interpret' for CPU tensors")
    if backend == "cpu" and device.type != "cpu":
        raise ConfigError(f"target={backend!r} needs CPU tensors, not {device.type}; use 'triton'")
    kind = re.sub(r"\d+$", "", name) + ("-inference" if inference else "")
    key = graph_cache.graph_key(gm, device, kind, parallel_units(device), options) if options.graph_cache else None
    if key is not None:
        loaded = graph_cache.load(key, device, name)
        if loaded is not None:
            loaded[0].generates_calls = options.generated_wrapper  # (not in the key: a run-time choice)
            loaded[0].kernel_runs = options.kernel_runs
            loaded[1].graph_key = key
            return loaded
    with stage("lower"):
        graph = lower_fx(gm, name)
    compiled, report = compile_ir(graph, device, report, options, inference=inference)
    if key is not None:
        with stage("store"):
            if graph_cache.store(key, compiled, report):
                report.graph_key = key
    return compiled, report


def compile_ir(graph, device: torch.device, report: CompileReport | None = None, options: Options | None = None,
               inference: bool = False):
    """Compile a graph-IR graph (the part of the pipeline after the frontend) under `options`
    (None: the configuration's). `inference`: as for `compile_fx`."""
    options = options if options is not None else config.options()
    report = report or CompileReport(graph.name)
    stage = _Stages(report)
    target = target_for(choose_backend(device, options), device)
    report.backend = target.name
    if target.require is not None:
        # no C++ compiler: a clear error, and the graph runs eagerly; asked for the interpreter
        # and none is usable: the user's error
        target.require()
    with stage("passes"):
        graph = run_passes(graph)
        units = parallel_units(device) if target.on_cpu else target.sm_count
        if options.split_reductions and not target.interpret and units > 1:
            graph = split_reductions(graph, units, columns=not target.on_cpu)
        verify(graph)
    report.graph_ir = str(graph)
    with stage("fusion"):
        schedule = plan_graph(graph, options.persistent_reduction_limit, threads=units if target.on_cpu else 0)
        assign_layouts(graph, schedule)
        if not target.on_cpu and options.matmul != "generated":
            pad_library_rows(graph, schedule, free_outputs=inference)
    report.decisions = list(schedule.decisions)
    report.plans = schedule.describe()
    with stage("fusion"):
        choose_library_calls(graph, schedule, options.matmul, cpu=target.on_cpu,
                             race=target.on_cpu and options.autotune in (*CPU_RACE_LEVELS, *CPU_LEVELS))
    lowering = LoweringOptions(target=target, persistent_reduction_limit=options.persistent_reduction_limit,
                               column_tiles=options.column_tiles,
                               flash_config=options.flash_config, flash_split=options.flash_split,
                               block_summary=options.block_summary,
                               flash_launch_groups=options.flash_launch_groups,
                               matmul=options.matmul,
                               # eager CUDA does not raise on an integer division by zero: only CPU tensors check
                               divisor_checks=device.type == "cpu" and options.index_checks,
                               index_checks=options.index_checks)
    fits = _checking_variants(target.check)
    progress = CompileProgress(graph.name, sum(not isinstance(s, ExternStep) for s in schedule.steps))
    try:
        return _compile_steps(graph, schedule, lowering, options, device, report, stage, fits, progress)
    finally:
        progress.close()


def _compile_steps(graph, schedule, lowering, options: Options, device, report, stage, fits, progress):
    """The plans' kernels (lowered under `lowering`, the tile layer's options), tuned, built
    and loaded, as the compiled graph's steps."""
    target = lowering.target
    bases: dict = {}  # plan name -> (its base lowering, the notes it added, its dedupe key)
    prepared = _prepare_tuning(graph, schedule.steps, lowering, options, device, stage, progress, bases)
    misfits: dict = {}  # knob -> kernels whose configuration from that knob was replaced
    published: list = []  # (key, dedupe.Shared) this compile built
    steps = []
    pending = list(schedule.steps)
    while pending:
        step = pending.pop(0)
        if not isinstance(step, ExternStep):
            progress.done += 1
            progress.now(f"planning {step.name}")
        if isinstance(step, ExternStep):
            node = graph[step.node]
            report.externs.append((node.name, node.target_name, node.reason))
            steps.append(ExternCall(node.name, sorted(node.inputs()), step.label))
            continue
        if isinstance(step, LibraryCall):  # a product in ATen's matmul, its epilogue the next plan
            steps.append(_aten_step(step, step.views))
            report.kernels.append(KernelReport(step.name, "aten-matmul", [step.views.out], describe_matmul(step.views),
                                               "", step.notes))
            continue
        if _statically_empty(graph, step):
            # no element to compute (a dim of 0): the outputs are only allocated
            steps.append(KernelStep(step.name, _nothing, list(step.stores), []))
            report.kernels.append(KernelReport(step.name, "empty", step.members, "", "", step.notes))
            continue
        choice = step.library
        views = choice.views
        library_views = _library_views(choice)
        if choice.how == LIBRARY and choice.split is not None:  # matmul="aten": the product in the library
            _split(step, choice.split, steps, report, pending, None)
            continue
        t0 = time.perf_counter()
        key = base = None
        if choice.how != LIBRARY:
            base, added, key = bases.pop(step.name, None) or _keyed_lowering(graph, step, lowering, options, stage)
            shared = dedupe.lookup(key)
            if shared is not None and shared.split:
                if choice.split is not None:  # the same plan split before: its product, then its epilogue's plan
                    _split(step, choice.split, steps, report, pending, shared)
                    continue
            elif shared is not None and _reuse(shared, step, base, views, steps, report):
                continue
        with stage("tune"):
            tuned = tune_plan(graph, step, lowering, level=options.autotune, device=device,
                              aten=(lambda: _aten_step(step, library_views)) if library_views is not None else None,
                              prepared=prepared.pop(step.name, None), progress=progress.tuning(step.name))
        report.tuning[tuned.source] = report.tuning.get(tuned.source, 0) + 1
        for phase, seconds in tuned.phases.items():
            report.tune_phases[phase] = report.tune_phases.get(phase, 0.0) + seconds
        if tuned.schedule is not None:
            progress.tuned += 1
        if tuned.describe():
            step.notes.append(f"{step.name}: {tuned.describe()}")
        impl = (tuned.schedule or {}).get("impl")
        if impl is None and choice.how == MEASURED and target.on_cpu:
            # a CPU product chosen for a race that was not run (an option that fixes schedules, a
            # failure): the library, as the rule decides without measuring
            impl = "split" if choice.split is not None else "aten"
        if choice.how == MEASURED and impl == "split":
            shared = dedupe.Shared(step.name, dedupe.names_of(base), [], tuned, [], split=True) if key else None
            _split(step, choice.split, steps, report, pending, dedupe.publish(key, shared) if key else None,
                   tuned.seconds, time.perf_counter() - t0)
            continue
        if choice.how == LIBRARY or (choice.how == MEASURED and impl == "aten"):
            aten = _aten_step(step, views)
            step.notes.append(f"{step.name}: nothing fused — {describe_matmul(views)} (ATen)")
            kr = KernelReport(step.name, "aten-matmul", step.members, describe_matmul(views), "", step.notes,
                              tuned.seconds, compile_seconds=time.perf_counter() - t0)
            if key is not None:
                aten.keep = dedupe.publish(key, dedupe.Shared(step.name, dedupe.names_of(base), [], tuned, [kr],
                                                              aten=True))
            steps.append(aten)
            report.kernels.append(kr)
            continue
        plan_options = replace(lowering, schedule=tuned.schedule) if tuned.schedule is not None else lowering
        # lowered (tile), then checked against the target's limits (C++: printed), until it fits;
        # the first lowering under the graph's options is the one the key was made of
        lower = _timed(stage, "tile", _lower)
        first = [(base, added)] if base is not None and tuned.schedule is None else []

        def lower_once(graph, plan, opts, first=first, lower=lower, plan_options=plan_options):
            if first and opts is plan_options:
                kernels, notes = first.pop()
                plan.notes.extend(notes)
                return kernels
            return lower(graph, plan, opts)

        fitted = fit_kernels(graph, step, plan_options, _timed(stage, "codegen", fits), lower_once)
        tks = fitted.kernels
        if fitted.replaced is not None:
            _replaced(step, fitted, lowering, tuned, misfits)
        built, reports = [], []
        # the plan's own kernel carries its tuning and compile time (not a block summary before it)
        main = next((tk for tk in tks if tk.kind != KernelKind.BLOCK_SUMMARY), tks[0] if tks else None)
        for tk in tks:
            logs.log("tile", "%s", tk)
            source, launcher = _generate_and_load(tk, target, step, stage, getattr(fits, "source", None))
            precompile_kernel(graph, tk, launcher)  # Triton: compiling in a worker while the next plans lower
            kind = tk.kind if tk.kind in (KernelKind.FLASH_MERGE, KernelKind.BLOCK_SUMMARY) else step.kind
            reports.append(KernelReport(tk.name, kind, step.members, source, tk, step.notes,
                                        tuned.seconds if tk is main else 0.0))
            built.append((tk, source, launcher))
            progress.built += 1
            steps.append(KernelStep(tk.name, launcher, list(tk.writes), list(tk.reads), dict(tk.scratch)))
        if reports:
            reports[tks.index(main)].compile_seconds = time.perf_counter() - t0
        report.kernels.extend(reports)
        if key is not None:
            shared = dedupe.publish(key, dedupe.Shared(step.name, dedupe.names_of(base), built, tuned, reports))
            published.append((key, shared))
            for s in steps[len(steps) - len(built):]:
                s.keep = shared
    for knob, kernels in misfits.items():
        more = f" (and {len(kernels) - 1} more kernel(s))" if len(kernels) > 1 else ""
        warnings.warn(ConfigWarning(f"{knob}={getattr(options, knob)!r} does not fit {kernels[0]}{more}"), stacklevel=3)
    _record_origins(report, graph, schedule)
    progress.now("waiting for kernel builds")
    with stage("load"):  # C++ kernels are built in parallel: a failed build fails the compile
        try:
            for s in steps:
                wait = getattr(getattr(s, "launch", None), "wait", None)
                if wait is not None:
                    wait()
        except BaseException:  # a failed build is not shared: the next compile builds again
            dedupe.forget(published)
            raise
    summaries = {k.name for k in report.kernels if k.kind == KernelKind.BLOCK_SUMMARY}
    if summaries:
        steps = share_summaries(graph, steps, summaries, report)
    # writes into inputs run last: every step that reads an input's old value runs before them
    # (a write whose result later steps read — a re-inplaced scatter, whose input's old value
    # nothing reads — stays where it is)
    read = {name for s in steps for name in s.reads}
    writes = [s for s in steps if isinstance(s, ExternCall) and getattr(graph[s.name], "mutates", False)
              and s.name not in read]
    steps = [s for s in steps if not any(s is w for w in writes)] + writes
    compiled = CompiledGraph(graph, steps, device)
    compiled.generates_calls = options.generated_wrapper
    compiled.kernel_runs = options.kernel_runs
    return compiled, report


def _base_lowering(graph, step, options, stage):
    """The plan's kernels under the graph's options (what its dedupe key is made of), and the
    notes that lowering added to the plan (taken off it again: tuning and fitting lower anew)."""
    notes = list(step.notes)
    with stage("tile"):
        kernels = _lower(graph, step, options)
    added = step.notes[len(notes):]
    step.notes[:] = notes
    return kernels, added


def _keyed_lowering(graph, step, lowering, options: Options, stage) -> tuple:
    """(`_base_lowering`'s kernels and notes, the plan's dedupe key)."""
    base, added = _base_lowering(graph, step, lowering, stage)
    return base, added, dedupe.plan_key(graph, base, lowering.target.name, lowering, options)


def _reuse(shared, step, base, views, steps: list, report: CompileReport) -> bool:
    """Steps for `step` from an identical plan compiled before (`shared`): its tuning, sources
    and launchers over this plan's buffers. False: this plan cannot be mapped onto it."""
    t0 = time.perf_counter()
    if shared.aten:
        if views is None:
            return False
        step.notes.append(f"{step.name}: nothing fused — {describe_matmul(views)} (ATen, as {shared.plan})")
        steps.append(replace(_aten_step(step, views), keep=shared))
        report.kernels.append(KernelReport(step.name, "aten-matmul", step.members, describe_matmul(views), "",
                                           step.notes, shares=shared.plan))
        shared.reports[0].shared_by += 1
        return True
    mapping = dedupe.renaming(shared, dedupe.names_of(base)) if shared.kernels else None
    if mapping is None:
        return False
    step.notes.append(f"{step.name}: the same kernel as {shared.plan}: tuned and built once")
    for (tk, source, launch), rep in zip(shared.kernels, shared.reports):
        name = dedupe.kernel_name(shared, step.name, tk.name, mapping)
        pairs = [(p.name, mapping[p.name]) for p in tk.params if p.kind == "buffer"]
        scratch = {mapping[n]: replace(spec, name=mapping[n]) for n, spec in tk.scratch.items()}
        steps.append(KernelStep(name, dedupe.Renamed(launch, pairs, shared), [mapping[n] for n in tk.writes],
                                [mapping[n] for n in tk.reads], scratch, keep=shared))
        # (its tile IR: the shared kernel's, already stored — a copy of its own would be a whole
        # IR tree more in the graph cache per layer)
        report.kernels.append(KernelReport(name, rep.kind, step.members, source, tk, step.notes,
                                           shares=rep.name))
        rep.shared_by += 1
    report.kernels[-len(shared.kernels)].compile_seconds = time.perf_counter() - t0
    return True


def _timed(stage, name: str, fn):
    def run(*args):
        with stage(name):
            return fn(*args)
    return run


def _lower(graph, plan, options) -> list:
    tks = lower_plan_kernels(graph, plan, options)
    for k in (k for tk in tks for k in all_kernels(tk)):  # size variants included
        verify_tile_kernel(k)
        if not options.index_checks:  # TILEFUSE_INDEX_CHECKS=0: out-of-range indices read 0, unreported
            k.body = without_checks(k.body)
    return tks


def _checking_variants(check):
    """`check` applied to a kernel (its own function, not the source it shares with its size
    variants); a size variant over the limits is dropped with the larger ones (the kernel
    itself serves those sizes), never a reason to shrink the kernel."""
    def run(tk):
        if tk.variants is None:
            return check(tk)
        found = check(replace(tk, variants=None))
        if found is not None:
            return found
        v = tk.variants
        fitting = next((k for k, kernel in enumerate(v.kernels) if check(kernel) is not None), len(v.kernels))
        if fitting < len(v.kernels):
            logs.log("tile", "%s: size variants from %d elements on exceed the target's limits: dropped",
                     tk.name, v.bounds[fitting])
            tk.variants = replace(v, bounds=v.bounds[:fitting], kernels=v.kernels[:fitting]) if fitting else None
        return None
    run.source = getattr(check, "source", None)
    return run


def _prepare_tuning(graph, steps, lowering, options: Options, device, stage, progress, bases: dict) -> dict:
    """{plan name: its prepared tuning} for the plans a GPU graph measures. At the default level
    the graph's measuring budget is shared first (`tuner.allot_budgets`): a plan with a
    negligible share is the model's choice. Where there are compile workers, every measured
    plan's candidates start compiling (in `compile_pool`'s workers) before the first is
    measured, so the graph's compiles run side by side — those a plan keeps whatever its share as
    soon as it is ranked (`PreparedTuning.start_early`), the rest once the budget is shared;
    without workers each plan starts when its turn comes (`tune_plan`).

    A plan identical to an earlier one (the same dedupe key: every layer of a model after the
    first) is not prepared at all: it reuses that plan's kernels (`_reuse`), and only counts
    as one more copy of it in the budget's weights (a copy of a tuning-cache hit as one more
    cached plan; one that an earlier graph tuned, by its measured time); should the reuse
    fail, it takes the first's unmeasured choice or finds its stored result. Each plan's base
    lowering and key go into `bases` for `_compile_steps`, which would otherwise lower it
    again. (Preparing is a lowering, a source and a ranking of the schedule space: about 18 ms
    a plan, 1.9 s for the 103 repeated plans of a 12-layer BERT.)"""
    from .backends.triton import compile_pool

    if not _tunes_on_device(lowering.target, options):
        return {}
    pool = compile_pool.start()
    out, first, copies, again = {}, {}, {}, []
    seen: dict = {}  # dedupe key -> the first plan of this graph with it
    tuning_key: dict = {}  # plan -> its tuning key (those prepared for measuring)
    copy_of: list = []  # (plan, the earlier plan of this graph it repeats)
    earlier: list = []  # measured times of plans an earlier graph tuned that this graph repeats
    for step in steps:
        if isinstance(step, ExternStep) or (isinstance(step, KernelPlan) and _statically_empty(graph, step)):
            continue
        if isinstance(step, LibraryCall) or step.library.how == LIBRARY:
            continue
        bases[step.name] = _keyed_lowering(graph, step, lowering, options, stage)
        key = bases[step.name][2]
        if key in seen:
            copy_of.append((step.name, seen[key]))
            continue
        shared = dedupe.lookup(key)
        if shared is not None:  # an earlier graph's plan: reused; its time counts as a cached plan's
            tuned = shared.tuned
            if isinstance(tuned, TuneOutcome) and tuned.source in ("cache", "measured") and tuned.best_time:
                earlier.append(tuned.best_time)
            continue
        seen[key] = step.name
        with stage("tune"):
            views = _library_views(step.library)
            progress.now(f"ranking the schedules of {step.name}")
            aten = (lambda step=step, views=views: _aten_step(step, views)) if views is not None else None
            p = prepare_tuning(graph, step, lowering, level=options.autotune, device=device, aten=aten, start=False)
            if isinstance(p, PreparedTuning):
                copies[p.key] = copies.get(p.key, 0) + 1
                tuning_key[step.name] = p.key
                if p.key in first:  # the same kernel as an earlier plan: shared, or a tuning-cache hit by its turn
                    again.append((step.name, first[p.key]))
                    continue
                first[p.key] = step.name
                if pool:  # (its surest candidates compile while the graph's other plans are lowered)
                    p.start_early()
            out[step.name] = p
    for name, same in copy_of:
        if same in tuning_key:  # one more copy of a measured plan: weighs more in the budget
            copies[tuning_key[same]] += 1
        else:  # the first's outcome (a tuning-cache hit counts in the graph's time once per copy)
            out[name] = replace(out[same], seconds=0.0, phases={})
    with stage("tune"):
        prepared = [(name, p) for name, p in out.items() if isinstance(p, PreparedTuning)]
        total = options.tuning_budget_ms / 1000 if options.autotune == "1" else 0.0
        if not total:  # (`max`, or no graph budget: every plan its own budget)
            shares = [None] * len(prepared)
        else:
            # plans found in the tuning cache count in the graph's time (a share of 0 each): what
            # is negligible does not change once the heavy plans are cached
            cached = [o.best_time or 0.0 for o in out.values() if isinstance(o, TuneOutcome) and o.source == "cache"]
            cached += earlier
            shares = allot_budgets([p.predicted * copies[p.key] for _, p in prepared] + cached, total,
                                   [plan_budget(p) for _, p in prepared] + [0.0] * len(cached))[:len(prepared)]
        per_candidate = candidate_seconds(compile_pool.worker_count() if pool else 1)
        for (name, p), share in zip(prepared, shares):
            p.candidate_s = per_candidate
            logs.log("tune", "%s: predicted %.1f us (x%d): %s", name, p.predicted * 1e6, copies[p.key],
                     "its own budget" if share is None else f"{share:.3f} s of the graph's {total:.1f} s")
            if share == 0.0:
                out[name] = p.unmeasured(f"not measured: under {NEGLIGIBLE:.1%} of the graph's predicted time")
                continue
            p.budget_s = share
            if not pool:
                continue  # (started, and compiled in this process, when `tune_plan` reaches it)
            out[name] = p.try_start(share) or p
        for name, same in again + [c for c in copy_of if c[1] in tuning_key]:
            # a copy of an unmeasured plan: the same choice (nothing stored to find) should its
            # reuse fail; a copy of a measured one finds the stored result
            chosen = out.get(same)
            if chosen is not None and not isinstance(chosen, PreparedTuning):
                out[name] = replace(chosen, seconds=0.0, phases={})
    return out


def _tunes_on_device(target, options: Options) -> bool:
    """Whether a graph's plans are measured on a GPU, prepared together (`_prepare_tuning`)."""
    return not (target.on_cpu or target.interpret) and options.autotune in ("1", "max")


def _replaced(step, fitted, options, tuned, misfits: dict) -> None:
    """Say that a plan's configuration did not fit its target and what replaced it: one warning
    per compile for a knob's value (collected in `misfits`), a debug log for the tuner's or the
    rules' choice; the kernel's notes either way."""
    what = fitted.describe()
    step.notes.append(what)
    knob = None
    if tuned.schedule is None and step.kind == PlanKind.FLASH and options.flash_config:
        knob = "flash_config"
    elif tuned.schedule is None and step.kind == PlanKind.REDUCTION and fitted.replaced.get("persistent") and \
            options.persistent_reduction_limit != KNOBS["persistent_reduction_limit"].default:
        knob = "persistent_reduction_limit"
    if knob is not None:
        misfits.setdefault(knob, []).append(what)
    logs.log("tune" if tuned.schedule is not None else "tile", "%s", what)


def _record_origins(report: CompileReport, graph, schedule) -> None:
    """Each kernel's ATen ops and source lines: its plan's, or for a kernel the driver split off
    a plan (an epilogue, a merge) those of the nodes it computes."""
    plans = {k.name: k for k in schedule.kernels}
    for k in report.kernels:
        plan = plans.get(k.name)
        origin = plan.origin if plan is not None and plan.origin is not None else \
            kernel_origin(graph, k.nodes, schedule.inlined)
        k.ops, k.source_lines = list(origin.ops), list(origin.lines)


def _generate_and_load(tk, target, step, stage, printed=None):
    """(source, launcher) of one tile kernel on `target` (and its size variants: one source, a
    launcher that chooses per call). A kernel the target cannot print runs on its fallback (C++:
    the Triton interpreter), with the reason in the plan's notes. `printed(tk)`: its source if
    the limits check printed it already."""
    try:
        with stage("codegen"):
            source = (printed and printed(tk)) or target.generate(tk)
    except Exception as err:
        if target.unsupported is None or not isinstance(err, target.unsupported) or target.fallback is None:
            raise
        step.notes.append(f"{tk.name}: not printable as {target.title} ({err}): runs in {target.fallback.title}")
        logs.log("code", "%s: not printable as %s (%s): %s", tk.name, target.title, err, target.fallback.title)
        return _generate_and_load(tk, target.fallback, step, stage)
    with stage("load"):
        return source, _with_variants(tk, target.load(tk, source), lambda k: target.load_variant(k, source))


def _with_variants(tk, launcher, load):
    """The launcher, or one choosing per call between it and its variants' (`load(kernel)`)."""
    if tk.variants is None:
        return launcher
    return SizeDispatch(tk.variants, launcher, [load(k) for k in tk.variants.kernels])


def _library_views(choice):
    """The views the tuner measures the library with: the whole plan's, or its product's when
    the plan may be split."""
    if choice.views is not None:
        return choice.views
    return choice.split.views if choice.split is not None else None


def _split(step, split, steps: list, report, pending: list, shared, tune_s: float = 0.0,
           compile_s: float = 0.0) -> None:
    """`step` as the library's product (a step now) and its epilogue's pointwise plan (compiled
    next, as any plan: tuned, deduplicated, built)."""
    aten = _aten_step(step, split.views)
    aten.keep = shared
    what = describe_matmul(split.views)
    step.notes.append(f"{step.name}: the product in the library — {what} (ATen) — and the epilogue as "
                      f"{split.epilogue.name}" + (f" (as {shared.plan})" if shared is not None and shared.plan != step.name
                                                   else ""))
    steps.append(aten)
    reused = shared is not None and shared.plan != step.name
    kr = KernelReport(step.name, "aten-matmul", step.members, what, "", step.notes, tune_s,
                      compile_seconds=compile_s, shares=shared.plan if reused else "")
    report.kernels.append(kr)
    if shared is not None and not reused:
        shared.reports.append(kr)  # (later layers' products count as its copies: `explain`'s distinct kernels)
    elif reused and shared.reports:
        shared.reports[0].shared_by += 1
    epilogue = replace(split.epilogue, notes=list(split.epilogue.notes))
    epilogue.library = ProductChoice(GENERATED)
    pending.insert(0, epilogue)


def _aten_step(plan, views) -> KernelStep:
    bias = [views.bias.buffer] if views.bias is not None else []
    return KernelStep(plan.name, AtenMatmul(views), [views.out], [views.a.buffer, views.b.buffer, *bias])


def _statically_empty(graph, plan) -> bool:
    sizes = [graph[n].shape for n in plan.stores]
    return bool(sizes) and all(any(sympy.sympify(d) == 0 for d in shape) for shape in sizes)


@artifact_function
def _nothing(buffers, env) -> None:
    return None


