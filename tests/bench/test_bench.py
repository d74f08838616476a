"""Tests of the unified benchmark (tilefuse.bench) on CPU with the quick sizes.

Timings are never asserted (only that they exist and are positive). Inductor runs on one
workload to keep the file fast; tilefuse, built concurrently, is only checked to be
reported, with results or as n/a with a reason.
"""
from __future__ import annotations

import dataclasses
import io
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

try:
    import tilefuse.bench  # noqa: F401
except ImportError:  # running from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from tilefuse.bench import main  # noqa: E402
from tilefuse.bench.report import render_table, to_markdown  # noqa: E402
from tilefuse.bench.runner import BenchOptions, max_abs_error, run  # noqa: E402
from tilefuse.bench.timing import measure  # noqa: E402
from tilefuse.bench.workloads import WORKLOADS, get_workloads  # noqa: E402

FAST = dict(device="cpu", sizes="quick", dtype="float32", budget_s=0.02, quiet=True)


def _run(backends, workloads=None, compilers=None):
    return run(BenchOptions(workloads=workloads, backends=backends, **FAST), compilers=compilers)


def _row(report, workload, backend):
    rows = [r for r in report["results"] if r["workload"] == workload and r["backend"] == backend]
    assert len(rows) == 1, (workload, backend, report["results"])
    return rows[0]


def _assert_sane(r):
    assert r["status"] == "ok", r["reason"]
    assert r["compile_s"] is not None and r["compile_s"] >= 0
    assert r["p50_ms"] > 0 and r["p99_ms"] >= r["p50_ms"] and r["samples"] >= 1
    assert r["throughput"] > 0 and r["throughput_unit"] in ("GB/s", "TFLOP/s")
    assert r["gbps"] > 0 and r["tflops"] > 0
    assert math.isfinite(r["max_abs_err"]) and math.isfinite(r["eager_max_abs_err"])
    assert r["eager_max_abs_err"] < 1e-4  # float32 eager vs the fp64 reference
    assert r["correct"] is True


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    code = main(["--device", "cpu", "--sizes", "quick", "--backends", "eager,no_such_backend",
                 "--out", str(out), "--budget", "0.02", "--quiet"])
    return code, out


def test_cli_writes_results_and_report(cli_run):
    code, out = cli_run
    assert code == 0  # an n/a backend does not fail the run
    report = json.loads((out / "results.json").read_text())
    assert report["meta"]["device"] == "cpu" and report["meta"]["dtype"] == "float32"
    assert {r["workload"] for r in report["results"]} == set(WORKLOADS)
    for name in WORKLOADS:
        _assert_sane(_row(report, name, "eager"))
    md = (out / "report.md").read_text()
    assert report["meta"]["device_name"] in md and torch.__version__ in md
    assert "| workload | backend |" in md and "rmsnorm" in md


def test_unknown_backend_is_na_with_reason(cli_run):
    _, out = cli_run
    report = json.loads((out / "results.json").read_text())
    for name in WORKLOADS:
        r = _row(report, name, "no_such_backend")
        assert r["status"] == "n/a" and "no_such_backend" in r["reason"]
        assert r["p50_ms"] is None
    assert "n/a [1]" in (out / "report.md").read_text()


def test_failing_backend_is_na_not_a_crash():
    def broken(fn):
        def call(*args):
            raise RuntimeError("boom")
        return call

    report = _run(["eager", "broken"], ["softmax"], compilers={"broken": broken})
    _assert_sane(_row(report, "softmax", "eager"))
    r = _row(report, "softmax", "broken")
    assert r["status"] == "n/a" and "first call" in r["reason"] and "boom" in r["reason"]


def test_fp64_reference_catches_a_wrong_function():
    compilers = {
        "scaled": lambda fn: (lambda *a: fn(*a) * 1.001),
        "one_off": lambda fn: (lambda *a: fn(*a).index_put_((torch.tensor([3]),), torch.tensor(0.5),
                                                            accumulate=True)),
        "identity": lambda fn: fn,
    }
    report = _run(["eager", *compilers], ["rmsnorm", "gelu_linear"], compilers=compilers)
    for w in ("rmsnorm", "gelu_linear"):
        for bad in ("scaled", "one_off"):
            r = _row(report, w, bad)
            assert r["status"] == "ok" and r["correct"] is False
            assert r["max_abs_err"] > 100 * r["eager_max_abs_err"]
        assert _row(report, w, "identity")["correct"] is True
    table = io.StringIO()
    from rich.console import Console
    Console(file=table, width=200).print(render_table(report))
    assert "MISMATCH" in table.getvalue() and "MISMATCH" in to_markdown(report)


def test_max_abs_error_structure_mismatch_is_inf():
    ref = torch.zeros(4, 3, dtype=torch.float64)
    assert max_abs_error(torch.zeros(3, 4), ref) == math.inf
    assert max_abs_error(torch.ones(4, 3), ref) == 1.0


@pytest.mark.slow  # ~5 s with warm Inductor caches, up to ~50 s on a fresh machine
@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="no C++ compiler")
def test_inductor_one_workload():
    with torch._inductor.config.patch(compile_threads=1):  # no worker pool for one kernel
        report = _run(["eager", "inductor"], ["softmax"])
    for b in ("eager", "inductor"):
        _assert_sane(_row(report, "softmax", b))


def test_tilefuse_is_reported_with_results_or_reason():
    tiny = dataclasses.replace(WORKLOADS["softmax"], sizes={"quick": (4, 64), "full": (4, 64)})
    report = run(BenchOptions(backends=["eager", "tilefuse"], **FAST), workloads=[tiny])
    r = _row(report, "softmax", "tilefuse")
    if r["status"] == "ok":
        assert r["p50_ms"] > 0 and r["max_abs_err"] is not None
    else:
        assert r["status"] == "n/a" and r["reason"].strip()


def test_workloads_inputs_and_work_counts():
    dev = torch.device("cpu")
    for w in get_workloads():
        a = w.make_inputs(w.sizes["quick"], dev, torch.float32)
        b = w.make_inputs(w.sizes["quick"], dev, torch.float32)
        assert all(t.dtype == torch.float32 for t in a)
        assert not torch.equal(a[0], b[0])  # fresh random values each call
        assert w.flops(a) > 0 and w.bytes(a) > 0 and set(w.sizes) == {"quick", "full"}
        out = w.fn(*a)
        assert (out if isinstance(out, torch.Tensor) else out[0]).shape[0] == a[0].shape[0]
    q, k, cos, sin = WORKLOADS["rope"].make_inputs((1, 2, 6, 8), dev, torch.float32)
    assert WORKLOADS["rope"].bytes((q, k, cos, sin)) == (4 * 96 + 2 * 48) * 4
    rq, rk = WORKLOADS["rope"].fn(q, k, cos, sin)
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1), atol=1e-5)  # a rotation keeps lengths
    m, k, n = WORKLOADS["gelu_linear"].sizes["quick"]
    inp = WORKLOADS["gelu_linear"].make_inputs((m, k, n), dev, torch.float32)
    assert WORKLOADS["gelu_linear"].flops(inp) == 2 * m * n * k
    m, d, h = WORKLOADS["mlp"].sizes["quick"]
    inp = WORKLOADS["mlp"].make_inputs((m, d, h), dev, torch.float32)
    assert WORKLOADS["mlp"].flops(inp) == 2 * (2 * m * d * h)
    x, wt = WORKLOADS["rmsnorm"].make_inputs((8, 16), dev, torch.float32)
    assert WORKLOADS["rmsnorm"].bytes((x, wt)) == (2 * 8 * 16 + 16) * 4
    with pytest.raises(KeyError):
        get_workloads(["nope"])


def test_measure_cpu():
    x = torch.randn(64, 64)
    t = measure(torch.softmax, (x, -1), "cpu", budget_s=0.01, min_samples=3)
    assert t["p50_ms"] > 0 and t["p99_ms"] >= t["p50_ms"] and t["samples"] >= 3


def test_cli_rejects_bad_arguments():
    with pytest.raises(SystemExit) as e:
        main(["--workloads", "nope", "--device", "cpu"])
    assert e.value.code == 2
