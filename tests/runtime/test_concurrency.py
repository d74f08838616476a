"""One compiled function called from several threads at once gives every thread its own right
result: pointwise, reduction and matmul graphs, static and dynamic (different sizes per
thread), on the C++ backend and through the Triton interpreter. Per-size caches stay bounded
however many sizes a program calls with, and dropped graphs leave no loaded kernel behind."""
import gc
import threading

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.backends.cpu import find_compiler
from tilefuse.runtime import compiled as compiled_mod

THREADS = 4
needs_cxx = pytest.mark.skipif(find_compiler() is None, reason="no C++ compiler")


def pointwise(a, b):
    return a * 2 + b


def reduction(a, b):
    return torch.softmax(a, -1) * b.sum(-1, keepdim=True)


def matmul(a, b):
    return F.gelu(a @ b.T + 1)


PROGRAMS = {"pointwise": pointwise, "reduction": reduction, "matmul": matmul}


def _inputs(gen, rows: int, cols: int):
    return torch.randn(rows, cols, generator=gen), torch.randn(rows, cols, generator=gen)


def _sizes(thread: int, dynamic: bool) -> list:
    """(rows, cols) a thread calls with: its own sizes under dynamic=True, one shared size else."""
    if not dynamic:
        return [(8, 33)]
    return [(3 + thread, 17 + 5 * thread), (9 + 2 * thread, 40 - 3 * thread)]


def hammer(compiled, fn, dynamic: bool, calls: int) -> None:
    """Call `compiled` from THREADS threads at once, `calls` times each with fresh inputs, and
    compare every result with eager; raises with every thread's first failure."""
    # compiled before the threads start; under dynamic=True they meet their sizes together
    compiled(*_inputs(torch.Generator().manual_seed(0), *((5, 12) if dynamic else _sizes(0, False)[0])))
    start, failures = threading.Barrier(THREADS), []

    def work(t: int) -> None:
        gen = torch.Generator().manual_seed(100 + t)
        sizes = _sizes(t, dynamic)
        start.wait()
        try:
            for k in range(calls):
                args = _inputs(gen, *sizes[k % len(sizes)])
                out = compiled(*args)
                torch.testing.assert_close(out, fn(*args), rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"thread {t}, call {k}: {m}")
        except Exception as err:  # noqa: BLE001 - reported by the main thread
            failures.append(err)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not failures, "\n".join(str(f)[:500] for f in failures)


@needs_cxx
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_cpu_backend_threads_get_their_own_results(name, dynamic):
    torch._dynamo.reset()
    fn = PROGRAMS[name]
    hammer(tilefuse.compile(fn, target="cpu", dynamic=dynamic), fn, dynamic, calls=200)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_interpreter_threads_get_their_own_results(name, dynamic):
    torch._dynamo.reset()
    fn = PROGRAMS[name]
    hammer(tilefuse.compile(fn, target="interpret", dynamic=dynamic), fn, dynamic, calls=6)


def _graphs(monkeypatch) -> list:
    """The CompiledGraphs made from now on."""
    made, real = [], compiled_mod.CompiledGraph.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(compiled_mod.CompiledGraph, "__init__", init)
    return made


@pytest.mark.parametrize("target", [pytest.param("cpu", marks=needs_cxx), "interpret"])
def test_size_caches_stay_bounded(monkeypatch, target):
    from tilefuse.backends import size_cache

    monkeypatch.setattr(size_cache, "LIMIT", 8)
    graphs = _graphs(monkeypatch)
    torch._dynamo.reset()
    fn = lambda a: torch.softmax(a, -1) + a.sum()  # noqa: E731
    compiled = tilefuse.compile(fn, target=target, dynamic=True)
    sizes = range(3, 3 + (40 if target == "cpu" else 12))
    for n in list(sizes) + list(sizes)[:5]:  # the first sizes again, long evicted
        a = torch.randn(n, n + 1)
        torch.testing.assert_close(compiled(a), fn(a), rtol=1e-4, atol=1e-5)
    (graph,) = graphs
    kernels = [step.launch for step in graph.steps if hasattr(step.launch, "_shapes")]
    assert kernels and len(graph._layouts) == 8
    assert all(len(k._shapes) == 8 for k in kernels), [len(k._shapes) for k in kernels]


def test_size_cache_drops_the_least_recently_used():
    from tilefuse.backends import size_cache

    cache = size_cache.SizeCache(limit=3)
    for k in range(3):
        assert cache.put((("n", k),), k) == k
    assert cache.get((("n", 0),)) == 0  # now the most recent
    cache.put((("n", 3),), 3)
    assert len(cache) == 3 and cache.get((("n", 1),)) is None and cache.get((("n", 0),)) == 0
    assert cache.put((("n", 0),), "other") == 0  # the first value stays


@needs_cxx
def test_dropped_graphs_leave_no_loaded_kernel_entries():
    from tilefuse.backends.cpu import launcher as cpu_launcher
    from tilefuse.backends.triton import launcher as triton_launcher

    torch._dynamo.reset()
    gc.collect()
    before = len(cpu_launcher._libraries), len(triton_launcher._modules)
    for k in range(3):  # distinct constants: distinct kernels
        for target in ("cpu", "interpret"):
            fn = lambda a: a * (1.25 + k) - 0.5  # noqa: E731
            a = torch.randn(5, 7)
            torch.testing.assert_close(tilefuse.compile(fn, target=target)(a), fn(a))
    assert len(cpu_launcher._libraries) > before[0] and len(triton_launcher._modules) > before[1]
    torch._dynamo.reset()
    gc.collect()
    assert (len(cpu_launcher._libraries), len(triton_launcher._modules)) <= before
