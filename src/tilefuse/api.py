"""The public API: the torch.compile backend, `tilefuse.compile`, and `tilefuse.explain`.

The backend captures Dynamo's FX graph through AOTAutograd with PyTorch's core-ATen
decompositions, so forward and backward graphs both reach the compiler. A failure inside
tilefuse never silently breaks the user's program: with `TILEFUSE_FALLBACK=eager` (default)
the graph runs eagerly with a warning naming the stage; with `error` it raises
`TilefuseError`.
"""
from __future__ import annotations

import functools
import itertools
import time
import traceback
import warnings

import torch

from . import logs
from .compiler import CompileReport, compile_fx
from .config import config

_graph_ids = itertools.count()
_report_sinks: list = []  # explain() collects reports here while it runs


class TilefuseError(RuntimeError):
    pass


class TilefuseFallbackWarning(UserWarning):
    pass


def _decompositions():
    from torch._decomp import core_aten_decompositions

    return core_aten_decompositions()


def _device_of(gm: torch.fx.GraphModule) -> torch.device:
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and val.device.type != "cpu":
                return val.device
    return torch.device("cpu")


def _fail(stage: str, name: str, err: BaseException, eager):
    msg = f"tilefuse failed while {stage} {name}: {type(err).__name__}: {err}"
    if config.fallback == "error":
        raise TilefuseError(msg) from err
    warnings.warn(msg + " — running this graph eagerly (set TILEFUSE_FALLBACK=error to raise)",
                  TilefuseFallbackWarning, stacklevel=3)
    logs.log("runtime", "%s\n%s", msg, "".join(traceback.format_exception(err)))
    return eager


def _compile_graph(gm: torch.fx.GraphModule, example_inputs, kind: str, options: dict | None = None):
    name = f"{kind}{next(_graph_ids)}"
    t0 = time.perf_counter()
    try:
        with config.patch(**(options or {})):  # also for backward graphs, compiled later
            compiled, report = compile_fx(gm, _device_of(gm), name)
    except Exception as err:  # noqa: BLE001 - every failure falls back or raises clearly
        report = CompileReport(name, graph_ir=f"(compilation failed: {type(err).__name__}: {err})")
        for sink in _report_sinks:
            sink.append(report)
        runner = _fail("compiling", name, err, gm.forward)
        return _boxed(runner)
    report.stage_seconds["total"] = time.perf_counter() - t0
    for sink in _report_sinks:
        sink.append(report)
    state = {"first": True, "runner": compiled}

    def run(*args):
        if not state["first"]:
            return state["runner"](*args)
        try:
            out = compiled(*args)
            if config.verify:
                _verify(name, compiled, args, out)
            state["first"] = False
            return out
        except TilefuseError:
            raise
        except Exception as err:  # noqa: BLE001 - first launch compiles the kernels
            state["runner"] = _fail("running", name, err, gm.forward)
            state["first"] = False
            return state["runner"](*args)

    return _boxed(run)


def _verify(name, compiled, args, out):
    from .ir.interpret import interpret

    ref = interpret(compiled.graph, list(args))
    for k, (a, b) in enumerate(zip(out, ref)):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.dtype.is_floating_point:
                ok = torch.allclose(a.double().cpu(), b.double().cpu(), rtol=2e-2, atol=2e-2, equal_nan=True)
            else:
                ok = torch.equal(a.cpu(), b.cpu())
            if not ok:
                raise TilefuseError(f"TILEFUSE_VERIFY: output {k} of {name} differs from the reference interpreter")


def _boxed(fn):
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(fn)


def dynamo_backend(gm: torch.fx.GraphModule, example_inputs, **options):
    """The `torch.compile(backend="tilefuse")` entry point."""
    from torch._functorch.aot_autograd import aot_module_simplified

    return aot_module_simplified(
        gm, example_inputs,
        fw_compiler=functools.partial(_compile_graph, kind="forward", options=options),
        bw_compiler=functools.partial(_compile_graph, kind="backward", options=options),
        decompositions=_decompositions(),
    )


def compile(fn, *, dynamic=None, fullgraph=False, **options):
    """`torch.compile(fn, backend="tilefuse")` with tilefuse config knobs as keywords, e.g.
    `tilefuse.compile(model, backend="interpret")`."""
    for k in options:
        if not hasattr(config, k):
            raise TypeError(f"unknown tilefuse option {k!r}")
    backend = functools.partial(dynamo_backend, **options) if options else dynamo_backend
    return torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=fullgraph)


def explain(fn, *inputs, dynamic=None, **options):
    """Compile and run `fn(*inputs)`; return an `Explanation` of every graph compiled."""
    from .explanation import Explanation

    sink: list = []
    _report_sinks.append(sink)
    for k in options:
        if not hasattr(config, k):
            raise TypeError(f"unknown tilefuse option {k!r}")

    def backend(gm, example_inputs):  # a fresh backend object: Dynamo compiles anew for it
        return dynamo_backend(gm, example_inputs, **options)

    try:
        compiled = torch.compile(fn, backend=backend, dynamic=dynamic)
        t0 = time.perf_counter()
        compiled(*inputs)
        first_call = time.perf_counter() - t0
    finally:
        _report_sinks.remove(sink)
    return Explanation(sink, first_call)
