"""Triton kernels compiled ahead of their first launch, in worker processes.

Compiling one Triton kernel (LLVM, ptxas, the launch stub) costs 0.3–1.5 s of CPU in the
process that first launches it; a graph's kernels and tuning candidates compiled one after
another were most of a cold compile. `submit` hands a kernel to a pool of worker processes
(`compile_worker`) that compile it into Triton's on-disk cache; the kernel's first launch
waits for its task (`wait`), and Triton then loads the binary from disk instead of compiling.

Workers run `compile_worker.py` as a script (not `multiprocessing`, whose spawned children
re-run the user's script; not `-m`, which would import all of tilefuse and put the current
directory first on their path), start when the first graph that can use them is compiled, and
live until this process exits. They never create a CUDA context (see `compile_worker`). Each
compiles a throwaway kernel before it reports ready (`compile_worker.prime`), so that loading
Triton's compiler (0.4–0.9 s) is paid while the graph is traced, not by its first kernel.
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
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from ... import logs
from ...config import config
from .compile_worker import read_message, write_message

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
    return pool.submit(key, (path, module_name, fn_name, args, options, _triton_environment(),
                             _backend_hash(pool.target)))


def wait(future: Future) -> str:
    """Wait for a submitted compile: the worker's binary's cache hash ("" where there is none
    to use: the compile failed — only logged, the launch compiles again and raises the real
    error —, the pool was given up, or it hung and is given up now)."""
    pool = getattr(future, "pool", None)
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
    worker's binary and missed it, and how many compiles are queued."""
    pool = _pool
    if pool is None:
        return dict(_stopped_counts, workers=0, stopped=_unavailable)
    return dict(pool.counts, workers=len(pool.workers), queued=pool.tasks.qsize(), busy_s=round(pool.busy_s, 3))


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


def _worker_command() -> list:
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_worker.py")
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []  # not the script's folder first on its path
    return [sys.executable, *safe_path, script]


class _Pool:
    def __init__(self, n: int, target: tuple):
        self.tasks: "queue.Queue" = queue.Queue()
        self.futures: dict[str, Future] = {}
        self.counts = {"compiled": 0, "failed": 0, "found": 0, "missed": 0}
        self.busy_s = 0.0  # the workers' compile time, summed (against wall time: how busy the pool was)
        self.target = target
        self.closed = False
        self.last_progress = time.monotonic()
        env = dict(os.environ)
        env.update(_triton_environment())
        self.alive = n
        self.workers: list = []
        try:
            for _ in range(n):
                self.workers.append(_Worker(self, env))
        except BaseException:
            self.alive = len(self.workers)
            self.close()
            raise
        atexit.register(self.close)

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


class _Worker:
    def __init__(self, pool: _Pool, env: dict):
        self.pool = pool
        self.proc = subprocess.Popen(_worker_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env, start_new_session=True)
        self.current: Future | None = None
        self.thread = threading.Thread(target=self._serve, name="tilefuse-compile-worker", daemon=True)
        self.thread.start()

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
            write_message(self.proc.stdin, {"target": self.pool.target})
            ready = read_message(self.proc.stdout)
        except Exception as err:  # noqa: BLE001 — a worker that cannot start
            return f"did not start: {type(err).__name__}: {err}"
        if ready is None or ready[2]:
            return f"did not start: {ready[2] if ready else 'exited'}"
        n = 0
        while True:
            try:
                item = self.pool.tasks.get(timeout=1.0)
            except queue.Empty:
                if self.pool.closed:
                    return ""
                if self.proc.poll() is not None:
                    return f"exited ({self.proc.returncode})"
                continue
            if item is None or self.pool.closed:
                return ""
            future, task = item
            if not future.set_running_or_notify_cancel():
                continue
            n += 1
            self.current, future.started = future, time.monotonic()
            write_message(self.proc.stdin, (n,) + task)
            reply = read_message(self.proc.stdout)
            if reply is None:
                return f"exited ({self.proc.poll()})"
            self.current = None
            error = reply[2]
            took = time.monotonic() - future.started
            with _lock:
                self.pool.counts["failed" if error else "compiled"] += 1
                self.pool.busy_s += took
                self.pool.last_progress = time.monotonic()
            future.set_result((error, reply[3]))
            logs.log("cache", "compile worker: %s in %.2f s", task[2], took)

    def close_input(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def stop(self) -> None:
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()


__all__ = ["start", "submit", "wait", "launched", "stats", "worker_count", "MAX_WORKERS", "WAIT_S"]
