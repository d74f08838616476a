"""Safe failure: a failure injected at each stage of the compiler either raises a TilefuseError
naming the stage, the op and a reproducer (TILEFUSE_FALLBACK=error) or runs the graph eagerly
with a warning (eager); the program never sees an internal traceback."""
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

import tilefuse
from tilefuse.api import TilefuseError, TilefuseFallbackWarning

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


def _tilefuse_error(err: BaseException) -> TilefuseError:
    """The TilefuseError itself (Dynamo wraps compile-time errors in BackendCompilerFailed,
    whose message repeats ours)."""
    seen = err
    while seen is not None and not isinstance(seen, TilefuseError):
        seen = getattr(seen, "inner_exception", None) or seen.__cause__
    assert seen is not None, f"no TilefuseError in {err!r}"
    return seen


def _boom(*args, **kwargs):
    raise ValueError("injected failure")


def _inject_frontend(mp):
    mp.setattr("tilefuse.frontend.to_ir.find_lowering", lambda target: _boom)


def _inject_passes(mp):
    import tilefuse.passes as passes

    mp.setattr(passes, "PIPELINE", (("boom", _boom),))


def _inject_fusion(mp):
    mp.setattr("tilefuse.fusion.planner.Planner.new_kernel", _boom)


def _inject_tile(mp):
    mp.setattr("tilefuse.tile.pointwise.lower_pointwise", _boom)
    mp.setattr("tilefuse.tile.contraction.lower_contraction", _boom)


def _inject_codegen(mp):
    mp.setattr("tilefuse.backends.triton.codegen.TritonPrinter.stmts", _boom)


def _inject_load(mp):
    mp.setattr("tilefuse.backends.triton.launcher._import_source", _boom)


def _inject_launch(mp):
    mp.setattr("tilefuse.backends.triton.launcher.TritonKernel.__call__", _boom)


#: the one kernel of `fn`
KERNEL = r"forward_[0-9a-f]{6}_pw_mul_add_sin_0"

#: stage -> (injection, the stage named, a pattern for the op named)
STAGES = {
    "frontend": (_inject_frontend, "lowering to graph IR", re.escape("ATen op aten.mul.Tensor")),
    "passes": (_inject_passes, "graph passes", None),
    "fusion": (_inject_fusion, "fusion planning", None),
    "tile": (_inject_tile, "tile lowering", f"kernel {KERNEL}"),
    "codegen": (_inject_codegen, "Triton code generation", KERNEL),
    "load": (_inject_load, "loading or launching a Triton kernel", KERNEL),
    "launch": (_inject_launch, "running the compiled graph", f"kernel {KERNEL}"),
}


def fn(x, y):
    return (x * 2 + y).sin()


def _args():
    return torch.randn(6, 5), torch.randn(5)


@pytest.mark.parametrize("stage", list(STAGES))
def test_error_mode_names_stage_op_and_reproducer(stage, monkeypatch, tmp_path):
    inject, stage_name, op = STAGES[stage]
    monkeypatch.setattr(tilefuse.config, "cache_dir", str(tmp_path))
    inject(monkeypatch)
    torch._dynamo.reset()
    with tilefuse.config.patch(fallback="error"), pytest.raises(Exception) as info:
        torch.compile(fn, backend="tilefuse")(*_args())
    msg = str(_tilefuse_error(info.value))
    assert f"stage: {stage_name}" in msg, msg
    assert "ValueError: injected failure" in msg
    if op:
        assert re.search(op, msg), msg
    repro = re.search(r"reproducer: python (\S+)", msg)
    assert repro and os.path.exists(repro.group(1)), msg
    # the reproducer replays the same failure (the injection is still in place)
    source = open(repro.group(1)).read()
    namespace = {"__name__": "repro"}
    exec(compile(source, repro.group(1), "exec"), namespace)
    torch._dynamo.reset()
    with pytest.raises(Exception) as again:
        namespace["main"]()
    assert "injected failure" in str(_tilefuse_error(again.value))


@pytest.mark.parametrize("stage", list(STAGES))
def test_eager_mode_warns_and_runs_the_graph_eagerly(stage, monkeypatch, tmp_path):
    inject, stage_name, _ = STAGES[stage]
    monkeypatch.setattr(tilefuse.config, "cache_dir", str(tmp_path))
    inject(monkeypatch)
    torch._dynamo.reset()
    x, y = _args()
    with tilefuse.config.patch(fallback="eager"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(fn, backend="tilefuse")
        out = compiled(x, y)
        out2 = compiled(x, y)  # later calls run eagerly too, without a second warning
    torch.testing.assert_close(out, fn(x, y))
    torch.testing.assert_close(out2, fn(x, y))
    fallbacks = [w for w in caught if issubclass(w.category, TilefuseFallbackWarning)]
    assert len(fallbacks) == 1 and stage_name in str(fallbacks[0].message)


def test_program_errors_are_not_reported_as_tilefuse_failures():
    """An error that eager raises too (multinomial sampling from negative weights, an extern)
    is the program's own: it propagates unchanged, with no fallback warning."""
    def sample(p):
        return torch.multinomial(p * 2, 1) + 1

    torch._dynamo.reset()
    compiled = torch.compile(sample, backend="tilefuse")
    assert compiled(torch.rand(3, 4)).shape == (3, 1)
    with warnings.catch_warnings(record=True) as caught, tilefuse.config.patch(fallback="eager"):
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="probability tensor") as info:
            compiled(-torch.ones(3, 4))
    assert not isinstance(info.value, TilefuseError)
    assert not [w for w in caught if issubclass(w.category, TilefuseFallbackWarning)]


def test_reproducer_is_a_standalone_script(monkeypatch, tmp_path):
    """The reproducer of a failed graph runs in a fresh process (there, without the injected
    failure, it compiles and runs)."""
    monkeypatch.setattr(tilefuse.config, "cache_dir", str(tmp_path))
    _inject_fusion(monkeypatch)
    torch._dynamo.reset()
    def f(x, w):
        return torch.softmax(x @ w, -1).sum(0)
    with tilefuse.config.patch(fallback="error"), pytest.raises(Exception) as info:
        torch.compile(f, backend="tilefuse", dynamic=True)(torch.randn(7, 5), torch.randn(5, 3))
    path = re.search(r"reproducer: python (\S+)", str(_tilefuse_error(info.value))).group(1)
    env = dict(os.environ, TRITON_INTERPRET="1", TILEFUSE_CACHE_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "compiled and ran" in out.stdout


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")
def test_inputs_of_another_layout_run_eagerly_with_the_reason():
    """Kernels read strided memory: a graph given mkldnn tensors runs as written (eager gives
    the right values for this program) and says why once; with fallback "error" it raises."""
    def program(x):
        return x.to_dense() * 2, torch.relu(x).to_dense()

    x = torch.randn(5, 7).to_mkldnn()
    torch._dynamo.reset()
    with tilefuse.config.patch(fallback="eager"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(program, backend="tilefuse")
        outs = [compiled(x) for _ in range(2)]
    for out in outs:
        for got, want in zip(out, program(x)):
            assert torch.equal(got, want)
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, TilefuseFallbackWarning)]
    assert len(fallbacks) == 1 and "torch._mkldnn" in fallbacks[0]
    torch._dynamo.reset()
    with tilefuse.config.patch(fallback="error"), pytest.raises(Exception) as info:
        torch.compile(program, backend="tilefuse")(x)
    assert "strided tensors only" in str(_tilefuse_error(info.value))
