"""Tests of the unified benchmark (tilefuse.bench) on CPU with quick or tiny sizes.

Timings are never asserted (only that they exist and are positive). Inductor runs on one
workload to keep the file fast; every workload runs through eager and a Dynamo-traced
backend at tiny sizes (all metrics present), tilefuse on a few; the cold/warm compile
measurement runs tilefuse in two fresh processes.
"""
from __future__ import annotations

import dataclasses
import importlib.util
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

FAST = dict(device="cpu", sizes="quick", dtype="float32", budget_s=0.02, quiet=True,
            ceilings={"copy_gbps": 10.0, "matmul_tflops": 0.1, "how": "fixed for tests"})

#: tiny sizes of every workload, for tests that run many backends
TINY = {"rmsnorm": (8, 32), "layernorm": (8, 32), "softmax": (8, 32), "gelu_mul": (8, 32),
        "rope": (1, 2, 8, 16), "gemm": (16, 32, 16), "gelu_linear": (16, 32, 16),
        "linear_silu_res": (16, 32, 16), "mlp": (8, 16, 32), "attention": (1, 2, 16, 16),
        "attention_causal": (1, 2, 16, 16), "attention_softcap": (1, 2, 16, 16),
        "decode": (1, 2, 64, 16), "rope_kv_cache": (1, 2, 4, 16, 32), "moe": (4, 16, 32, 4),
        "int8_gemm": (4, 32, 16), "fp8_gemm": (16, 32, 16), "llama_block": (1, 8, 32, 2, 64)}


#: the kernel workloads (the models group has its own tests: test_zoo.py)
KERNELS = [w.name for w in get_workloads() if w.group == "kernels"]


def _tiny(names=None):
    return [dataclasses.replace(w, sizes={"quick": TINY[w.name], "full": TINY[w.name]})
            for w in get_workloads(names or KERNELS)]


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


CLI_WORKLOADS = ["rmsnorm", "gelu_linear", "rope_kv_cache", "fp8_gemm"]
UNAVAILABLE = "inductor-reduce-overhead"  # a known backend, n/a on a CPU (it replays CUDA graphs)


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    code = main(["--device", "cpu", "--sizes", "quick", "--backends", f"eager,{UNAVAILABLE}",
                 "--workloads", ",".join(CLI_WORKLOADS), "--no-memory", "--no-sweep",
                 "--out", str(out), "--budget", "0.02", "--quiet"])
    return code, out


def test_cli_writes_results_and_report(cli_run):
    code, out = cli_run
    assert code == 0  # an n/a backend does not fail the run
    report = json.loads((out / "results.json").read_text())
    assert report["meta"]["device"] == "cpu" and report["meta"]["dtype"] == "float32"
    assert [r["workload"] for r in report["results"]][::2] == CLI_WORKLOADS
    for name in CLI_WORKLOADS:
        if name == "fp8_gemm":  # needs a CUDA GPU: n/a for every backend, with the reason
            r = _row(report, name, "eager")
            assert r["status"] == "n/a" and r["scope"] == "workload" and "CUDA" in r["reason"]
            continue
        _assert_sane(_row(report, name, "eager"))
    md = (out / "report.md").read_text()
    assert report["meta"]["device_name"] in md and torch.__version__ in md
    assert "| workload | backend |" in md and "rmsnorm" in md


def test_unavailable_backend_is_na_with_reason(cli_run):
    _, out = cli_run
    report = json.loads((out / "results.json").read_text())
    for name in set(CLI_WORKLOADS) - {"fp8_gemm"}:
        r = _row(report, name, UNAVAILABLE)
        assert r["status"] == "n/a" and "GPU only" in r["reason"]
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
    for w in get_workloads(KERNELS):
        if w.unsupported(dev):
            assert w.name == "fp8_gemm"
            continue
        a = w.make_inputs(w.sizes["quick"], dev, torch.float32)
        b = w.make_inputs(w.sizes["quick"], dev, torch.float32)
        assert all(t.dtype == torch.float32 for t in a if t.is_floating_point())
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
    from tilefuse.bench.timing import host_time

    assert host_time(torch.softmax, (x, -1), "cpu") is None  # on a CPU a call's time is all host


def test_host_time_column_only_where_measured():
    from tilefuse.bench.report import table_rows

    report = _run(["eager", "scaled"], ["softmax"], compilers={"scaled": lambda fn: fn})
    columns, _, _ = table_rows(report)
    assert "host ms" not in columns  # CPU runs: no host time
    report["results"][1]["host_ms"] = 0.0421
    columns, rows, _ = table_rows(report)
    assert rows[1][columns.index("host ms")] == "0.0421" and rows[0][columns.index("host ms")] == ""


@pytest.mark.parametrize("argv, named", [
    (["--workloads", "nope"], "'nope'"),
    (["--workloads", "softmx"], "did you mean 'softmax'"),
    (["--workloads", ","], "no workloads given"),
    (["--backends", "eager,banana"], "'banana'"),
    (["--backends", "indcutor"], "did you mean 'inductor'"),
    (["--budget", "-1"], "'-1'"),
    (["--dtype", "float64"], "'float64'"),
    (["--merge", "a.json", "--backends", "eager"], "--backends"),
], ids=["workload", "workload-typo", "no-workload", "backend", "backend-typo", "budget", "dtype", "merge"])
def test_cli_rejects_bad_arguments(argv, named, capsys):
    """Exit 2 naming the bad value, before anything is measured."""
    with pytest.raises(SystemExit) as e:
        main(argv + ["--device", "cpu"] if "--merge" not in argv else argv)
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def test_backends_of_run_checked_with_those_it_adds():
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        BenchOptions(backends=["eager", "nope"], **FAST).resolved()
    assert BenchOptions(backends=["nope"], **FAST).resolved(extra_backends={"nope": None}).backends == ["nope"]


def _dynamo(fn):  # a compiling backend without code generation: Dynamo + AOT, eager kernels
    return torch.compile(fn, backend="aot_eager")


SWEPT = ["softmax", "attention_causal", "llama_block"]


@pytest.mark.parametrize("sweep", [False, True], ids=["all-workloads", "dynamic-sweep"])
def test_every_workload_has_every_metric_at_tiny_sizes(sweep):
    names = SWEPT if sweep else None
    report = run(BenchOptions(backends=["eager", "dynamo"], sweep=sweep, **FAST),
                 workloads=_tiny(names), compilers={"dynamo": _dynamo})
    for w in get_workloads(names or KERNELS):
        if w.name == "fp8_gemm":
            continue
        e, d = _row(report, w.name, "eager"), _row(report, w.name, "dynamo")
        for r in (e, d):
            _assert_sane(r)
            assert r["peak_mem_bytes"] is not None and r["peak_mem_bytes"] >= 0
            assert r["roofline"] is not None and r["roofline"] > 0
        assert e["na"]["recompiles"] and e["compiles"] is None and e["kernels"] is None
        assert d["compiles"] >= 1 and d["aten_ops"] > 0
        assert d["na"]["cold_compile_s"] and d["na"]["kernels"]  # reasons, not silence
        if sweep:
            assert d["dynamic_sizes"] == len(w.sweep_sizes(TINY[w.name])) - 1 > 0
            assert 0 <= d["dynamic_served"] <= d["dynamic_sizes"] and d["recompiles"] >= 0
            assert d["dynamic_served"] >= 1  # automatic dynamic shapes: one recompile at most
        else:
            assert d["recompiles"] is None and d["na"]["recompiles"]
    assert report["meta"]["ceilings"]["copy_gbps"] == 10.0


def test_work_counts_follow_the_formulas():
    dev = torch.device("cpu")
    q, k, v = WORKLOADS["attention"].make_inputs((1, 2, 8, 4), dev, torch.float32)
    assert WORKLOADS["attention"].flops((q, k, v)) == 4 * 2 * 8 * 8 * 4
    assert WORKLOADS["attention_causal"].flops((q, k, v)) == 4 * 2 * 4 * (8 * 9 // 2)
    assert WORKLOADS["attention"].bytes((q, k, v)) == 4 * 4 * 2 * 8 * 4
    dq, dk, dv = WORKLOADS["decode"].make_inputs((2, 2, 32, 4), dev, torch.float32)
    assert WORKLOADS["decode"].flops((dq, dk, dv)) == 4 * 2 * 2 * 32 * 4
    assert WORKLOADS["decode"].bytes((dq, dk, dv)) == 4 * 2 * 2 * (2 * 32 * 4 + 2 * 4)
    x, w, s = WORKLOADS["int8_gemm"].make_inputs((4, 32, 16), dev, torch.float32)
    assert WORKLOADS["int8_gemm"].bytes((x, w, s)) == 4 * 4 * 32 + 16 * 32 + 4 * 16 + 4 * 4 * 16
    inp = WORKLOADS["rope_kv_cache"].make_inputs((1, 2, 4, 8, 32), dev, torch.float32)
    assert WORKLOADS["rope_kv_cache"].bytes(inp) == 4 * (6 * 2 * 4 * 8 + 2 * 4 * 8) + 8 * 4
    q2, kc, vc = WORKLOADS["rope_kv_cache"].fn(*inp)
    assert torch.equal(kc[:, :, 16:20], WORKLOADS["rope"].fn(inp[0], inp[1], inp[3][16:20],
                                                             inp[4][16:20])[1])  # written in place
    assert kc[:, :, :16].abs().sum() == 0 and torch.equal(vc[:, :, 16:20], inp[2])
    t, d, f, e = 4, 16, 32, 4
    moe_in = WORKLOADS["moe"].make_inputs((t, d, f, e), dev, torch.float32)
    assert WORKLOADS["moe"].flops(moe_in) == 2 * t * d * e + 3 * 2 * t * 2 * d * f
    b, s, dm, nh, ff = 1, 8, 32, 2, 64
    blk = WORKLOADS["llama_block"].make_inputs((b, s, dm, nh, ff), dev, torch.float32)
    assert WORKLOADS["llama_block"].flops(blk) == (2 * b * s * dm * (4 * dm + 3 * ff)
                                                   + 2 * b * nh * s * (s + 1) * (dm // nh))


def test_tilefuse_on_llm_workloads_reports_counts_or_reasons():
    report = run(BenchOptions(backends=["eager", "tilefuse"], **FAST),
                 workloads=_tiny(["attention_causal", "rope_kv_cache"]))
    for r in report["results"]:
        if r["backend"] != "tilefuse":
            continue
        if r["status"] == "ok":
            assert r["kernels"] is not None and r["kernels"] + r["externs"] > 0
            assert r["autotune_s"] is not None and r["autotune_s"] >= 0
            assert r["fusion_ratio"] > 0 and r["compiles"] >= 1
        else:
            assert r["reason"].strip()


def test_jax_is_na_with_a_reason_when_missing(monkeypatch):
    import builtins
    import importlib

    real_import, real_import_module = builtins.__import__, importlib.import_module

    def no_jax(name, *args, **kwargs):
        if name == "jax" or name.startswith("jax."):
            raise ImportError("no jax here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_jax)
    # a module imported meanwhile may keep this function (`from importlib import
    # import_module`): it must import everything but JAX as the real one does
    monkeypatch.setattr("importlib.import_module", lambda name, package=None: no_jax(name)
                        if "jax" in name else real_import_module(name, package))
    modes = ["inductor-max-autotune", "inductor-max-autotune-no-cudagraphs",
             "inductor-reduce-overhead"]
    report = _run(["eager", "jax", *modes], ["softmax"])
    r = _row(report, "softmax", "jax")
    assert r["status"] == "n/a" and "JAX" in r["reason"]
    for mode in modes:
        m = _row(report, "softmax", mode)
        assert m["status"] == "n/a" and "GPU" in m["reason"]


_PARTITIONED_WRAPPER = '''
from torch._inductor.select_algorithm import extern_kernels
aten = torch.ops.aten
triton_red_fused_0 = async_compile.triton('triton_red_fused_0', """
@triton.jit
def triton_red_fused_0(in_ptr0, out_ptr0):  # aten.sum.dim_IntList(x) in a kernel's source
    pass
""")
triton_poi_fused_1 = async_compile.triton('triton_poi_fused_1', """...""")
async_compile.wait(globals())

def partition_0(args):
    buf0 = empty_strided_cuda((64, 64), (64, 1), torch.bfloat16)
    extern_kernels.mm(args[0], args[1], out=buf0)  # Topologically Sorted: aten.mm.default(
    triton_red_fused_0.run(buf0, buf1)
    buf2 = torch.ops.aten._scaled_dot_product_cudnn_attention.default(buf1, buf1, buf1)
    return (buf2,)

class Runner:
    def __init__(self, partitions):
        self.partitions = partitions

    def call(self, args):
        (buf2,) = self.partitions[0](args)
        triton_poi_fused_1.run(buf2)
        return (buf2,)

def benchmark_compiled_module(times=10, repeat=10):
    extern_kernels.mm(a, b)  # the harness is not the graph
'''


def test_inductor_code_counts_externs_inside_cuda_graph_partitions():
    """With CUDA graphs (max-autotune) Inductor's externs sit in partition functions outside
    `call`; kernel sources, comments and the benchmark harness are not calls of the graph."""
    from tilefuse.bench.backends import count_inductor_code

    assert count_inductor_code([_PARTITIONED_WRAPPER]) == (2, 2)
    plain = "k0 = async_compile.triton('k0', \'\'\'src\'\'\')\ndef call(args):\n    " \
            "extern_kernels.addmm(a, b, c, out=d)\n    k0.run(d)\n"
    assert count_inductor_code([plain, plain]) == (2, 2)


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="JAX not installed")
def test_jax_backend_runs_and_counts_jit_compiles():
    report = run(BenchOptions(backends=["eager", "jax"], **FAST),
                 workloads=_tiny(["rope_kv_cache", "moe"]))
    for name in ("rope_kv_cache", "moe"):
        r = _row(report, name, "jax")
        _assert_sane(r)
        assert r["recompiles"] == r["dynamic_sizes"]  # jit specialises on every shape


def test_cold_compile_is_cold_and_warm_hits_the_cache(tmp_path):
    from tilefuse.bench.coldstart import compile_latency

    res = compile_latency("softmax", "tilefuse", (4, 64), "float32", "cpu",
                          keep_dir=str(tmp_path / "caches"), timeout=300)
    cold, warm = res["cold"], res["warm"]
    assert "error" not in cold, cold
    assert cold["compiles"] >= 1 and cold["first_call_s"] > 0 and cold["kernels"] >= 1
    assert res["artifact_files"] > 0 and res["artifact_bytes"] > 0  # the cold run wrote them
    assert (tmp_path / "caches" / "tilefuse").is_dir()
    assert "error" not in warm, warm
    assert warm["compiles"] >= 1  # a new process traces again ...
    assert res["warm_new_files"] == 0  # ... but every kernel came from the cache
    with pytest.raises(ValueError, match="not empty"):  # a used directory is not cold
        compile_latency("softmax", "tilefuse", (4, 64), "float32", "cpu",
                        keep_dir=str(tmp_path / "caches"))


def test_compile_latency_only_measures_cold_and_warm_compiles_alone(tmp_path):
    """`--compile-latency-only` measures cold and warm compile in fresh processes and nothing
    else (a part of a run): no timings, no fp64 check (so no mismatch is claimed), eager n/a
    with its reason; merged after a timing part, it fills the compile columns only."""
    common = ["--device", "cpu", "--sizes", "quick", "--workloads", "softmax", "--quiet"]
    only, timed, merged = tmp_path / "only", tmp_path / "timed", tmp_path / "merged"
    out = io.StringIO()
    from contextlib import redirect_stdout

    with redirect_stdout(out):
        assert main(common + ["--backends", "eager,tilefuse", "--compile-latency-only",
                              "--strict", "--out", str(only)]) == 0
    assert "MISMATCH" not in out.getvalue()
    rep = json.loads((only / "results.json").read_text())
    assert rep["meta"]["compile_latency_only"] and rep["meta"]["ceilings"] == {}
    e, t = _row(rep, "softmax", "eager"), _row(rep, "softmax", "tilefuse")
    assert e["status"] == "n/a" and "does not compile" in e["reason"]
    assert t["status"] == "ok", t
    assert t["cold_compile_s"] > 0 and t["warm_compile_s"] > 0 and t["artifact_bytes"] > 0
    assert t["warm_cache_hit"] is True and t["cold_compiles"] >= 1
    assert t["p50_ms"] is None and t["correct"] is None and t["max_abs_err"] is None
    assert main(common + ["--backends", "eager,tilefuse", "--no-sweep", "--no-memory",
                          "--budget", "0.02", "--out", str(timed)]) == 0
    assert main(["--merge", str(timed / "results.json"), str(only / "results.json"),
                 "--out", str(merged)]) == 0
    m = _row(json.loads((merged / "results.json").read_text()), "softmax", "tilefuse")
    first = _row(json.loads((timed / "results.json").read_text()), "softmax", "tilefuse")
    assert m["p50_ms"] == first["p50_ms"] and m["correct"] is True
    assert m["cold_compile_s"] == t["cold_compile_s"] and "cold_compile_s" not in m["na"]


def test_plots_and_markdown(tmp_path):
    pytest.importorskip("matplotlib")
    report = _run(["eager", "scaled"], ["softmax", "rmsnorm"],
                  compilers={"scaled": lambda fn: fn})
    from tilefuse.bench.report import write_outputs

    json_path, md_path, plots = write_outputs(report, tmp_path)
    assert [p.name for p in plots] == ["speedup.png", "roofline.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in plots)
    md = md_path.read_text()
    assert "![speedup](speedup.png)" in md and "Measured ceilings" in md
    assert json.loads(json_path.read_text())["results"][0]["workload"] == "softmax"


def test_parts_of_a_run_merge_into_one_report(tmp_path):
    """A benchmark split into parts (one backend or workload set each) merges into one
    table; a pair measured twice keeps the first part's figures and takes only the metrics it
    lacks from the later part; results.json is written while a run is in progress (each pair
    as it is measured)."""
    from tilefuse.bench import report as report_mod

    seen = []
    real = report_mod.write_json

    def spy(partial, out_dir):
        seen.append(len(partial["results"]))
        return real(partial, out_dir)

    a, b, merged = tmp_path / "a", tmp_path / "b", tmp_path / "merged"
    common = ["--device", "cpu", "--sizes", "quick", "--no-memory", "--no-sweep", "--budget", "0.02", "--quiet"]
    report_mod.write_json = spy
    try:
        assert main(common + ["--workloads", "rmsnorm,softmax", "--backends", "eager", "--out", str(a)]) == 0
    finally:
        report_mod.write_json = real
    assert seen[:2] == [1, 2]  # after each pair
    assert main(common + ["--workloads", "softmax", "--backends", f"eager,{UNAVAILABLE}", "--out", str(b)]) == 0
    part_a = json.loads((a / "results.json").read_text())
    part_b = json.loads((b / "results.json").read_text())
    first = next(r for r in part_a["results"] if r["workload"] == "softmax")
    later = next(r for r in part_b["results"] if r["workload"] == "softmax" and r["backend"] == "eager")
    later["cold_compile_s"] = 1.25  # a metric the first part lacks
    (b / "results.json").write_text(json.dumps(part_b))
    assert main(["--merge", str(a / "results.json"), str(b / "results.json"), "--out", str(merged)]) == 0
    rep = json.loads((merged / "results.json").read_text())
    pairs = [(r["workload"], r["backend"]) for r in rep["results"]]
    assert pairs == [("rmsnorm", "eager"), ("softmax", "eager"), ("softmax", UNAVAILABLE)]
    merged_softmax = rep["results"][1]
    assert merged_softmax["p50_ms"] == first["p50_ms"] and merged_softmax["cold_compile_s"] == 1.25
    assert rep["meta"]["merged_runs"] == 2 and rep["meta"]["backends"] == ["eager", UNAVAILABLE]
    assert (merged / "report.md").exists()
    bad = json.loads((a / "results.json").read_text())
    bad["meta"]["dtype"] = "bfloat16"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(SystemExit):
        main(["--merge", str(a / "results.json"), str(tmp_path / "bad.json")])


def test_compiled_program_compiles_the_call_and_keeps_the_step():
    """The scripts' helper: the workload's program with its call compiled by the named backend
    (a training workload keeps its step around the compiled call)."""
    from tilefuse.bench.backends import compiled_program
    from tilefuse.bench.workloads import WORKLOADS

    w = WORKLOADS["softmax"]
    torch.manual_seed(0)
    inputs = w.make_inputs(w.sizes["quick"], torch.device("cpu"), torch.float32)
    expected = w.fn(*inputs)
    for backend in ("eager", "tilefuse", "tilefuse-reduce-overhead"):  # (the bench's names, as the report's)
        out = compiled_program(w, backend)(*inputs)
        torch.testing.assert_close(out, expected)
    trained = []
    step = dataclasses.replace(w, step=lambda run, *xs: trained.append(run(*xs)))
    compiled_program(step, "tilefuse")(*inputs)
    torch.testing.assert_close(trained[0], expected)
