"""Triton kernels compiled in worker processes (backends/triton/compile_pool.py): a generated
kernel compiles for a GPU target in a worker without any GPU (the worker never asks the
device), into the Triton cache the launching process reads, under the key that process would
compute; a failing task is reported, not raised; a dead worker fails its tasks and the pool
gives way to in-process compiles; a graph's final kernels and tuning candidates are handed
to the pool."""
import os
import signal
import threading
import time

import pytest
import torch

triton = pytest.importorskip("triton")

from irgraphs import GraphBuilder  # noqa: E402
from tilefuse.backends.triton import compile_pool, compile_worker, generate  # noqa: E402
from tilefuse.backends.triton.launcher import TritonKernel  # noqa: E402
from tilefuse.config import config  # noqa: E402
from tilefuse.fusion import plan_graph  # noqa: E402
from tilefuse.ir import dtypes as dt  # noqa: E402
from tilefuse.ir.expr import cast  # noqa: E402
from tilefuse.tile.lower import LoweringOptions, lower_plan_kernels  # noqa: E402
from tilefuse.tile.target import Target
from tilefuse.tune.tuner import precompile_kernel  # noqa: E402

TARGET = ("cuda", 90, 32)  # an H100/H200: compiling for it needs Triton's ptxas, not a GPU
GPU = LoweringOptions(target=Target.gpu(sm_count=132))


@pytest.fixture
def pool(tmp_path, monkeypatch):
    """A fresh pool of two workers compiling into a Triton cache of this test's own."""
    triton_cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton_cache))
    _reset()
    with config.patch(cache_dir=str(tmp_path / "tilefuse"), compile_threads=2):
        assert compile_pool.start(TARGET)
        _all_ready()
        yield triton_cache
        _reset()


def _all_ready(timeout=120.0):
    """Wait for every worker's "ready" (a compile waited for before any is ready is taken back)."""
    deadline = time.monotonic() + timeout
    while True:
        pool = compile_pool._pool
        assert pool is not None, f"the pool was given up: {compile_pool._unavailable}"
        if len(pool.ready_at) >= len(pool.workers):
            return
        assert time.monotonic() < deadline, "the compile workers did not start"
        time.sleep(0.05)


def _reset():
    if compile_pool._pool is not None:
        compile_pool._pool.close()
    compile_pool._pool, compile_pool._unavailable, compile_pool._stopped_counts = None, "", {}


def _row_softmax_kernel(rows=37, cols=100, strides="contiguous"):
    """A generated kernel of odd sizes (not multiples of any block); `strides=None`: the
    input's strides are arguments."""
    g = GraphBuilder("sm")
    x = g.input("x", (rows, cols), dt.bfloat16, strides=strides)
    mx = g.ctx.reduce((rows,), (cols,), "max", lambda i, r: cast(x.load((i[0], r[0])), dt.float32), dt.float32)
    graph = g.output(mx)
    (plan,) = plan_graph(graph).kernels
    (tk,) = lower_plan_kernels(graph, plan, GPU)
    return graph, tk


def _cubins(root) -> set:
    return {f for _, _, files in os.walk(root) for f in files if f.endswith(".cubin")}


def test_a_worker_compiles_a_generated_kernel_without_a_gpu(pool):
    graph, tk = _row_softmax_kernel()
    launcher = TritonKernel(tk, generate(tk, interpret=False), interpret=False)
    assert precompile_kernel(graph, tk, launcher)
    compile_pool.wait(launcher._warming)
    assert launcher._warming.result()[0] == "" and launcher._warming.result()[1]
    assert f"{tk.name}.cubin" in _cubins(pool)
    assert not any("primer" in f for f in _cubins(pool))  # the worker's warm-up compiled elsewhere
    assert compile_pool.stats()["compiled"] == 1 and compile_pool.stats()["busy_s"] > 0
    # handed over once: a second request for the same launch is the same task
    assert not precompile_kernel(graph, tk, launcher)


def test_the_launching_process_finds_the_workers_binary(pool):
    """The key the launching process computes for the same launch is the worker's: compiling
    it here (under the same fixed target) adds nothing to the cache."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    graph, tk = _row_softmax_kernel(rows=19, cols=70)
    launcher = TritonKernel(tk, generate(tk, interpret=False), interpret=False)
    assert precompile_kernel(graph, tk, launcher)
    digest = compile_pool.wait(launcher._warming)
    before = {d for d in os.listdir(pool)}
    buffers = {n: torch.empty(graph[n].shape, dtype=torch.bfloat16 if graph[n].dtype == dt.bfloat16
                              else torch.float32, device="meta") for n in list(tk.reads) + list(tk.writes)}
    values = launcher._shape({}).values
    args = [a.dtype if hasattr(a, "dtype") else a for a in launcher._args(buffers, values, launch=False)]
    saved = driver._active
    driver.set_active(compile_worker._TargetOnlyDriver(GPUTarget(*TARGET)))
    try:
        here = launcher.fn.warmup(*args, grid=(1,), **launcher._launch_options)
    finally:
        driver._active = saved
    assert {d for d in os.listdir(pool)} == before
    assert here.hash == digest


def test_triton_settings_made_after_the_workers_started_reach_them(pool, tmp_path, monkeypatch):
    """A library that points Triton elsewhere once the workers run (TorchInductor sets
    TRITON_CACHE_DIR when it first compiles) is followed: the binary lands where this process
    will look for it."""
    elsewhere = tmp_path / "elsewhere"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(elsewhere))
    graph, tk = _row_softmax_kernel(rows=23, cols=45)
    launcher = TritonKernel(tk, generate(tk, interpret=False), interpret=False)
    assert precompile_kernel(graph, tk, launcher)
    assert compile_pool.wait(launcher._warming)
    assert f"{tk.name}.cubin" in _cubins(elsewhere)
    assert f"{tk.name}.cubin" not in _cubins(pool)


def test_a_failing_task_is_reported_not_raised(pool):
    graph, tk = _row_softmax_kernel()
    launcher = TritonKernel(tk, generate(tk, interpret=False), interpret=False)
    future = compile_pool.submit("missing", launcher.module.__tilefuse_path__, launcher.module.__name__,
                                 "no_such_kernel", [], {})
    compile_pool.wait(future)  # logged only
    assert "no_such_kernel" in future.result()[0]
    assert compile_pool.stats()["failed"] == 1


def _warm_up():
    """One compile through the pool, so that its workers have started."""
    graph, tk = _row_softmax_kernel(rows=11, cols=12)
    launcher = TritonKernel(tk, generate(tk, interpret=False), interpret=False)
    assert precompile_kernel(graph, tk, launcher)
    assert compile_pool.wait(launcher._warming)


def _gone(timeout=20.0):
    deadline = time.monotonic() + timeout
    while compile_pool._pool is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    return compile_pool._pool is None


def test_dead_workers_are_noticed_and_the_pool_gives_way(pool):
    _warm_up()
    for w in compile_pool._pool.workers:
        os.kill(w.pid, signal.SIGKILL)
    assert _gone()  # each worker's thread sees its process gone, idle or not
    assert "every compile worker stopped" in compile_pool._unavailable
    graph, tk = _row_softmax_kernel()
    launcher = TritonKernel(tk, generate(tk, interpret=False), interpret=False)
    assert not precompile_kernel(graph, tk, launcher)  # no pool: the launch compiles it
    assert not compile_pool.start(TARGET)  # not started again in this process


def test_a_hung_worker_gives_the_pool_up(pool, monkeypatch):
    _warm_up()
    monkeypatch.setattr(compile_pool, "WAIT_S", 2.0)
    for w in compile_pool._pool.workers:
        os.kill(w.pid, signal.SIGSTOP)
    graph, tk = _row_softmax_kernel(rows=7, cols=9)
    launcher = TritonKernel(tk, generate(tk, interpret=False), interpret=False)
    assert precompile_kernel(graph, tk, launcher)
    t0 = time.monotonic()
    assert compile_pool.wait(launcher._warming) == ""
    assert time.monotonic() - t0 < 30
    assert compile_pool._pool is None and "2 s" in compile_pool._unavailable
    future = launcher._warming
    assert compile_pool.wait(future) == ""  # a later wait on the given-up pool returns at once


def test_a_task_that_breaks_the_channel_completes(pool):
    """Whatever breaks a worker's channel, the task in hand completes (with an error) instead of
    leaving its launch waiting."""
    future = compile_pool.submit("unpicklable", "p", "m", "f", [threading.Lock()], {})
    t0 = time.monotonic()
    assert compile_pool.wait(future) == ""
    assert time.monotonic() - t0 < 10 and future.exception() is not None


def test_one_thread_means_no_pool(monkeypatch):
    _reset()
    with config.patch(compile_threads=1):
        assert not compile_pool.start(TARGET)
        assert compile_pool.submit("k", "p", "m", "f", [], {}) is None
    _reset()


def test_a_symbolic_size_is_left_to_the_launch(pool):
    import sympy

    g = GraphBuilder("dyn")
    n = sympy.Symbol("s0", positive=True, integer=True)
    x = g.input("x", (n, 64), dt.float32, strides="contiguous")
    out = g.ctx.reduce((n,), (64,), "sum", lambda i, r: x.load((i[0], r[0])), dt.float32)
    graph = g.output(out)
    (plan,) = plan_graph(graph).kernels
    (tk,) = lower_plan_kernels(graph, plan, GPU)
    launcher = TritonKernel(tk, generate(tk, interpret=False), interpret=False)
    assert not precompile_kernel(graph, tk, launcher)


def test_a_pool_whose_binaries_are_never_found_is_given_up(pool):
    """If this process's launches never find what the workers compiled (their cache keys
    differ), the pool stops instead of doubling every compile."""

    class Compiled:
        hash = "this-process-key"

    for _ in range(compile_pool.GIVE_UP_AFTER):
        compile_pool.launched("worker-key", Compiled())
    assert compile_pool._pool is None and "none found" in compile_pool._unavailable
    assert compile_pool.stats()["missed"] == compile_pool.GIVE_UP_AFTER
    assert not compile_pool.start(TARGET)


def test_found_binaries_keep_the_pool(pool):
    class Compiled:
        hash = "same"

    compile_pool.launched("same", Compiled())
    for _ in range(compile_pool.GIVE_UP_AFTER):
        compile_pool.launched("other", type("C", (), {"hash": "x"})())
    assert compile_pool._pool is not None
    assert compile_pool.stats()["found"] == 1


def test_the_worker_keys_its_binary_with_this_processs_backend_hash(pool, monkeypatch):
    """The backend part of Triton's key (the ptxas version this process read once) is taken
    from this process, not recomputed in the worker."""
    graph, tk = _row_softmax_kernel(rows=29, cols=33)
    launcher = TritonKernel(tk, generate(tk, interpret=False), interpret=False)
    task = (launcher.module.__tilefuse_path__, launcher.module.__name__, tk.name,
            [torch.bfloat16, torch.float32], launcher._launch_options)
    own = compile_pool.wait(compile_pool.submit("own", *task))
    monkeypatch.setattr(compile_pool, "_backend_hash", lambda target: "another-ptxas-90")
    other = compile_pool.wait(compile_pool.submit("other", *task))
    assert own and other and own != other


def test_launch_arguments_and_their_key():
    """A launch's arguments are the set of sizes' template with the buffers and strides filled
    in; its key tells apart what Triton specialises on (a base address off 16 bytes, other
    strides) and nothing is evaluated from sympy again."""
    graph, tk = _row_softmax_kernel(strides=None)
    launcher = TritonKernel(tk, generate(tk, interpret=False), interpret=False)
    sized = launcher._shape({})
    names = [name for kind, name, _ in launcher.arg_plan if kind == "buffer"]
    x = torch.randn(37, 100).to(torch.bfloat16)
    out = torch.empty(37, dtype=torch.float32)
    buffers = {names[0]: x, names[1]: out} if names[0] == "x" else {names[0]: out, names[1]: x}
    args, key = launcher._launch_args(buffers, sized)
    assert args == launcher._args(buffers, sized.values)
    assert launcher._launch_args(buffers, sized)[1] == key
    shifted = dict(buffers, x=torch.randn(37 * 100 + 1).to(torch.bfloat16)[1:].view(37, 100))
    assert launcher._launch_args(shifted, sized)[1] != key  # (an odd base address)
    wide = dict(buffers, x=torch.randn(37, 128).to(torch.bfloat16)[:, :100])
    assert launcher._launch_args(wide, sized)[1] != key  # (other strides)


def test_a_worker_warms_up_outside_the_users_cache(tmp_path):
    """A worker's first compile loads Triton's compiler: the worker pays that on a throwaway
    kernel and cache before it is ready, and leaves the user's cache and environment as they were."""
    import subprocess
    import sys

    code = ("import os, time; from tilefuse.backends.triton import compile_worker as w\n"
            "w._install_target(('cuda', 90, 32))\n"
            "t = time.perf_counter(); why = w.prime(); first = time.perf_counter() - t\n"
            "t = time.perf_counter(); again = w.prime(); second = time.perf_counter() - t\n"
            "print(repr(why), repr(again), os.environ['TRITON_CACHE_DIR'], os.environ['TRITON_KERNEL_DUMP'],"
            " first, second)")
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "user"), TRITON_KERNEL_DUMP="1",
               TRITON_DUMP_DIR=str(tmp_path / "dump"),
               PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "..", "src"),
                                           os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    why, again, cache, dump, first, second = out.stdout.split()
    assert why == again == "''" and cache == str(tmp_path / "user") and dump == "1"
    assert not (tmp_path / "user").exists() or not any((tmp_path / "user").rglob("*.cubin"))
    assert not (tmp_path / "dump").exists() or not any((tmp_path / "dump").rglob("*"))


_KEEP_OUT_SCRIPT = """
import importlib.util, json, os, sys
if sys.argv[1] == "with-torch":
    import torch
spec = importlib.util.spec_from_file_location("compile_worker", sys.argv[2])
w = importlib.util.module_from_spec(spec)
sys.modules["compile_worker"] = w
spec.loader.exec_module(w)
stubs = w._builds_launch_stubs()  # (Triton before 3.9: its binder imports PyTorch)
if sys.argv[1] == "forced":  # (as if this Triton's binder imported PyTorch: 3.9 fails, and retries)
    w._builds_launch_stubs = lambda: True
took = {}
assert w._prepare(("cuda", 90, 32), took) == ""
args = [(w.DTYPE, "bfloat16"), (w.DTYPE, "float32"), 1000, 2.5]
env = {k: v for k, v in os.environ.items() if k.startswith("TRITON_")}
digest = w.compile_kernel(sys.argv[3], "keep_out_kernel", "scale", args, {"BLOCK": 128, "num_warps": 4}, env)
print(json.dumps({"hash": digest, "torch": w._has_torch(), "took": took, "stubs": stubs}))
"""

_KEEP_OUT_KERNEL = """
import triton
import triton.language as tl


@triton.jit
def scale(x, y, n, s, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + i, mask=i < n, other=0.0)
    tl.store(y + i, v * s, mask=i < n)
"""


def test_a_worker_keeps_pytorch_out_and_keys_its_binary_as_with_it(tmp_path):
    """Before Triton 3.9 the binder imported PyTorch at a worker's first compile (4-5 s of the
    workers' start on a GPU host): a worker marks it absent, and its binary's key is the one a
    process with PyTorch imported computes for the same task."""
    import json
    import subprocess
    import sys

    kernel = tmp_path / "keep_out_kernel.py"
    kernel.write_text(_KEEP_OUT_KERNEL)
    found = {}
    for how in ("without", "with-torch", "forced"):
        env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / how))
        out = subprocess.run([sys.executable, "-c", _KEEP_OUT_SCRIPT, how, compile_worker.__file__, str(kernel)],
                             env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        found[how] = json.loads(out.stdout.strip().splitlines()[-1])
    without, forced = found["without"], found["forced"]
    assert without["torch"] is False and without["took"]["imported_torch"] is False
    # (kept out exactly where Triton's binder would import it, and with no second warm-up)
    assert without["took"]["kept_torch_out"] is without["stubs"] and without["took"]["retried"] is False
    assert found["with-torch"]["torch"] is True and found["with-torch"]["took"]["kept_torch_out"] is False
    # a Triton that fails with PyTorch marked absent (3.9 looks it up) warms up again without the mark
    assert forced["took"]["retried"] is not forced["stubs"] and forced["took"]["kept_torch_out"] is forced["stubs"]
    assert without["hash"] and without["hash"] == found["with-torch"]["hash"] == forced["hash"]


@pytest.mark.skipif(not compile_pool._can_fork(), reason="workers are forked on Linux only")
def test_workers_are_forked_from_one_warmed_up_process(pool):
    """On Linux the workers are forked from one process that imported Triton and warmed the
    compiler up, not started one by one; they compile as spawned ones do."""
    _warm_up()
    stats = compile_pool.stats()
    assert stats["started"] == "forked" and len(stats["ready_s"]) == 2 and stats["warm_up"]["import_s"] > 0
    # nor do they import PyTorch (3-5 s of a start): a task's dtypes are names, the driver is theirs
    assert stats["warm_up"]["imported_torch"] is False and stats["imported_torch"] is False
    forking = compile_pool._pool.forking
    pids = {w.pid for w in compile_pool._pool.workers}
    assert forking is not None and forking.pid not in pids and None not in pids and len(pids) == 2
    for pid in pids:  # each a child of the forking process, in its process group
        with open(f"/proc/{pid}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == forking.pid
    _reset()
    assert forking.poll() is not None  # closing the pool ends the forking process too


def _python(code: str) -> str:
    """What `code` prints, run by a fresh interpreter that imports this checkout's tilefuse."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "..", "src"),
                                                      os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_a_process_with_other_threads_refuses_to_fork(tmp_path):
    """Forking with another thread running is unsafe (a lock it held stays held in the child):
    the forking process says so on every worker's pipe instead of forking."""
    code = ("import os, sys, threading, time\n"
            "from tilefuse.backends.triton import compile_worker as w\n"
            "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
            "r, wr = os.pipe()\n"
            "code = w._forked_workers(('cuda', 90, 32), [(os.open(os.devnull, os.O_RDONLY), wr)])\n"
            "print(code, w.read_message(os.fdopen(r, 'rb'))[2])\n")
    out = _python(code)
    assert out.startswith(f"1 {compile_worker.FORK_REFUSED}")


def test_a_failed_fork_refuses_for_the_workers_not_forked(tmp_path):
    """A fork that fails (no memory, a process limit) tells each worker not yet forked that the
    fork was refused, so that it starts alone, instead of leaving it without a reply."""
    code = ("import os\n"
            "from tilefuse.backends.triton import compile_worker as w\n"
            "def no_fork(): raise OSError(11, 'no more processes')\n"
            "os.fork = no_fork\n"
            "pairs, readers = [], []\n"
            "for _ in range(2):\n"
            "    r, wr = os.pipe(); pairs.append((os.open(os.devnull, os.O_RDONLY), wr)); readers.append(r)\n"
            "w._forked_workers(('cuda', 90, 32), pairs)\n"
            "print([w.read_message(os.fdopen(r, 'rb'))[2].split(':')[0] for r in readers])\n")
    out = _python(code)
    assert out.strip() == str([compile_worker.FORK_REFUSED] * 2)


def test_a_refused_fork_starts_each_worker_alone(tmp_path, monkeypatch):
    """Where the forking process refuses, each worker starts a process of its own, and the
    pool compiles as before."""

    class Refused:
        pid = os.getpid()

        def wait(self, timeout=None):
            return 0

    def refusing(n, target, env):
        channels = []
        for _ in range(n):
            task_r, task_w = os.pipe()
            reply_r, reply_w = os.pipe()
            os.close(task_r)
            with os.fdopen(reply_w, "wb") as replies:
                compile_worker.write_message(replies, ("ready", None, f"{compile_worker.FORK_REFUSED}: test", {}))
            channels.append((os.fdopen(task_w, "wb"), os.fdopen(reply_r, "rb")))
        return Refused(), channels

    monkeypatch.setattr(compile_pool, "_start_forking", refusing)
    monkeypatch.setattr(compile_pool, "_can_fork", lambda: True)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    _reset()
    with config.patch(cache_dir=str(tmp_path / "tilefuse"), compile_threads=2):
        assert compile_pool.start(TARGET)
        _all_ready()
        _warm_up()
        assert compile_pool.stats()["started"] == "spawned"
        assert all(w.proc is not None and w.pid == w.proc.pid for w in compile_pool._pool.workers)
    _reset()


def test_a_compile_waited_for_before_any_worker_is_ready_is_taken_back():
    """While no worker is ready yet, a launch that needs a queued compile compiles it itself
    (it would wait idle); once one is, it waits for the worker's binary."""
    from concurrent.futures import Future

    class Starting:
        ready_at: list = []
        futures: dict = {}
        counts = {"taken_back": 0}
        closed = False
        last_progress = time.monotonic()

    queued = Future()
    queued.pool, queued.started = Starting(), None
    Starting.futures["k"] = queued
    assert compile_pool.wait(queued) == "" and queued.cancelled()
    assert Starting.counts["taken_back"] == 1 and "k" not in Starting.futures  # (asked again: a new task)

    Starting.ready_at = [1.0]
    waiting = Future()
    waiting.pool, waiting.started = Starting(), None
    threading.Timer(0.3, lambda: waiting.set_running_or_notify_cancel() and waiting.set_result(("", "abc"))).start()
    assert compile_pool.wait(waiting) == "abc" and not waiting.cancelled()
    assert Starting.counts["taken_back"] == 1
