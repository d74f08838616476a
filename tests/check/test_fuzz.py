"""The differential fuzzer: a bounded number of random programs must all match eager under the
fp64 rule; an injected miscompile is detected, shrunk to a minimal program and written as a
standalone reproducer."""
import os
import random
import subprocess
import sys

import pytest
import torch

from tilefuse.backends.triton.launcher import TritonKernel
from tilefuse.check import fuzz
from tilefuse.check.program import InputSpec, Program, generate, prune
from tilefuse.check.shrink import runs_eagerly, shrink

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")
#: CI's bounded run; `tilefuse fuzz --cases N --seed S` runs more
CI_CASES, CI_SEED = 16, 7


def test_bounded_fuzz_run_matches_eager(tmp_path):
    report = fuzz.run_fuzz(CI_CASES, seed=CI_SEED, max_ops=5, out_dir=str(tmp_path), shrink_budget=25)
    print(report.summary())
    assert report.cases == CI_CASES
    details = [(f.case, f.outcome.status, f.outcome.detail, f.shrunk.function_source(), f.reproducer)
               for f in report.failures]
    assert not details, details
    assert report.counts["ok"] >= CI_CASES // 2  # the generator makes mostly valid programs


def test_generated_programs_are_valid_and_deterministic():
    for k in range(30):
        p = generate(random.Random(k))
        assert p == generate(random.Random(k))
        assert runs_eagerly(p), p.function_source()
        assert prune(p) == p  # every statement is live


def test_shrinker_removes_what_does_not_matter():
    p = Program((InputSpec("x0", (13, 17), "transposed"), InputSpec("x1", (17,))),
                ("v0 = torch.tanh(x0)", "v1 = v0 * x1", "v2 = v1.sum(-1, keepdim=True)", "v3 = torch.sigmoid(v2)",
                 "v4 = v3 + x0"),
                ("v4",), dtype="torch.bfloat16", dynamic=True)
    shrunk, calls = shrink(p, lambda c: any(".sum(" in line for line in c.lines), budget=200)
    assert shrunk.lines == ("v0 = x0.sum(-1, keepdim=True)",) or len(shrunk.lines) == 1, shrunk
    assert shrunk.inputs[0].shape == (1, 1) and shrunk.inputs[0].layout == "contiguous"
    assert shrunk.dtype == "torch.float32" and not shrunk.dynamic and calls <= 200


def _miscompile_reductions(monkeypatch):
    """Reduction kernels add 0.5 to what they write: a wrong result only the numbers show."""
    real = TritonKernel.__call__

    def wrong(self, buffers, env):
        real(self, buffers, env)
        if self.kernel.kind == "reduction":
            for name in self.kernel.writes:
                if buffers[name].is_floating_point():
                    buffers[name].add_(0.5)

    monkeypatch.setattr(TritonKernel, "__call__", wrong)


def test_injected_miscompile_is_found_shrunk_and_reproduced(monkeypatch, tmp_path):
    _miscompile_reductions(monkeypatch)
    p = Program((InputSpec("x0", (7, 33), "strided"), InputSpec("x1", (33,))),
                ("v0 = x0 * x1", "v1 = torch.sigmoid(v0)", "v2 = v1 + 1.0", "v3 = v2.amax(-1, keepdim=True)",
                 "v4 = v2 - v3"),
                ("v4",), dtype="torch.bfloat16", dynamic=True)
    outcome = fuzz.check_program(p)
    assert outcome.status == "mismatch", outcome
    shrunk, _ = shrink(p, lambda c: fuzz.check_program(c).status == "mismatch", budget=30)
    assert len(shrunk.lines) <= 2 and any("amax" in line for line in shrunk.lines), shrunk
    assert all(i.layout == "contiguous" for i in shrunk.inputs) and shrunk.dtype == "torch.float32"
    path = fuzz.write_reproducer(shrunk, fuzz.check_program(shrunk), str(tmp_path))
    source = open(path).read()
    namespace = {"__name__": "repro"}
    exec(compile(source, path, "exec"), namespace)
    with pytest.raises(SystemExit, match="MISMATCH"):
        namespace["main"]()
    # standalone, without the injected bug: the reproducer passes
    env = dict(os.environ, TILEFUSE_TARGET="interpret",
               PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_fuzz_driver_counts_and_shrinks_failures(monkeypatch, tmp_path):
    """`run_fuzz` with a checker that fails every program containing a reduction."""
    def checker(p):
        bad = any(k in line for line in p.lines for k in (".sum(", ".mean(", ".amax(", ".amin(", ".var("))
        return fuzz.Outcome("mismatch", "fake") if bad else fuzz.Outcome("ok")

    report = fuzz.run_fuzz(12, seed=3, out_dir=str(tmp_path), checker=checker)
    assert report.counts["mismatch"] == len(report.failures) > 0
    for f in report.failures:
        assert len(f.shrunk.lines) == 1 and os.path.exists(f.reproducer)


def test_threaded_fuzz_run_matches_eager():
    """Each case compiled once and called from 4 threads at once, every result judged."""
    report = fuzz.run_fuzz(3, seed=CI_SEED, max_ops=4, shrink_failures=False, threads=4)
    assert report.cases == 3 and not report.failures, [(f.case, f.outcome) for f in report.failures]
    assert report.counts["ok"] >= 1


def test_threaded_mode_finds_launches_that_share_state(monkeypatch):
    """Launches that keep their buffers where every call reaches them (as the C++ launcher's
    one pointer array per kernel did): a thread computes into another thread's output."""
    import time

    from tilefuse.backends.cpu.launcher import CppKernel
    from tilefuse.check.fuzz_threads import check_program_threaded

    shared = {}
    for cls in (CppKernel, TritonKernel):
        def racy(self, buffers, env, real=cls.__call__):
            shared[id(self)] = buffers
            time.sleep(0.002)  # the other threads store theirs meanwhile
            real(self, shared[id(self)], env)

        monkeypatch.setattr(cls, "__call__", racy)
    p = Program((InputSpec("x0", (8, 16)), InputSpec("x1", (16,))), ("v0 = torch.tanh(x0) * x1",), ("v0",))
    assert fuzz.check_program(p).status == "ok"  # one thread: right
    outcome = check_program_threaded(p, threads=4, calls=3)
    assert outcome.status == "mismatch" and "thread" in outcome.detail, outcome


def test_outputs_in_other_strides_than_eager_are_mismatches():
    from tilefuse.check.fuzz import layout_mismatch

    x = torch.randn(4, 6)
    assert layout_mismatch((x.t(),), (x.t(),)) is None
    message = layout_mismatch((x.t().contiguous(),), (x.t(),))
    assert message is not None and "output 0" in message and "(1, 6)" in message
    assert layout_mismatch(torch.randn(1, 5), torch.randn(5, 1).t()) is None  # a size-1 dim's stride is free
    assert layout_mismatch((x.t(), 3), (x.t(), 3)) is None
