"""Triton kernels compiled ahead of their first launch, in worker processes.

Compiling one Triton kernel (LLVM, ptxas, the launch stub) costs 0.3–1.5 s of CPU in the
process that first launches it; a graph's kernels and tuning candidates compiled one after
another were most of a cold compile. `submit` hands a kernel to a pool of worker processes
(`compile_worker`) that compile it into Triton's on-disk cache; the kernel's first launch
waits for its task (`wait`), and Triton then loads the binary from disk instead of compiling.

Workers run `compile_worker.py` as a script (not `multiprocessing`, whose spawned children
re-run the user's script; not `-m`, which would import all of tilefuse and put the current
directory first on their path), start when the first graph that can use them is compiled, and
live until this process exits. They never create a CUDA context (see `compile_worker`). On
Linux one process imports Triton (not PyTorch, which Triton's argument binder imported before
Triton 3.9: `compile_worker._keep_torch_out`) and compiles a throwaway kernel
(`compile_worker.prime`), then forks the
workers, which inherit all of it — as Inductor's compile workers are forked from one process
that imported Triton; elsewhere each worker starts and warms up alone. Either way the cost is
paid while the graph is traced, not by its first kernel (and a kernel needed before any worker
is ready compiles where it launches: `wait`).
`compile_threads` sets how many (0: one per CPU core shared among the local ranks of a
distributed job, at most 32; 1: none — every kernel compiles in the process that launches it).

The pool is an optimisation only: a worker that fails, dies or hangs costs time, never a
result; the launching process then compiles the kernel itself (and reports the real error if
there is one). A compile that runs for `WAIT_S`, or a queue that moves for none as long, closes
the pool for the rest of the process, as do first launches that never find their worker's
binary.
"""
from __future__ import annotations

import atexit
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from ... import logs
from ...config import config
from .compile_worker import FORK_REFUSED, portable_args, read_message, write_message

#: most workers the default (0) starts, however many cores there are
MAX_WORKERS = 32
#: seconds a compile may run, or the queue stand still, before the pool is given up
WAIT_S = 300.0
#: first launches that miss their worker's binary, with none found, before the pool is closed
GIVE_UP_AFTER = 4
_POLL_S = 0.25

_lock = threading.Lock()
_pool: "_Pool | None" = None
_unavailable = ""  # why there is no pool (once set, none is started again)
_stopped_counts: dict = {}  # the counts of a pool given up on


def worker_count() -> int:
    if config.compile_threads:
        return max(1, min(config.compile_threads, MAX_WORKERS))
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:  # torchrun: the ranks on this machine share its cores
        cores //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        pass
    return max(1, min(cores, MAX_WORKERS))


def start(target: tuple | None = None) -> bool:
    """Start the workers (in the background) if they can help: a GPU (or a `target`, as
    (backend, arch, warp size), to compile for), more than one worker allowed. True if a pool
    is running."""
    global _pool, _unavailable
    if _pool is not None:
        return True
    if _unavailable or worker_count() <= 1:
        return False
    with _lock:
        if _pool is None and not _unavailable:
            try:
                _pool = _Pool(worker_count(), target or _target())
            except Exception as err:  # noqa: BLE001 — no pool: kernels compile where they launch
                _unavailable = f"{type(err).__name__}: {err}"
                logs.log("cache", "no Triton compile workers: %s", _unavailable)
    return _pool is not None


def submit(key: str, path: str, module_name: str, fn_name: str, args: list, options: dict) -> Future | None:
    """Compile `fn_name` of the kernel module at `path` for a launch with `args` (tensors as
    their dtypes) and `options`, in a worker. The same `key` is compiled once. None: no pool."""
    pool = _pool
    if pool is None:
        return None
    return pool.submit(key, (path, module_name, fn_name, portable_args(args), options, _triton_environment(),
                             _backend_hash(pool.target)))


def wait(future: Future) -> str:
    """Wait for a submitted compile: the worker's binary's cache hash ("" where there is none
    to use: the compile failed — only logged, the launch compiles again and raises the real
    error —, the pool was given up, or it hung and is given up now). A compile no worker has
    taken while none is ready yet (they are still starting: importing Triton and a warm-up
    compile, 4–5 s on a GPU host while Triton's binder still imported PyTorch) is taken back: "", and the launch compiles
    it in this process, which would otherwise wait idle."""
    pool = getattr(future, "pool", None)
    if pool is not None and not pool.ready_at and future.cancel():
        with _lock:
            pool.counts["taken_back"] += 1
            for key, queued in list(pool.futures.items()):  # (a later request is a new task)
                if queued is future:
                    del pool.futures[key]
        return ""
    while True:
        try:
            error, digest = future.result(timeout=_POLL_S)
            break
        except FutureTimeout:
            pass
        except Exception as err:  # noqa: BLE001 — a dead worker, a cancelled task: compile in-process
            error, digest = f"{type(err).__name__}: {err}", ""
            break
        if pool is None or pool.closed:
            return ""
        now = time.monotonic()
        started = getattr(future, "started", None)
        if started is not None and now - started > WAIT_S:
            _give_up(f"a compile ran for more than {WAIT_S:.0f} s", pool)
            return ""
        if started is None and now - pool.last_progress > WAIT_S:
            _give_up(f"no compile finished for {WAIT_S:.0f} s", pool)
            return ""
    if error:
        logs.log("cache", "a compile worker failed, the kernel compiles in-process: %s", error)
    return digest


def compile_progress(future: Future | None) -> tuple[bool, float | None, float | None] | None:
    """(done, seconds a worker has been compiling it so far or None while it is queued, seconds
    its compile took once it succeeded) of a submitted compile; (True, None, None) for none; None
    where the pool cannot be relied on to finish it — closed, no worker ready yet, a compile or a
    queue standing still past `WAIT_S`: `wait` decides then (taking it back, or giving up)."""
    if future is None:
        return True, None, None
    if future.done():
        return True, None, getattr(future, "took", None)
    pool = getattr(future, "pool", None)
    if pool is None or pool.closed or not pool.ready_at:
        return None
    now = time.monotonic()
    started = getattr(future, "started", None)
    if (started is not None and now - started > WAIT_S) or (started is None and now - pool.last_progress > WAIT_S):
        return None
    return False, (None if started is None else now - started), None


def launched(expected: str, compiled) -> None:
    """Count whether a first launch used the binary its worker compiled (`expected`, a cache
    hash) — a miss means the launch compiled it again: the two keys differ."""
    pool = _pool
    digest = str(getattr(compiled, "hash", ""))
    if pool is None or not expected or not digest:
        return
    found = digest == expected
    with _lock:
        pool.counts["found" if found else "missed"] += 1
        useless = pool.counts["missed"] >= GIVE_UP_AFTER and not pool.counts["found"]
    if not found:
        logs.log("cache", "a first launch did not find its worker's binary (%s, worker %s): compiled again",
                 digest[:16], expected[:16])
    if useless:  # the workers' keys are not this process's: their work is wasted, stop it
        _give_up(f"{GIVE_UP_AFTER} first launches and none found its worker's binary", pool)


def stats() -> dict:
    """How many kernels the workers compiled and failed, how many first launches found the
    worker's binary and missed it, how many compiles were taken back (compiled where they
    launched: no worker was ready), how many are queued; how the workers started
    ("forked" from one process, or "spawned" one by one), the seconds from the pool's start
    to its first and last worker's readiness, and what a worker's start took."""
    pool = _pool
    if pool is None:
        return dict(_stopped_counts, workers=0, stopped=_unavailable)
    return dict(pool.counts, workers=len(pool.workers), queued=pool.tasks.qsize(), busy_s=round(pool.busy_s, 3),
                started=pool.started_as(), ready_s=pool.ready_s(), warm_up=pool.warm_up,
                imported_torch=pool.imported_torch)


def _give_up(why: str, pool: "_Pool | None") -> None:
    """No more workers in this process: queued compiles are cancelled (their launches compile
    in-process), the workers stopped."""
    global _pool, _unavailable, _stopped_counts
    if pool is None:
        return
    with _lock:
        if pool.closed:
            return
        pool.closed = True
        if _pool is pool:
            _pool, _unavailable, _stopped_counts = None, why, dict(pool.counts, busy_s=round(pool.busy_s, 3))
    logs.log("cache", "Triton compile workers stopped: %s", why)
    for future in list(pool.futures.values()):
        future.cancel()
    threading.Thread(target=pool.close, daemon=True).start()


def _backend_hash(target: tuple) -> str:
    """This process's Triton backend hash for `target` (part of every cache key)."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend

        return str(make_backend(GPUTarget(*target)).hash())
    except Exception:  # noqa: BLE001 — another Triton layout: the worker's own
        return ""


def _triton_environment() -> dict:
    env = {k: v for k, v in os.environ.items() if k.startswith("TRITON_")}
    try:  # the directory this process's Triton uses now, even if set in code rather than the environment
        import triton

        env["TRITON_CACHE_DIR"] = str(triton.knobs.cache.dir)
    except (ImportError, AttributeError):
        pass
    return env


def _target() -> tuple:
    from triton.runtime import driver

    target = driver.active.get_current_target()
    return (target.backend, target.arch, target.warp_size)


def _worker_command(target: tuple) -> list:
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_worker.py")
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []  # not the script's folder first on its path
    return [sys.executable, *safe_path, script, json.dumps(list(target))]


def _worker_environment() -> dict:
    """The workers' environment: this process's, with Triton's settings as they are now and
    one thread for the math libraries (a worker never computes with them, and a process with
    another thread running cannot fork its workers safely: OpenBLAS starts a thread per core
    when NumPy is imported)."""
    env = dict(os.environ)
    env.update(_triton_environment())
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def _can_fork() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def _start_forking(n: int, target: tuple, env: dict):
    """The process that forks `n` workers (`compile_worker._forked_workers`), and each worker's
    (task writer, reply reader)."""
    ours, theirs = [], []
    try:
        for _ in range(n):
            task_r, task_w = os.pipe()
            reply_r, reply_w = os.pipe()
            ours.append((task_w, reply_r))
            theirs.append((task_r, reply_w))
        pairs = ",".join(f"{r}:{w}" for r, w in theirs)
        proc = subprocess.Popen([*_worker_command(target), "--fork", pairs], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                start_new_session=True, pass_fds=[fd for pair in theirs for fd in pair])
    except BaseException:
        for task_w, reply_r in ours:
            os.close(task_w)
            os.close(reply_r)
        raise
    finally:
        for task_r, reply_w in theirs:
            os.close(task_r)
            os.close(reply_w)
    return proc, [(os.fdopen(task_w, "wb"), os.fdopen(reply_r, "rb")) for task_w, reply_r in ours]


class _Pool:
    def __init__(self, n: int, target: tuple):
        self.tasks: "queue.Queue" = queue.Queue()
        self.futures: dict[str, Future] = {}
        self.counts = {"compiled": 0, "failed": 0, "found": 0, "missed": 0, "taken_back": 0}
        self.busy_s = 0.0  # the workers' compile time, summed (against wall time: how busy the pool was)
        self.target = target
        self.closed = False
        self.last_progress = self.t0 = time.monotonic()
        self.ready_at: list = []  # seconds from the start to each worker's "ready"
        self.warm_up: dict = {}  # what a worker's start took (importing, the throwaway compile)
        self.imported_torch = False  # whether a worker had to import PyTorch for a task
        env = _worker_environment()
        self.alive = n
        self.workers: list = []
        self.forking = None  # the process the workers were forked from, if they were
        channels = [None] * n
        if _can_fork():
            try:
                self.forking, channels = _start_forking(n, target, env)
            except OSError as err:
                logs.log("cache", "Triton compile workers not forked (%s): each starts alone", err)
        try:
            for channel in channels:
                self.workers.append(_Worker(self, env, channel))
        except BaseException:
            self.alive = len(self.workers)
            self.close()
            raise
        atexit.register(self.close)

    def started_as(self) -> str:
        spawned = sum(1 for w in self.workers if w.proc is not None)
        return "forked" if not spawned else "spawned" if spawned == len(self.workers) else "forked and spawned"

    def ready_s(self) -> list:
        """Seconds from the pool's start to its first and its last worker's "ready"."""
        return [round(min(self.ready_at), 3), round(max(self.ready_at), 3)] if self.ready_at else []

    def submit(self, key: str, task: tuple) -> Future:
        with _lock:
            future = self.futures.get(key)
            if future is None:
                future = self.futures[key] = Future()
                future.pool, future.started = self, None
                if self.alive and not self.closed:
                    self.tasks.put((future, task))
                else:
                    future.set_exception(RuntimeError("no compile worker left"))
        return future

    def worker_exited(self, why: str) -> None:
        """A worker stopped; with the last one gone, queued compiles fail (their kernels compile
        where they launch) and no pool is started again."""
        if why:
            logs.log("cache", "a Triton compile worker stopped: %s", why)
        with _lock:
            self.alive -= 1
            last = self.alive <= 0
        if not last:
            return
        if why:
            _give_up(f"every compile worker stopped (last: {why})", self)
        while True:
            try:
                item = self.tasks.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[0].set_running_or_notify_cancel():
                item[0].set_exception(RuntimeError("no compile worker left"))

    def close(self) -> None:
        self.closed = True
        for w in self.workers:
            w.close_input()
        for w in self.workers:
            w.stop()
        if self.forking is not None:  # its workers end as their inputs close, then it does
            try:
                self.forking.wait(timeout=2)
            except subprocess.TimeoutExpired:
                try:  # (a hung worker: it and its siblings are in the forking process's group)
                    os.killpg(self.forking.pid, signal.SIGKILL)
                except OSError:
                    pass
                self.forking.wait()


class _Worker:
    """One worker, served by a thread of this process: `channel` is the (task writer, reply
    reader) of a forked worker, None to start a process of its own."""

    def __init__(self, pool: _Pool, env: dict, channel=None):
        self.pool, self.env = pool, env
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        if channel is None:
            self._spawn()
        else:
            self.tasks_out, self.replies = channel
        self.current: Future | None = None
        self.thread = threading.Thread(target=self._serve, name="tilefuse-compile-worker", daemon=True)
        self.thread.start()

    def _spawn(self) -> None:
        self.proc = subprocess.Popen(_worker_command(self.pool.target), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=self.env, start_new_session=True)
        self.tasks_out, self.replies, self.pid = self.proc.stdin, self.proc.stdout, self.proc.pid

    def _serve(self) -> None:
        why = "stopped"
        try:
            why = self._run()
        except BaseException as err:  # noqa: BLE001 — whatever broke, the task in hand must complete
            why = f"{type(err).__name__}: {err}"
        finally:
            future, self.current = self.current, None
            if future is not None and not future.done():
                future.set_exception(RuntimeError(f"compile worker lost: {why}"))
            self.pool.worker_exited(why)

    def _run(self) -> str:
        """Serve tasks until the pool closes ("") or this worker fails (why)."""
        try:
            ready = read_message(self.replies)
            if ready is not None and ready[2].startswith(FORK_REFUSED):
                logs.log("cache", "a Triton compile worker starts alone: %s", ready[2])
                self._close_channel()
                self._spawn()
                if self.pool.closed:  # (closed meanwhile: its `stop` did not see this process)
                    self.close_input()
                    self.stop()
                    return ""
                ready = read_message(self.replies)
        except Exception as err:  # noqa: BLE001 — a worker that cannot start
            return f"did not start: {type(err).__name__}: {err}"
        if ready is None or ready[2]:
            return f"did not start: {ready[2] if ready else 'exited'}"
        self.pid = ready[1] or self.pid
        with _lock:
            self.pool.ready_at.append(time.monotonic() - self.pool.t0)
            self.pool.warm_up = ready[3] if len(ready) > 3 else {}
        n = 0
        while True:
            try:
                item = self.pool.tasks.get(timeout=1.0)
            except queue.Empty:
                if self.pool.closed:
                    return ""
                if _ended(self.replies):  # (an idle worker writes nothing: this is its end)
                    return f"exited ({self.proc.poll() if self.proc is not None else 'forked worker'})"
                continue
            if item is None or self.pool.closed:
                return ""
            future, task = item
            if not future.set_running_or_notify_cancel():
                continue
            n += 1
            self.current, future.started = future, time.monotonic()
            write_message(self.tasks_out, (n,) + task)
            reply = read_message(self.replies)
            if reply is None:
                return f"exited ({self.proc.poll() if self.proc is not None else 'forked worker'})"
            self.current = None
            error = reply[2]
            took = time.monotonic() - future.started
            with _lock:
                self.pool.imported_torch = self.pool.imported_torch or bool(reply[4:5] and reply[4])
                self.pool.counts["failed" if error else "compiled"] += 1
                self.pool.busy_s += took
                self.pool.last_progress = time.monotonic()
            future.took = None if error else took  # (a failed compile says nothing of how long one takes)
            future.set_result((error, reply[3]))
            logs.log("cache", "compile worker: %s in %.2f s", task[2], took)

    def close_input(self) -> None:
        try:
            self.tasks_out.close()
        except OSError:
            pass

    def _close_channel(self) -> None:
        for stream in (self.tasks_out, self.replies):
            try:
                stream.close()
            except OSError:
                pass

    def stop(self) -> None:
        if self.proc is None:  # forked: ends with its input (the pool waits for the forking process)
            return
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _ended(stream) -> bool:
    """Whether an idle worker's reply pipe has something to read (its end of file) or has
    hung up. (`poll`, not `select`: a process may hold more than 1024 descriptors.)"""
    if stream.closed:
        return True
    poller = select.poll()
    poller.register(stream.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(0))


__all__ = ["start", "submit", "wait", "compile_progress", "launched", "stats", "worker_count", "MAX_WORKERS", "WAIT_S"]
