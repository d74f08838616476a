"""The graph cache: a graph compiled before is loaded (not planned, lowered or tuned again) and
gives the same results; anything the compiled graph depends on changes its key; an entry that
does not load is compiled again, never an error."""
import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

import tilefuse
from tilefuse import api, graph_cache
from tilefuse.runtime import artifact

TARGETS = ["cpu", "interpret"]


@contextlib.contextmanager
def collected_reports():
    """The compile reports of the graphs compiled inside the block (as `explain` collects them)."""
    sink: list = []
    api._report_sinks.append(sink)
    try:
        yield sink
    finally:
        api._report_sinks.remove(sink)


def compile_and_run(fn, *args, **options):
    """(outputs, the reports of the graphs compiled) for a fresh Dynamo compile of `fn`."""
    torch._dynamo.reset()
    with collected_reports() as reports:
        out = tilefuse.compile(fn, fallback="error", **{"graph_cache": True, **options})(*args)
    assert reports
    return out, reports


def mlp(x, w1, b1, w2):
    h = torch.nn.functional.gelu(x @ w1 + b1)
    return torch.softmax(h @ w2, dim=-1) * 3 - torch.nn.functional.layer_norm(h, (h.shape[-1],)).mean(-1, keepdim=True)


def mlp_inputs():
    return (torch.randn(37, 24, dtype=torch.float64).float(), torch.randn(24, 33), torch.randn(33),
            torch.randn(33, 17))


def reference(fn, *args):
    return fn(*(a.double() if a.is_floating_point() else a for a in args))


@pytest.mark.parametrize("target", TARGETS)
def test_a_graph_compiled_before_is_loaded(tmp_path, target):
    args = mlp_inputs()
    first, reports = compile_and_run(mlp, *args, target=target, cache_dir=str(tmp_path))
    assert reports[-1].cached == ""
    assert os.listdir(tmp_path / "graphs")
    fresh = mlp_inputs()  # the loaded graph on new data
    second, reports = compile_and_run(mlp, *fresh, target=target, cache_dir=str(tmp_path))
    loaded = reports[-1]
    assert loaded.cached and "graph cache" in loaded.stage_seconds and "fusion" not in loaded.stage_seconds
    assert loaded.kernels and all(k.source for k in loaded.kernels if k.kind != "aten-matmul")
    torch.testing.assert_close(second.double(), reference(mlp, *fresh), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(first, mlp(*args), atol=1e-4, rtol=1e-4)


def test_the_key_follows_what_the_graph_depends_on(tmp_path):
    args = mlp_inputs()
    compile_and_run(mlp, *args, target="cpu", cache_dir=str(tmp_path))

    def cached(*a, **options):
        out, reports = compile_and_run(mlp, *a, target="cpu", cache_dir=str(tmp_path), **options)
        torch.testing.assert_close(out.double(), reference(mlp, *a), atol=1e-4, rtol=1e-4)
        return bool(reports[-1].cached)

    assert cached(*args)
    assert not cached(torch.randn(38, 24), *args[1:])  # another shape
    assert not cached(args[0].double(), *(a.double() for a in args[1:]))  # another dtype
    assert not cached(torch.randn(24, 37).t(), *args[1:])  # other strides
    assert not cached(*args, persistent_reduction_limit=16)  # a knob that changes kernels
    assert cached(*args, logs="")  # a knob that changes nothing compiled
    assert not cached(*args, graph_cache=False)  # off: neither loaded ...
    entries = len(os.listdir(tmp_path / "graphs"))
    compile_and_run(lambda *a: mlp(*a) + 1, *args, target="cpu", cache_dir=str(tmp_path), graph_cache=False)
    assert len(os.listdir(tmp_path / "graphs")) == entries  # ... nor stored


def test_a_change_of_tilefuse_source_misses(tmp_path, monkeypatch):
    args = mlp_inputs()
    compile_and_run(mlp, *args, target="cpu", cache_dir=str(tmp_path))
    monkeypatch.setattr(graph_cache, "source_hash", lambda: "an edited checkout")
    _, reports = compile_and_run(mlp, *args, target="cpu", cache_dir=str(tmp_path))
    assert not reports[-1].cached


def test_constants_are_part_of_the_key(tmp_path):
    def with_constant(values):
        def fn(x):
            return x * torch.tensor(values) + 1
        return fn

    x = torch.randn(4, 3)
    for values in ([1.0, 2.0, 3.0], [1.0, 2.0, -3.0]):  # the same code, another constant
        fn = with_constant(values)
        out, reports = compile_and_run(fn, x, target="cpu", cache_dir=str(tmp_path))
        assert not reports[-1].cached
        torch.testing.assert_close(out, fn(x))
    out, reports = compile_and_run(with_constant([1.0, 2.0, -3.0]), x, target="cpu", cache_dir=str(tmp_path))
    assert reports[-1].cached
    torch.testing.assert_close(out, x * torch.tensor([1.0, 2.0, -3.0]) + 1)


def test_symbolic_shapes_and_extern_calls(tmp_path):
    def fn(x, y):
        s = torch.sort(x, dim=-1).values  # an extern call
        return torch.softmax(s * 2, -1) + y.sum(0)

    def run(n):
        x, y = torch.randn(n, 19), torch.randn(5, 19)
        out, reports = compile_and_run(fn, x, y, target="cpu", cache_dir=str(tmp_path), dynamic=True)
        torch.testing.assert_close(out.double(), reference(fn, x, y), atol=1e-5, rtol=1e-5)
        return reports[-1]

    assert not run(7).cached
    loaded = run(11)  # another size: the same symbolic graph
    assert loaded.cached and loaded.externs


def test_training_graphs(tmp_path):
    def step(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.GELU(), torch.nn.LayerNorm(20),
                                    torch.nn.Linear(20, 3))
        x = torch.randn(9, 12)
        ref = model(x).square().mean()
        ref.backward()
        expected = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        torch._dynamo.reset()
        with collected_reports() as reports:
            loss = tilefuse.compile(model, fallback="error", target="cpu", cache_dir=str(tmp_path),
                                    graph_cache=True)(x).square().mean()
            loss.backward()
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
        for p, g in zip(model.parameters(), expected):
            torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-5)
        return reports

    first = step(0)
    second = step(1)  # other weights and data, the same graphs
    assert [r.graph_name.rstrip("0123456789") for r in first] == ["forward", "backward"]
    assert all(not r.cached for r in first) and all(r.cached for r in second)


def test_identical_kernels_stay_shared(tmp_path):
    def layers(x, w):
        for _ in range(3):
            x = torch.nn.functional.layer_norm(torch.relu(x @ w), (x.shape[-1],))
        return x

    x, w = torch.randn(10, 16), torch.randn(16, 16)
    compile_and_run(layers, x, w, target="cpu", cache_dir=str(tmp_path), matmul="generated")
    key = next(iter(os.listdir(tmp_path / "graphs")))
    out, reports = compile_and_run(layers, x, w, target="cpu", cache_dir=str(tmp_path), matmul="generated")
    assert reports[-1].cached and sum(1 for k in reports[-1].kernels if k.shares) >= 2
    torch.testing.assert_close(out.double(), reference(layers, x, w), atol=1e-4, rtol=1e-4)
    assert key


def test_an_entry_that_does_not_load_is_compiled_again(tmp_path, monkeypatch):
    keys = []
    real_key = graph_cache.graph_key
    monkeypatch.setattr(graph_cache, "graph_key", lambda *a: keys.append(real_key(*a)) or keys[-1])
    args = mlp_inputs()
    compile_and_run(mlp, *args, target="cpu", cache_dir=str(tmp_path))
    # the entry replaced by one naming what a stored graph may not name (its manifest valid)
    bad = json.dumps({"format": 1, "sympy": [], "value": ["fn", "os:system"]}).encode()
    with tilefuse.config.patch(cache_dir=str(tmp_path)):
        cache = graph_cache.graph_cache()
        cache.clear()
        assert cache.put(keys[-1], {"graph.json": bad})
    out, reports = compile_and_run(mlp, *args, target="cpu", cache_dir=str(tmp_path))
    assert not reports[-1].cached and len(keys) == 2 and keys[0] == keys[1]
    torch.testing.assert_close(out, mlp(*args), atol=1e-4, rtol=1e-4)


def test_unstorable_graphs_are_compiled_every_time(tmp_path, monkeypatch):
    monkeypatch.setattr(artifact, "MAX_TENSOR_BYTES", 8)

    def fn(x):
        return x + torch.tensor([3.0, -1.0, 4.0, 1.0, 5.0, 9.0])  # a constant larger than the (lowered) bound

    x = torch.randn(6)
    for _ in range(2):
        out, reports = compile_and_run(fn, x, target="cpu", cache_dir=str(tmp_path))
        assert not reports[-1].cached
        torch.testing.assert_close(out, fn(x))


SCRIPT = r"""
import json, time, torch, tilefuse
torch.manual_seed(0)
def f(x, w):
    return torch.softmax(x @ w, -1).square() + x.mean()
x, w = torch.randn(13, 21), torch.randn(21, 21)
out = tilefuse.compile(f, fallback="error")(x, w)
torch.testing.assert_close(out, f(x, w), atol=1e-5, rtol=1e-5)
report = tilefuse.last_compilations().reports[-1]
print(json.dumps({"cached": report.cached, "stages": sorted(report.stage_seconds), "seconds": report.stage_seconds}))
"""


def test_a_new_process_loads_the_graph(tmp_path):
    env = dict(os.environ, TILEFUSE_CACHE_DIR=str(tmp_path), TILEFUSE_TARGET="cpu", TILEFUSE_GRAPH_CACHE="1",
               PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "src"),
                                           os.environ.get("PYTHONPATH", "")]))

    def run():
        out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert not first["cached"] and "fusion" in first["stages"]
    # (an inference graph: straight from Dynamo's graph, AOTAutograd not traced: `front_cache`)
    assert second["cached"] and second["stages"] == ["front cache", "graph cache", "total"]
    seconds = second["seconds"]  # (the front cache's time holds the graph cache's load: counted once)
    assert abs(seconds["front cache"] + seconds["graph cache"] - seconds["total"]) < 1e-6


def _attention(q, k, v):
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    n = s.shape[-1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).tril().logical_not(), float("-inf"))
    return torch.softmax(s, -1) @ v


def _kv_write(cache, pos, new, q):
    cache.index_copy_(1, pos, new)  # an in-place write into an input
    return torch.softmax(q @ cache.transpose(-1, -2), -1) @ cache


PROGRAMS = {
    "attention": (_attention, lambda: [torch.randn(2, 3, 21, 16) for _ in range(3)]),
    "embedding_cross_entropy": (
        lambda idx, emb, w, y: torch.nn.functional.cross_entropy(emb[idx] @ w, y),
        lambda: [torch.randint(0, 30, (13,)), torch.randn(30, 8), torch.randn(8, 11), torch.randint(0, 11, (13,))]),
    "kv_cache_write": (_kv_write, lambda: [torch.randn(2, 9, 8), torch.tensor([2, 5]), torch.randn(2, 2, 8),
                                          torch.randn(2, 3, 8)]),
    "conv_norm": (lambda x, w: torch.nn.functional.group_norm(torch.nn.functional.conv2d(x, w, padding=1), 2),
                  lambda: [torch.randn(2, 3, 9, 7), torch.randn(4, 3, 3, 3)]),
    "argmax_cumsum": (lambda x: (x.argmax(-1), x.cumsum(0), x.max(-1).values), lambda: [torch.randn(7, 33)]),
    "bf16_rmsnorm": (lambda x, w: (x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w,
                     lambda: [torch.randn(5, 130).bfloat16(), torch.randn(130).bfloat16()]),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_programs_loaded_from_the_cache_match_eager(tmp_path, name):
    fn, make = PROGRAMS[name]
    for attempt in range(2):
        torch.manual_seed(attempt)
        args = make()
        expected_args = [a.clone() for a in args]
        expected = fn(*expected_args)
        out, reports = compile_and_run(fn, *args, target="cpu", cache_dir=str(tmp_path))
        assert bool(reports[-1].cached) == (attempt == 1), name
        for got, want in zip(out if isinstance(out, tuple) else (out,),
                             expected if isinstance(expected, tuple) else (expected,)):
            tol = 2e-2 if want.dtype == torch.bfloat16 else 1e-4
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        for got, want in zip(args, expected_args):  # in-place writes happened as in eager
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not hasattr(torch.backends.cuda.matmul, "fp32_precision"),
                    reason="a PyTorch without the per-backend fp32_precision API")
def test_a_program_that_mixed_the_tf32_apis_compiles(tmp_path):
    """Setting `allow_tf32` and then a backend's `fp32_precision` makes
    `torch.get_float32_matmul_precision` raise ("mix of the legacy and new APIs"); eager runs on,
    and so must a compile: the keys read each backend's precision instead, and the graph cached
    under the global setting is not the one loaded under the mixed one."""
    before = torch.get_float32_matmul_precision()
    args = mlp_inputs()
    try:
        torch.set_float32_matmul_precision("highest")
        _, reports = compile_and_run(mlp, *args, target="cpu", cache_dir=str(tmp_path))
        assert not reports[-1].cached
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
            torch.get_float32_matmul_precision()
        assert "cuda.matmul=tf32" in graph_cache.matmul_precision()
        out, reports = compile_and_run(mlp, *args, target="cpu", cache_dir=str(tmp_path))
        torch.testing.assert_close(out.double(), reference(mlp, *args), atol=1e-4, rtol=1e-4)
        assert not reports[-1].cached  # another precision: another entry
        _, reports = compile_and_run(mlp, *args, target="cpu", cache_dir=str(tmp_path))
        assert reports[-1].cached
    finally:
        torch.set_float32_matmul_precision(before)
