"""The tuner is backend-neutral: on the CPU backend it measures C++ candidates (host-timed) at
TILEFUSE_AUTOTUNE=max, stores the winner, and a second compile takes it from the cache without
measuring; at the default level the CPU keeps its rules (no C++ compile per candidate)."""
import pytest
import torch

import tilefuse
from tilefuse.backends import cpu
from tilefuse.compile_profile import TUNE_PHASES, report_text
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
        rep = tilefuse.explain(_rmsnorm, x, w, options={"autotune": "max"})
        assert any("measured" in n for n in _notes(rep)), _notes(rep)
        assert rep.kernels[0].tune_seconds > 0
        # the tune stage's time by phase, in the compile-time report
        report = tilefuse.last_compilations().reports[-1]
        phases = report.tune_phases
        assert set(phases) <= set(TUNE_PHASES) and phases.get("build", 0) > 0 and phases.get("measure", 0) > 0
        assert sum(phases.values()) <= report.stage_seconds["tune"] + 1e-3
        # a plan's own tuning time counts its start once, inside the stage's
        assert rep.kernels[0].tune_seconds <= report.stage_seconds["tune"] + 1e-3
        assert "  tune: rank " in report_text(report)
        torch._dynamo.reset()
        again = tilefuse.explain(_rmsnorm, x, w, options={"autotune": "max"})
        assert any("cache hit" in n for n in _notes(again)), _notes(again)
        torch._dynamo.reset()
        out = tilefuse.compile(_rmsnorm, options={"autotune": "max"})(x, w)
    ref = _rmsnorm(x.double(), w.double())
    assert (out.double() - ref).abs().max() <= 3 * (_rmsnorm(x, w).double() - ref).abs().max() + 1e-6


def test_default_level_keeps_the_cpu_rules(tmp_path):
    x, w = torch.randn(67, 1000), torch.randn(1000)
    with tilefuse.config.patch(cache_dir=str(tmp_path), backend="cpu"):
        torch._dynamo.reset()
        rep = tilefuse.explain(_rmsnorm, x, w, options={"autotune": "1"})
    assert not any("measured" in n for n in _notes(rep))
    assert rep.kernels[0].tune_seconds < 1.0


def _shifted_norm(z, y, v):
    """An RMSNorm whose kernel reads other buffers under other names than `_rmsnorm(x, w)`'s
    (as the norms of every layer of a model do), beside an unrelated kernel."""
    return z + 1, _rmsnorm(y, v)


def test_kernels_identical_but_for_names_share_one_tuning(monkeypatch, tmp_path):
    monkeypatch.setitem(tuner.CPU_LEVELS, "max", (3, 1.5))
    x, y, z = torch.randn(67, 1000), torch.randn(67, 1000), torch.randn(5, 11)
    w, v = torch.randn(1000), torch.randn(1000)
    with tilefuse.config.patch(cache_dir=str(tmp_path), backend="cpu"):
        torch._dynamo.reset()
        rep = tilefuse.explain(_rmsnorm, x, w, options={"autotune": "max"})
        assert any("measured" in n for n in _notes(rep)), _notes(rep)
        torch._dynamo.reset()
        both = tilefuse.explain(_shifted_norm, z, y, v, options={"autotune": "max"})
    notes = _notes(both)
    assert sum("cache hit" in n for n in notes) == 1 and sum("— measured" in n for n in notes) == 1, notes


def test_canonical_source_renames_only_kernel_and_buffer_names():
    from types import SimpleNamespace as NS

    from tilefuse.tune.tuner import canonical_source

    def kernel(name, bufs):
        return NS(name=name, params=[NS(name=b, kind="buffer") for b in bufs] + [NS(name="s0", kind="size")],
                  scratch={})

    src = "def {k}(ptr_{a}, ptr_{b}, s0, {a}_stride0):\n    x = tl.load(ptr_{a} + {a}_stride0 * s0) + {b} + buf121\n"
    one = canonical_source(src.format(k="kernel1", a="buf1", b="buf12"), [kernel("kernel1", ["buf1", "buf12"])])
    two = canonical_source(src.format(k="kernel7", a="arg3_1", b="buf20"), [kernel("kernel7", ["arg3_1", "buf20"])])
    assert one == two
    assert "s0" in one and "buf121" in one and "buf1" not in one.replace("buf121", "") and "kernel" not in one
    swapped = canonical_source(src.format(k="kernel1", a="buf12", b="buf1"), [kernel("kernel1", ["buf1", "buf12"])])
    assert swapped != one  # the same names in other roles are another kernel


def _flaky_builds(monkeypatch, fails):
    """Candidates' builds fail where `fails(k)` holds (k: the k-th build asked for)."""
    real = tuner._Bench._kernels
    calls = []

    def build(self, schedule):
        if schedule not in self.built:  # (the bench keys its builds by the schedule)
            calls.append(schedule)
            if fails(len(calls)):
                raise RuntimeError("planted build failure")
        return real(self, schedule)

    monkeypatch.setattr(tuner._Bench, "_kernels", build)
    return calls


def test_a_candidate_that_fails_to_build_is_dropped(monkeypatch, tmp_path):
    monkeypatch.setitem(tuner.CPU_LEVELS, "max", (3, 1.5))
    calls = _flaky_builds(monkeypatch, lambda k: k == 2)
    x, w = torch.randn(37, 300), torch.randn(300)
    with tilefuse.config.patch(cache_dir=str(tmp_path), backend="cpu"):
        torch._dynamo.reset()
        rep = tilefuse.explain(_rmsnorm, x, w, options={"autotune": "max"})
        out = tilefuse.compile(_rmsnorm, options={"autotune": "max"})(x, w)
    notes = " ".join(_notes(rep))
    assert len(calls) >= 3 and "measured" in notes and "planted build failure" in notes, notes
    torch.testing.assert_close(out, _rmsnorm(x, w), rtol=1e-5, atol=1e-5)


def test_no_candidate_that_builds_leaves_the_model_choosing(monkeypatch, tmp_path):
    monkeypatch.setitem(tuner.CPU_LEVELS, "max", (3, 1.5))
    _flaky_builds(monkeypatch, lambda k: True)
    x, w = torch.randn(37, 300), torch.randn(300)
    with tilefuse.config.patch(cache_dir=str(tmp_path), backend="cpu"):
        torch._dynamo.reset()
        rep = tilefuse.explain(_rmsnorm, x, w, options={"autotune": "max"})
    notes = " ".join(_notes(rep))
    assert "cost model" in notes and "failed to compile or run" in notes, notes


def test_building_stops_at_its_budget(monkeypatch, tmp_path):
    """Built one after another (no compile workers), only the best-ranked candidates that fit the
    build budget are measured."""
    monkeypatch.setitem(tuner.CPU_LEVELS, "max", (3, 1.5))
    monkeypatch.setitem(tuner.BUILD_S, "max", 0.0)
    calls = _flaky_builds(monkeypatch, lambda k: False)
    x, w = torch.randn(37, 300), torch.randn(300)
    with tilefuse.config.patch(cache_dir=str(tmp_path), backend="cpu"):
        torch._dynamo.reset()
        rep = tilefuse.explain(_rmsnorm, x, w, options={"autotune": "max"})
    assert len(calls) == 1 and any("measured" in n for n in _notes(rep)), (calls, _notes(rep))
