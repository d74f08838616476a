"""The public API: the torch.compile backend, `tilefuse.compile`, and `tilefuse.explain`.

The backend captures Dynamo's FX graph through AOTAutograd with PyTorch's core-ATen
decompositions, so forward and backward graphs both reach the compiler. A failure inside
tilefuse never silently breaks the user's program: with `TILEFUSE_FALLBACK=eager` (default)
the graph runs eagerly with a warning naming the stage, the op and a reproducer script; with
`error` it raises `TilefuseError` with the same message. `TILEFUSE_VERIFY=1` checks each graph
against eager on its first run and names the first diverging kernel (`verify_mode`). An
index out of range that a generated kernel's check finds is the program's error, not ours: it
is raised as eager raises it (`IndexError` / `RuntimeError`, naming the op).
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import itertools
import logging
import time
import traceback
import warnings
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from . import logs, output_views
from .compiler import CompileReport, compile_fx
from .config import KNOBS, Options, config, resolve_options
from .errors import CheckError, ConfigError, ProgramError, TilefuseError, TilefuseFallbackWarning, UnknownOptionError

if TYPE_CHECKING:
    from .explanation import Explanation

_graph_ids = itertools.count()
SAVED_FROM = "tilefuse_saved_from"  # a forward graph's meta: the position of its first saved tensor
_report_sinks: list = []  # explain() collects reports here while it runs
_history: collections.deque = collections.deque(maxlen=64)  # last_compilations()


def _decompositions(training: bool = False):
    """Core-ATen decompositions, less the CPU flash attention one (as Inductor drops it): it
    returns the attention probabilities where the op returns the logsumexp, which the
    backward op (`_scaled_dot_product_flash_attention_for_cpu_backward`) reads — a training
    step through `F.scaled_dot_product_attention` on CPU got wrong gradients. The op is
    lowered instead (`frontend/lowerings/attention.py`), logsumexp included.

    `training` (with the `recompute` knob): `softmax` and `log_softmax` are spelt out (max,
    sum, exp, log) so that the partition may save their input and two numbers per row, and the
    backward recompute the output, rather than saving the output: under autocast the output is
    fp32 and the input bf16 (the attention scores, a language model's logits), half the bytes;
    a loss reads `log_softmax`'s output only at the targets.

    Transformer layers' inference fast paths (`frontend/fast_path_layers.py`) are spelt out as
    the layers' ops, so they fuse rather than run as one opaque ATen kernel."""
    from torch._decomp import core_aten_decompositions, get_decompositions

    from .frontend import fast_path_layers

    table = core_aten_decompositions()
    table.pop(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, None)
    table.update(fast_path_layers.decompositions())
    if training:
        table.update(get_decompositions([torch.ops.aten._softmax, torch.ops.aten._log_softmax]))
    return table


def _device_of(gm: torch.fx.GraphModule) -> torch.device:
    """Where the graph's tensors live: the first input not on the CPU (an AOTAutograd graph's
    placeholders hold their values as `val`, Dynamo's as `example_value`)."""
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val", node.meta.get("example_value"))
            if isinstance(val, torch.Tensor) and val.device.type != "cpu":
                return val.device
    return torch.device("cpu")


def _fail(phase: str, name: str, err: BaseException, eager, options: Options, gm=None, args=None):
    """Report an internal failure: raise `TilefuseError` (fallback "error") or warn and return
    `eager` to run the graph with (fallback "eager"). The message names the stage and the op
    that failed and points to a standalone reproducer of the graph."""
    from .failure import describe_failure, write_reproducer

    failure = describe_failure(err, phase)
    msg = f"tilefuse failed while {phase} {name} — stage: {failure.stage}"
    if failure.op:
        msg += f"; op: {failure.op}"
    msg += f"; {failure.error}"
    repro = write_reproducer(gm, args, title=msg, name=name, knobs=options.non_defaults()) if gm is not None else None
    if repro:
        msg += f"\nreproducer: python {repro}"
    logs.log("runtime", "%s\n%s", msg, "".join(traceback.format_exception(err)))
    if options.fallback == "error":
        raise TilefuseError(msg) from err
    warnings.warn(msg + "\nrunning this graph eagerly (set TILEFUSE_FALLBACK=error to raise)",
                  TilefuseFallbackWarning, stacklevel=3)
    return eager


def _compile_graph(gm: torch.fx.GraphModule, example_inputs, kind: str, settings: dict, inference: bool = False,
                   front=None):
    """Compile one graph AOTAutograd hands over. `front`: the training graph's front-cache entry
    (`front_cache.TrainingEntry`) that this forward or backward fills in."""
    name = f"{kind}{next(_graph_ids)}"
    t0 = time.perf_counter()
    # the compile's options: the configuration as it is now (a backward graph compiles later,
    # under the configuration of that moment) with the compile's own settings over it
    options = config.options(settings)
    views = output_views.find(gm, _read_by_tilefuse_from(gm, kind, inference),
                              sole_views_from=0 if kind == "backward" else None)
    try:
        with _process_settings(settings):
            compiled, report = compile_fx(output_views.compiled_as_bases(gm, views), _device_of(gm), name, options,
                                          inference=inference)
    except (ConfigError, UnknownOptionError):
        raise  # the user's error, not ours: never an eager fallback
    except ProgramError as err:  # the program's own error: eager raises it when the graph runs
        report = CompileReport(name, graph_ir=f"(runs as written: {err})")
        report.runs_as_written = str(err)
        _record(report, gm, settings, options)
        logs.log("graph", "%s runs as written: %s (eager raises this when it runs)", name, err)
        return _boxed(gm.forward)
    except Exception as err:  # noqa: BLE001 - every failure falls back or raises clearly
        report = CompileReport(name, graph_ir=f"(compilation failed: {type(err).__name__}: {err})")
        report.failure = f"{type(err).__name__}: {err}"
        _record(report, gm, settings, options)
        with _process_settings(settings):
            runner = _fail("compiling", name, err, gm.forward, options, gm)
        return _boxed(runner)
    report.stage_seconds["total"] = time.perf_counter() - t0
    mutated = _mutated_inputs(gm)
    static = _static_inputs()
    ran_once = None
    plain = None  # (the inputs whose versions a lean call bumps, where the call may be lean)
    if inference:
        with _process_settings(settings):  # (the entry goes where the compile's cache is)
            plain = _remember_front(gm, report, views, mutated, static)
    elif front is not None:
        front.graphs[kind] = (compiled, report)
        if kind == "forward":
            front.forward_compiled(_fw_metadata(), gm, gm.meta.get(SAVED_FROM), report.graph_key, views, mutated)
        else:
            from .front_cache import conditions

            front.backward_compiled(gm, report.graph_key, conditions(options), views)

        def ran_once():
            with _process_settings(settings):
                front.ran_once(kind)
    private_from = None if inference else gm.meta.get(SAVED_FROM) if kind == "forward" else 0
    run = _runner(name, gm, compiled, report, settings, options, inference, views, mutated, static, ran_once,
                  private_from=private_from, gradients=kind == "backward")
    lean = _lean_inference.get()
    if inference and lean is not None:
        lean["compiles"] = lean.get("compiles", 0) + 1
        if plain is not None:
            lean["runner"] = run  # (Dynamo calls it without AOTAutograd's wrapper: `_aot_compiled`)
            lean["bumped"] = plain
    return _boxed(run)


def _runner(name, gm, compiled, report, settings: dict, options: Options, inference: bool, views, mutated: list,
            static: list, ran_once: Callable | None = None, autocast_off: bool = False,
            private_from: int | None = None, gradients: bool = False):
    """The function that runs a compiled graph for AOTAutograd (or, from the front cache, for
    Dynamo): CUDA graphs where asked, the views of its outputs rebuilt, the fallback on a
    failed first launch, verify mode's check on the first run. `ran_once` is called after the
    first call that neither failed nor fell back; `autocast_off`: the compiled graph runs with
    autocast off (its eager fallback and verify's reference, Dynamo's graph, with autocast as
    the caller has it); `private_from`, `gradients`: which output views may be tensors of their
    own over their storage (a training forward's saved tensors, a backward's gradients that
    are sole views of an intermediate: `output_views.Rebuilder`)."""
    if options.cuda_graphs:
        compiled = _with_cuda_graphs(compiled, report, inference, mutated, static)
    _record(report, gm, settings, options)
    state = {"first": True, "runner": compiled}
    rebuild_views = output_views.Rebuilder(views, private_from, gradients) if views else None

    def run(*args):
        runner = state["runner"]
        if runner is not compiled:
            return runner(*args)
        before = None
        if state["first"] and mutated and options.verify:  # the reference needs the inputs as they were
            before = {k: args[k].clone() for k in mutated}
        try:
            if autocast_off:  # (a graph traced under autocast, served from the front cache)
                with torch._C._DisableAutocast():
                    out = compiled(*args)
            else:
                out = compiled(*args)
            if views:
                out = rebuild_views(compiled, args, out)
        except CheckError:  # an index out of range, a division by zero: the program's own error, as in eager
            raise
        except Exception as err:  # noqa: BLE001 - the first launch also compiles the kernels
            return _eager_after_failure(name, gm, err, args, settings, options, state)
        if state["first"]:
            state["first"] = False
            if options.verify:
                with _process_settings(settings):
                    out = _verify(name, gm, compiled, report, args, out, state, options, before)
            if ran_once is not None and state["runner"] is compiled:
                ran_once()
        return out

    return run


def _eager_after_failure(name, gm, err: BaseException, args, settings: dict, options: Options, state: dict):
    """A compiled graph's call failed: the graph `gm` runs eagerly instead (if that fails too,
    the error is the program's own and is raised), `_fail` reports the failure (or raises it,
    with fallback "error"), and later calls run eagerly (`state["runner"]`)."""
    eager_out = gm.forward(*args)
    with _process_settings(settings):
        state["runner"] = _fail("running", name, err, gm.forward, options, gm, args)
    return eager_out


def _static_inputs() -> list:
    """The inputs AOTAutograd found static (parameters, buffers: CUDA graphs keep them where
    they are), from the compile's tracing context."""
    return list(getattr(_fw_metadata(), "static_input_indices", None) or [])


def _fw_metadata():
    """AOTAutograd's metadata of the graph being compiled (`ViewAndMutationMeta`), or None."""
    context = torch._guards.TracingContext.try_get()
    return getattr(context, "fw_metadata", None) if context is not None else None


#: (front key, Dynamo's argument count, autocast on) of the inference graph AOTAutograd is
#: compiling (`_aot` sets it around the trace)
_front_key: contextvars.ContextVar = contextvars.ContextVar("tilefuse_front_key", default=None)
#: where the inference compiler leaves the runner of a plain inference graph for `_aot_compiled`
#: to return in place of AOTAutograd's wrapper (a dict while an eligible graph traces)
_lean_inference: contextvars.ContextVar = contextvars.ContextVar("tilefuse_lean_inference", default=None)
#: the index formulas of the Dynamo graph being compiled, described (for its graphs' reports)
_index_formulas: contextvars.ContextVar = contextvars.ContextVar("tilefuse_index_formulas", default=())


def _remember_front(gm: torch.fx.GraphModule, report: CompileReport, views, mutated: list,
                    static: list) -> list | None:
    """Point the front cache's entry of the Dynamo graph being compiled at the graph cache's
    entry of this compiled graph, where AOTAutograd's wrapper around it does nothing but bump
    the version counters of inputs the graph writes. Those inputs' positions where that is all
    the wrapper does (whether or not the graph cache holds the graph), else None."""
    from . import front_cache

    pending = _front_key.get()
    _front_key.set(None)  # (one inference graph per trace: this one)
    if pending is None:
        return None
    front, dynamo_inputs, autocast = pending
    placeholders = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
    metadata = _fw_metadata()
    if not front_cache.plain_runtime(metadata, placeholders, dynamo_inputs, writes_in_graph=True):
        return None
    bumped = front_cache.bumped_versions(metadata)
    if report.graph_key:
        record = {"graph_key": report.graph_key, "static_inputs": [int(k) for k in static], "autocast": autocast,
                  "mutated": [int(k) for k in mutated], "bumped_versions": bumped}
        front_cache.store(front, record, views)
    return bumped


def _from_front_cache(front: str, gm: torch.fx.GraphModule, settings: dict):
    """Dynamo's graph run by the compiled graphs the front cache names, or None on a miss."""
    from . import front_cache, graph_cache

    t0 = time.perf_counter()
    with _process_settings(settings):  # (the compile's cache directory)
        record = front_cache.load(front)
        if record is None:
            return None
        training = record.get("kind") == "training"
        device = _device_of(gm)
        name = f"forward{next(_graph_ids)}"
        loaded = graph_cache.load(record["graph_key"], device, name)
        backward = graph_cache.load(record["backward_key"], device, f"backward{next(_graph_ids)}") \
            if training and loaded is not None else None
    options = config.options(settings)
    if loaded is None or (training and backward is None):
        return None
    compiled, report = loaded
    total = time.perf_counter() - t0
    # (the graph cache's loads apart: the backward's load is in its own report)
    backward_load = sum(backward[1].stage_seconds.values()) if backward else 0.0
    report.stage_seconds["front cache"] = total - backward_load - sum(report.stage_seconds.values())
    report.stage_seconds["total"] = total - backward_load
    for graph, key in [(loaded, record["graph_key"])] + ([(backward, record["backward_key"])] if training else []):
        graph[0].generates_calls = options.generated_wrapper
        graph[0].kernel_runs = options.kernel_runs
        graph[1].graph_key = key
    logs.log("cache", "graph %s: from the front cache (%s), AOTAutograd not traced", name, front[:12])
    if training:
        return _front_training_runner(name, gm, record, loaded, backward, settings, options)
    run = _runner(name, gm, compiled, report, settings, options, True, record["views"], record.get("mutated", []),
                  record.get("static_inputs", []), autocast_off=bool(record.get("autocast")))

    return _without_grad(run, bumped=record.get("bumped_versions", []))


def _without_grad(run, autocast_off: bool = False, bumped: Sequence[int] = ()):
    """`run` as AOTAutograd's wrapper runs a plain inference graph: with grad off, with autocast
    off where the graph was traced under it (the trace holds its casts), and the version
    counters of the `bumped` inputs, which the graph writes, bumped after the call."""
    written = tuple(bumped)

    def without_grad(*args):
        grad = torch.is_grad_enabled()
        if grad:
            torch._C._set_grad_enabled(False)
        try:
            if autocast_off:
                with torch._C._DisableAutocast():
                    out = run(*args)
            else:
                out = run(*args)
        finally:
            if grad:
                torch._C._set_grad_enabled(True)
        if written:
            torch.autograd.graph.increment_version(tuple(args[k] for k in written))
        return out

    return without_grad


def _front_training_runner(name, gm, record: dict, forward, backward, settings: dict, options: Options,
                           record_reports: bool = True):
    """A training graph from the front cache: AOTAutograd's autograd function rebuilt around the
    stored forward and backward (`front_autograd`); Dynamo's graph runs eagerly, with the
    fallback's warning, if the first call fails. `record_reports`: the graphs' reports join
    `last_compilations` (not where this process compiled them and recorded them then)."""
    from .front_autograd import autograd_runner

    (fw, fw_report), (bw, bw_report) = forward, backward
    for report in (fw_report, bw_report) if record_reports else ():
        _record(report, gm, settings, options)
    rebuild_views = output_views.Rebuilder(record["views"], record["outputs"]) if record["views"] else None
    rebuild_grads = output_views.Rebuilder(record["backward_views"], 0, gradients=True) \
        if record["backward_views"] else None

    def run_forward(*args):
        out = fw(*args)
        return rebuild_views(fw, args, out) if rebuild_views else out

    def run_backward(*args):  # (saved tensors, then gradients: the backward graph's inputs)
        out = bw(*args)
        return rebuild_grads(bw, args, out) if rebuild_grads else out

    function = autograd_runner(run_forward, run_backward, record)
    state = {"runner": None}

    def run(*args):
        if state["runner"] is not None:
            return state["runner"](*args)
        try:
            out = function(*args)
        except CheckError:  # the program's own error, as in eager
            raise
        except Exception as err:  # noqa: BLE001 - the first launch also loads the kernels
            return _eager_after_failure(name, gm, err, args, settings, options, state)
        state["runner"] = function
        return out

    return run


def _read_by_tilefuse_from(gm: torch.fx.GraphModule, kind: str, inference: bool) -> int | None:
    """The first output that only tilefuse reads (views found by their ops are made there): every
    output of an inference graph, the tensors a training forward saves for its backward (the
    partition records where they start), none of a backward's."""
    if inference:
        return 0
    return gm.meta.get(SAVED_FROM) if kind == "forward" else None


def _process_settings(settings: dict):
    """The process settings (`Knob.process`: log channels, the disk cache, build workers) a
    compile's own options name, applied while its graph compiles or reports: the logging and
    the cache read them where they work. Every other knob travels in the compile's `Options`."""
    return config.patch(**{name: value for name, value in settings.items() if KNOBS[name].process})


def _with_cuda_graphs(compiled, report: CompileReport, inference: bool, mutated: list, static: list):
    """The compiled graph replayed as CUDA graphs where it can be (`runtime.cuda_graphs`);
    else itself, with the reason in the report. `static`: the inputs that stay where they are."""
    from .runtime.cuda_graphs import CudaGraphRunner

    if compiled.device.type != "cuda":
        report.cuda_graphs = f"not used: the graph runs on {compiled.device.type} tensors"
        return compiled
    if not inference:
        report.cuda_graphs = "not used: a training graph (CUDA graphs serve inference graphs today)"
        return compiled
    return CudaGraphRunner(compiled, static, mutated, report)


def _record(report: CompileReport, gm: torch.fx.GraphModule, settings: dict, options: Options) -> None:
    """Keep the report for `last_compilations()` and a running `explain`, and write it under
    `TILEFUSE_DEBUG_DIR` when that is set."""
    report.settings = dict(settings)
    report.index_formulas = list(_index_formulas.get())
    if logs.enabled("compile_time", logging.INFO):
        from .compile_profile import report_text

        logs.info("compile_time", "%s", report_text(report))
    _history.append(report)
    for sink in _report_sinks:
        sink.append(report)
    debug_dir = options.debug_dir
    if debug_dir:
        from .debug_dump import dump_graph

        dump_graph(debug_dir, report, gm)
        logs.info("runtime", "%s written under %s", report.graph_name, debug_dir)


def _mutated_inputs(gm: torch.fx.GraphModule) -> list:
    """Positions of the inputs the graph writes into (kept input mutations)."""
    from .frontend.reinplace import mutates_input

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    written = {n.args[0] for n in gm.graph.nodes
               if n.op == "call_function" and mutates_input(n.target) and n.args}
    return [k for k, p in enumerate(placeholders) if p in written]


def _verify(name, gm, compiled, report, args, out, state, options: Options, before=None):
    """TILEFUSE_VERIFY: the fp64 rule against eager on the first run; on a mismatch, the first
    diverging kernel is reported (error, or warning and eager from then on). `before`: copies
    of the inputs the graph writes into, as they were before the call (the checks run on
    copies of them, never on the program's own tensors)."""
    from .verify_mode import verify_graph

    try:
        result = verify_graph(name, gm.forward, compiled, args, out, report, before)
    except Exception as err:  # noqa: BLE001 - a broken check must not break the program
        logs.log("runtime", "verify of %s could not run: %s: %s", name, type(err).__name__, err)
        return out
    if result.ok:
        logs.log("runtime", "%s", result)
        return out
    msg = str(result)
    if options.fallback == "error":
        raise TilefuseError(msg)
    warnings.warn(msg + "\nrunning this graph eagerly from now on (set TILEFUSE_FALLBACK=error to raise)",
                  TilefuseFallbackWarning, stacklevel=3)
    state["runner"] = gm.forward
    for k, t in (before or {}).items():
        args[k].copy_(t)  # undo the compiled call's writes before the eager one
    return gm.forward(*args)


def _boxed(fn):
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(fn)


def _aot(gm: torch.fx.GraphModule, example_inputs, settings: dict):
    """Dynamo's graph compiled, its captured tensors that are index formulas computed rather
    than read (`frontend.index_constants`: guarded per call, with a compile that reads them
    when a guard fails)."""
    layouts = sorted({str(t.layout) for t in example_inputs if isinstance(t, torch.Tensor) and t.layout != torch.strided})
    if layouts:  # (mkldnn or sparse tensors: kernels read strided memory; the graph runs as written)
        options = config.options(settings)
        msg = f"tilefuse compiles strided tensors only; this graph's inputs include {', '.join(layouts)} tensors"
        if options.fallback == "error":
            raise TilefuseError(msg)
        warnings.warn(msg + "\nrunning this graph eagerly", TilefuseFallbackWarning, stacklevel=2)
        return gm.forward
    if settings.get("index_constants", config.index_constants):
        from .frontend import index_constants

        try:
            formulas = index_constants.find(gm, example_inputs)
            substituted = index_constants.substituted(gm, formulas) if formulas else gm
        except Exception as err:  # noqa: BLE001 - formulas are an optimisation: the graph compiles without
            logs.log("graph", "index constants: none (%s: %s)", type(err).__name__, err)
            formulas = []
        if formulas:
            token = _index_formulas.set(tuple(f.describe() for f in formulas))
            try:
                compiled = _aot_compiled(substituted, example_inputs, settings)
            finally:
                _index_formulas.reset(token)
            return index_constants.Guarded(compiled, formulas, example_inputs,
                                           lambda args: _aot_compiled(gm, args, settings), gm)
    return _aot_compiled(gm, example_inputs, settings)


def _aot_compiled(gm: torch.fx.GraphModule, example_inputs, settings: dict):
    """Dynamo's graph compiled: from the front cache where it holds the graph (no trace), else
    traced by AOTAutograd into the graphs tilefuse compiles."""
    training = _training(example_inputs)
    front = _front_key_of(gm, example_inputs, settings, training)
    if front is not None:
        runner = _from_front_cache(front, gm, settings)
        if runner is not None:
            return runner
    if any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs) and \
            settings.get("target", config.target) in ("auto", "triton"):
        from .backends.triton import compile_pool, launcher

        with _process_settings(settings):
            compile_pool.start()  # the workers start (import Triton) while AOTAutograd traces
        launcher.prefetch_triton_key()
    from .frontend import flex_attention

    chains = settings.get("attention_backward", config.attention_backward)
    flex_attention.decompose(gm, training, chains)
    if training and chains:
        from .frontend.attention_chains import rewrite

        rewrite(gm)
    autocast = torch._C._is_any_autocast_enabled()
    entry = None
    if front is not None and training:
        from .front_cache import TrainingEntry, conditions

        entry = TrainingEntry(front, len(example_inputs), autocast, conditions(config.options(settings)))
    token = _front_key.set(None if front is None or training else (front, len(example_inputs), autocast))
    lean: dict | None = {} if front is not None and not training else None
    lean_token = _lean_inference.set(lean)
    try:
        traced = _traced(gm, example_inputs, settings, entry)
    finally:
        _front_key.reset(token)
        _lean_inference.reset(lean_token)
    if lean and lean.get("runner") is not None and lean["compiles"] == 1:  # (the trace's one graph)
        # a plain inference graph: Dynamo calls it as a warm process would from the front cache,
        # without AOTAutograd's runtime wrapper, which passes such a graph's arguments and
        # results through unchanged but for the version counters of inputs the graph writes,
        # bumped here too (1.3 µs a call on a 2-core CPU)
        return _without_grad(lean["runner"], autocast_off=autocast, bumped=lean["bumped"])
    if entry is not None and not isinstance(gm, torch._dynamo.utils.GmWrapper):
        return _lean_after_first_steps(traced, entry, gm, settings)
    return traced


def _lean_after_first_steps(traced, entry, gm: torch.fx.GraphModule, settings: dict):
    """A training graph AOTAutograd traced, called as a warm process calls it once its first
    steps have run: AOTAutograd's function serves until the forward and backward have each run
    once and the front-cache entry is whole (`TrainingEntry.complete`: the graph passed
    `plain_training`, whose runtime wrapper does nothing tilefuse's own function does not), then
    the same compiled graphs run through the front cache's autograd function
    (`front_autograd`), without AOTAutograd's runtime wrapper (through which a small CPU
    training step's forward and backward ran 4–5% slower than a warm process's). Autograd
    graphs of the earlier steps keep AOTAutograd's."""
    state: dict = {"run": None}

    def run(*args):
        lean = state["run"]
        if lean is not None:
            return lean(*args)
        out = traced(*args)
        if entry.complete and {"forward", "backward"} <= entry.graphs.keys():
            record = dict(entry.record, views=entry.views, backward_views=entry.backward_views)
            forward, backward = entry.graphs["forward"], entry.graphs["backward"]
            state["run"] = _front_training_runner(forward[1].graph_name, gm, record, forward, backward, settings,
                                                  config.options(settings), record_reports=False)
            entry.graphs.clear()  # (the runner holds them now)
        return out

    for name in ("zero_grad", "named_parameters", "named_buffers", "serialize"):
        if hasattr(traced, name):
            setattr(run, name, getattr(traced, name))
    return run


def _front_key_of(gm, example_inputs, settings: dict, training: bool) -> str | None:
    from . import front_cache

    with _process_settings(settings):
        return front_cache.key(gm, example_inputs, config.options(settings), training)


def _traced(gm: torch.fx.GraphModule, example_inputs, settings: dict, front=None):
    """`gm` traced by AOTAutograd and its graphs compiled; `front`: a training graph's front-cache
    entry that they fill in."""
    from torch._functorch.aot_autograd import aot_module_simplified

    return aot_module_simplified(
        gm, example_inputs,
        partition_fn=_partitioner(settings),
        fw_compiler=functools.partial(_compile_graph, kind="forward", settings=settings, front=front),
        bw_compiler=functools.partial(_compile_graph, kind="backward", settings=settings, front=front),
        inference_compiler=functools.partial(_compile_graph, kind="forward", settings=settings, inference=True),
        decompositions=_decompositions(_training(example_inputs) and settings.get("recompute", config.recompute)),
        # in-place updates of inputs (a KV-cache write) stay in the graph: the frontend writes
        # them in place instead of AOTAutograd copying a whole new tensor back after the call
        keep_inference_input_mutations=True,
    )


def _training(example_inputs) -> bool:
    """Whether AOTAutograd will trace a joint forward-backward graph (its own test)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)


def _partitioner(settings: dict):
    """How a training graph is cut into forward and backward: with `recompute`, AOTAutograd's
    min-cut partition (the forward saves products' and reductions' results, the backward
    recomputes the elementwise work between them: fewer bytes saved, written and read back);
    without, every intermediate the backward reads is saved."""
    import torch._functorch.config as functorch_config
    from torch._functorch import partitioners

    from .frontend.joint_cse import eliminate_common_subexpressions

    min_cut = settings.get("recompute", config.recompute)
    cut = partitioners.min_cut_rematerialization_partition if min_cut else partitioners.default_partition

    def partition(joint, inputs, **kwargs):
        _recompute_counter_based_randomness(joint)
        _recompute_input_free_values(joint)
        if min_cut:  # common subexpressions merged by tilefuse's pass, not AOTAutograd's (joint_cse)
            eliminate_common_subexpressions(joint)
            with functorch_config.patch(cse=False):
                forward, backward = cut(joint, inputs, **kwargs)
        else:
            forward, backward = cut(joint, inputs, **kwargs)
        forward.meta[SAVED_FROM] = kwargs.get("num_fwd_outputs")  # what follows is saved for the backward
        return forward, backward

    return partition


def _recompute_counter_based_randomness(joint: torch.fx.GraphModule) -> None:
    """Random numbers that are a function of a seed (`frontend.random_ops.philox_uniform`, a
    dropout mask on attention weights) are recomputed by the backward from the saved seed,
    never saved themselves: the partition would otherwise keep the T×T mask that the chain
    exists to avoid (it does not recompute ops it does not know)."""
    from torch.utils.checkpoint import CheckpointPolicy

    from .frontend import random_ops

    uniform = random_ops.philox_uniform._opoverload
    for node in joint.graph.nodes:
        if node.op == "call_function" and node.target is uniform:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


def _recompute_input_free_values(joint: torch.fx.GraphModule) -> None:
    """Values computed from no input — a mask or a distance from `arange`, what
    `frontend.index_constants` makes of a captured `tril` buffer — are recomputed by the
    backward, never saved: the partition otherwise saves a T×T mask that the backward's
    kernels compute from indices for free (it bans recomputing what the backward reads in a
    kernel it cannot fuse into, such as the attention chain's). Only ops AOTAutograd itself
    counts as cheap to recompute (index arithmetic, comparisons, pointwise, views)."""
    from torch._functorch import partitioners
    from torch.utils.checkpoint import CheckpointPolicy

    try:
        cheap = partitioners.get_default_op_list().is_recomputable
    except (AttributeError, TypeError):  # (a PyTorch without the helper: nothing marked)
        return
    free: set = set()
    for node in joint.graph.nodes:
        if node.op != "call_function" or any(a not in free for a in node.all_input_nodes) or not cheap(node):
            continue
        free.add(node)
        node.meta.setdefault("recompute", CheckpointPolicy.MUST_RECOMPUTE)


def dynamo_backend(gm: torch.fx.GraphModule, example_inputs, *, mode: str | None = None,
                   options: Mapping[str, Any] | None = None, **knobs: Any):
    """The `torch.compile(backend="tilefuse", mode=..., options={...})` entry point. torch.compile
    hands a backend its `mode` and `options` only when it compiles the first graph, so a bad one
    is raised then (as a `ConfigError`/`UnknownOptionError` inside Dynamo's
    `BackendCompilerFailed`); `tilefuse.compile` checks them at once."""
    return _aot(gm, example_inputs, resolve_options(mode, options, **knobs))


class TilefuseBackend:
    """A torch.compile backend with tilefuse settings bound (what `tilefuse.compile` passes)."""

    def __init__(self, settings: dict):
        self.settings = dict(settings)
        self.__name__ = "tilefuse"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        return _aot(gm, example_inputs, self.settings)

    def __repr__(self) -> str:
        return f"TilefuseBackend({self.settings})"


def _settings(mode, options, knobs, where: str) -> dict:
    if "backend" in knobs or "backend" in (options or {}):
        raise UnknownOptionError(f"{where} has no option 'backend' (the torch.compile backend is tilefuse itself); "
                                 "the kernel target is target='auto'|'triton'|'cpu'|'interpret'")
    return resolve_options(mode, options, **knobs)


def compile(fn: Callable | None = None, *, mode: str | None = None, options: Mapping[str, Any] | None = None,
            dynamic: bool | None = None, fullgraph: bool = False, **knobs: Any) -> Callable:
    """`torch.compile(fn, backend="tilefuse", ...)` with tilefuse's options checked at once:
    `mode` (torch.compile's modes), `options={...}` or keyword knobs (`target="cpu"`,
    `autotune="max"`, ...; `tilefuse config` lists them). An unknown name raises `TypeError`,
    a bad value `ValueError`, here rather than at the first call. Without `fn`, a decorator."""
    settings = _settings(mode, options, knobs, "tilefuse.compile")
    if fn is None:
        return lambda f: torch.compile(f, backend=TilefuseBackend(settings), dynamic=dynamic, fullgraph=fullgraph)
    return torch.compile(fn, backend=TilefuseBackend(settings), dynamic=dynamic, fullgraph=fullgraph)


def explain(fn: Callable, *args: Any, options: Mapping[str, Any] | None = None, mode: str | None = None,
            dynamic: bool | None = None, verbose: bool = False, **kwargs: Any) -> "Explanation":
    """Compile and run `fn(*args, **kwargs)` once; return an `Explanation` of every graph
    compiled (forward, and backward where anything requires grad: compiled now, without running
    it) and every graph break. `print()` it for a summary; `verbose=True` (or
    `.source(kernel)`) for sources. tilefuse's own options go in `options={...}` / `mode=`."""
    from .explanation import Explanation
    from .frontend.graph_breaks import recorded_graph_breaks

    settings = _settings(mode, options, {}, "tilefuse.explain")
    sink: list = []
    _report_sinks.append(sink)

    def backend(gm, example_inputs):  # a fresh backend object: Dynamo compiles anew for it
        return _aot(gm, example_inputs, settings)

    try:
        with recorded_graph_breaks() as breaks, _backward_compiled_with_forward():
            compiled = torch.compile(fn, backend=backend, dynamic=dynamic)
            t0 = time.perf_counter()
            compiled(*args, **kwargs)
            first_call = time.perf_counter() - t0
    finally:
        _report_sinks.remove(sink)
    if not sink:
        warnings.warn("tilefuse.explain: Dynamo compiled no graph for this call (a function without tensor "
                      "operations, or its recompile limit reached after many explain calls of one function: "
                      "torch._dynamo.reset() clears it)", stacklevel=2)
    return Explanation(sink, first_call, list(breaks), verbose=verbose)


def _backward_compiled_with_forward():
    """AOTAutograd compiles a backward graph when the backward first runs; explain asks for it
    with the forward, so a training model's backward is reported without running it."""
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        return functorch_config.patch(force_non_lazy_backward_lowering=True)
    return contextlib.nullcontext()


def last_compilations(graphs: int | None = None) -> "Explanation":
    """What the latest compilations of this process did, without compiling again (the last
    `graphs` graphs, or every one kept: up to 64)."""
    from .explanation import Explanation

    kept = list(_history)
    return Explanation(kept[-graphs:] if graphs else kept)
