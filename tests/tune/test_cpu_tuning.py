"""The tuner is backend-neutral: on the CPU backend it measures C++ candidates (host-timed) at
TILEFUSE_AUTOTUNE=max, stores the winner, and a second compile takes it from the cache without
measuring; at the default level the CPU keeps its rules (no C++ compile per candidate)."""
import pytest
import torch

import tilefuse
from tilefuse.backends import cpu
from tilefuse.tune import tuner

pytestmark = pytest.mark.skipif(cpu.find_compiler() is None, reason="no C++ compiler")


def _rmsnorm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _notes(report):
    return [n for k in report.kernels for n in k.notes if "schedule" in n]


def test_cpu_kernels_are_measured_at_max_and_cached(monkeypatch, tmp_path):
    monkeypatch.setitem(tuner.CPU_LEVELS, "max", (3, 1.5))  # a short search for the test
    x, w = torch.randn(67, 1000), torch.randn(1000)
    with tilefuse.config.patch(cache_dir=str(tmp_path), backend="cpu"):
        torch._dynamo.reset()
        rep = tilefuse.explain(_rmsnorm, x, w, autotune="max")
        assert any("measured" in n for n in _notes(rep)), _notes(rep)
        assert rep.kernels[0].tune_seconds > 0
        torch._dynamo.reset()
        again = tilefuse.explain(_rmsnorm, x, w, autotune="max")
        assert any("cache hit" in n for n in _notes(again)), _notes(again)
        torch._dynamo.reset()
        out = tilefuse.compile(_rmsnorm, autotune="max")(x, w)
    ref = _rmsnorm(x.double(), w.double())
    assert (out.double() - ref).abs().max() <= 3 * (_rmsnorm(x, w).double() - ref).abs().max() + 1e-6


def test_default_level_keeps_the_cpu_rules(tmp_path):
    x, w = torch.randn(67, 1000), torch.randn(1000)
    with tilefuse.config.patch(cache_dir=str(tmp_path), backend="cpu"):
        torch._dynamo.reset()
        rep = tilefuse.explain(_rmsnorm, x, w, autotune="1")
    assert not any("measured" in n for n in _notes(rep))
    assert rep.kernels[0].tune_seconds < 1.0
