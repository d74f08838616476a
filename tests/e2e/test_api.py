"""The user-facing contract: logs, safe failure, tilefuse.compile options, externs reported."""
import os
import subprocess
import sys
import warnings

import pytest
import torch

import tilefuse
from tilefuse.api import TilefuseFallbackWarning

DEVICE = os.environ.get("TILEFUSE_TEST_DEVICE", "cpu")
cpu_only = pytest.mark.skipif(DEVICE != "cpu", reason="atan2 only lacks a spelling in the Triton interpreter")
# (the C++ backend, the CPU default, spells atan2: these tests ask for the interpreter)


@cpu_only
def test_unsupported_function_falls_back_to_eager_with_a_warning():
    fn = lambda x: torch.atan2(x, x + 2) * 2  # no Triton-interpreter spelling of atan2
    x = torch.randn(8)
    with tilefuse.config.patch(fallback="eager", target="interpret"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch._dynamo.reset()
        out = torch.compile(fn, backend="tilefuse")(x)
    torch.testing.assert_close(out, fn(x))
    assert any(issubclass(w.category, TilefuseFallbackWarning) for w in caught)


@cpu_only
def test_fallback_error_raises_naming_the_stage():
    fn = lambda x: torch.atan2(x, x + 2) * 2
    with tilefuse.config.patch(fallback="error", target="interpret"):
        torch._dynamo.reset()
        with pytest.raises(Exception, match="tilefuse failed while"):
            torch.compile(fn, backend="tilefuse")(torch.randn(8))


def test_tilefuse_compile_accepts_config_keywords_and_rejects_unknown():
    fn = lambda x: x.sin() + 1
    x = torch.randn(5, device=DEVICE)
    torch.testing.assert_close(tilefuse.compile(fn, persistent_reduction_limit=64)(x), fn(x))
    with pytest.raises(TypeError, match="has no option .no_such_knob."):
        tilefuse.compile(fn, no_such_knob=1)


def test_ops_without_lowering_become_reported_externs():
    fn = lambda x: torch.sort(x, dim=-1).values * 2
    x = torch.randn(4, 9, device=DEVICE)
    report = tilefuse.explain(fn, x)
    assert report.externs and "sort" in report.externs[0][1]
    torch.testing.assert_close(torch.compile(fn, backend="tilefuse")(x), fn(x))


def test_logs_channels_print_each_stage():
    script = "import torch, tilefuse; torch.compile(lambda x: (x * 2).sum(-1), backend='tilefuse')(torch.randn(3, 5))"
    env = dict(os.environ, TILEFUSE_LOGS="graph,fusion,tile,code", TRITON_INTERPRET="1",
               PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "..", "src"))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    for channel in ("[tilefuse.graph]", "[tilefuse.fusion]", "[tilefuse.tile]", "[tilefuse.code]"):
        assert channel in out.stderr


def test_installed_entry_point_registers_the_backend_without_import():
    from importlib.metadata import entry_points

    if not any(ep.name == "tilefuse" for ep in entry_points(group="torch_dynamo_backends")):
        pytest.skip("tilefuse is not installed as a distribution (pip install -e . registers it)")
    script = ("import torch; f = torch.compile(lambda x: x.exp() + 1, backend='tilefuse'); "
              "x = torch.randn(6); assert torch.allclose(f(x), x.exp() + 1); print('ok')")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
