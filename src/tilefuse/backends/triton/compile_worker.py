"""Worker processes that compile Triton kernels into Triton's on-disk cache.

Started by `compile_pool` as a script, never by a user. On Linux one process imports Triton,
warms the compiler up, and forks the workers, each serving a pair of pipes it inherited
(`_forked_workers`); elsewhere, or where forking is refused, each worker is a process of its
own serving its stdin and stdout (fd 1 is then pointed at stderr, so a print in Triton or a
kernel cannot corrupt the replies). A worker first replies "ready" (with the seconds its
start took), then reads tasks and writes one reply per task. Every message is a
length-prefixed pickle between a worker and the process that started the pool, over the
worker's own pipes.

A task names a generated kernel module by its file, the kernel, its launch arguments (a
tensor as its dtype's name, `portable_args`), options and the parent's `TRITON_*`
environment; the worker runs `JITFunction.warmup`, which compiles exactly what the first
launch in the parent would compile, builds the launch stub, and replies with the binary's
cache hash (the parent checks that its launch found that binary). The worker never touches
the GPU: Triton's driver is wrapped to report the parent's target (architecture and warp
size) instead of asking the device, so a worker creates no CUDA context.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pickle
import struct
import sys
import time

_HEADER = struct.Struct("<Q")
#: how a "ready" reply says the process that would fork refused to (the worker starts alone)
FORK_REFUSED = "fork refused"
#: how a task names a tensor argument's dtype: (DTYPE, "bfloat16") — plain data, so that a
#: worker reads its tasks without importing PyTorch (`portable_args`)
DTYPE = "tilefuse-dtype"


def read_message(stream):
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(head)
    return pickle.loads(stream.read(n))


def write_message(stream, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


class _TargetOnlyDriver:
    """The active Triton driver, but answering the device questions of a compile (which
    device, which stream, which target) from the parent's answers, without CUDA."""

    def __init__(self, target):
        self._target = target

    def __getattr__(self, name):  # anything else: the real driver (absent on a machine without a GPU)
        from triton.runtime import driver

        return getattr(driver.default, name)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self._target


_target = None


def _install_target(target: tuple) -> None:
    global _target
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    _target = GPUTarget(*target)
    driver.set_active(_TargetOnlyDriver(_target))


_modules: dict = {}


def _kernel(path: str, module_name: str, fn_name: str):
    module = _modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # Triton reads the function's globals through its module
        spec.loader.exec_module(module)
        _modules[module_name] = module
    return getattr(module, fn_name)


def _match_environment(env: dict) -> None:
    """Triton's environment variables as the parent has them now (they are part of a compile's
    cache key, and a library may have set some after this worker started)."""
    for name in [k for k in os.environ if k.startswith("TRITON_") and k not in env]:
        del os.environ[name]
    os.environ.update(env)


def _match_backend(backend_hash: str) -> None:
    """The backend's part of the cache key as the parent has it. It holds the ptxas version the
    parent's Triton read once, at its first compile: a library that set `TRITON_PTXAS_PATH` since
    (TorchInductor does) changed the ptxas the parent compiles with but not that version, so the
    parent's key is not what a fresh process computes. The binary is built by the ptxas the
    parent would use now (the environment above), under the key the parent will look up."""
    if not backend_hash:
        return
    from triton.compiler.compiler import make_backend

    backend = make_backend(_target)
    if backend.hash() != backend_hash:
        type(backend).hash = lambda self, _h=backend_hash: _h


def _builds_launch_stubs() -> bool:
    """Triton before 3.9 compiles a C launch stub per kernel signature when a launcher is made;
    3.9 launches through its driver's own module (making a launcher would only start the real
    driver, which initialises CUDA, in this process)."""
    import triton

    try:
        major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) < (3, 9)


def portable_args(args: list) -> list:
    """A launch's arguments as a task carries them: each PyTorch dtype (a tensor argument) as
    (DTYPE, its name), everything else as it is."""
    return [(DTYPE, str(a).rsplit(".", 1)[-1]) if type(a).__name__ == "dtype" and type(a).__module__ == "torch"
            else a for a in args]


class _DtypeStandIn:
    """A PyTorch dtype as Triton's specialisation reads it (its name: `torch.bfloat16`), in a
    process that has not imported PyTorch (importing it took 3–5 s of a worker's start on an
    H200 host, against 0.6 s for Triton)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"

    __repr__ = __str__

    def __hash__(self) -> int:
        return hash(("torch", self.name))

    def __eq__(self, other) -> bool:
        return isinstance(other, _DtypeStandIn) and other.name == self.name


def _tensor_of(name: str):
    """What `warmup` takes for a tensor of dtype `name`: Triton's `MockTensor` of a stand-in
    dtype, or (a Triton without it) PyTorch's dtype."""
    try:
        from triton.runtime.jit import MockTensor
    except ImportError:
        import torch

        return getattr(torch, name)
    return MockTensor(_DtypeStandIn(name))


def _launch_args(args: list) -> list:
    return [_tensor_of(a[1]) if isinstance(a, tuple) and len(a) == 2 and a[0] == DTYPE else a for a in args]


def _build_launch_stub(compiled) -> None:
    """Triton before 3.9: the kernel signature's C launch stub (an extension cached on disk),
    built by the backend's launcher class — taken from its module for CUDA, since the active
    driver's would start the real driver (which imports PyTorch)."""
    launcher_cls = None
    if _target is not None and _target.backend == "cuda":
        try:
            from triton.backends.nvidia.driver import CudaLauncher as launcher_cls
        except ImportError:
            pass
    if launcher_cls is None:
        from triton.runtime import driver

        launcher_cls = driver.active.launcher_cls
    launcher_cls(compiled.src, compiled.metadata)


def compile_kernel(path: str, module_name: str, fn_name: str, args: list, options: dict, env: dict,
                   backend_hash: str = "") -> str:
    """Compile the kernel for a launch with `args` (`portable_args`) and `options`; its Triton
    cache hash."""
    _match_environment(env)
    _match_backend(backend_hash)
    fn = _kernel(path, module_name, fn_name)
    compiled = fn.warmup(*_launch_args(args), grid=(1,), **options)
    if _builds_launch_stubs():
        try:
            _build_launch_stub(compiled)
        except Exception:  # noqa: BLE001 — an optimisation: the parent builds it at its first launch
            pass
    return str(getattr(compiled, "hash", ""))


_PRIMER = """
import triton
import triton.language as tl


@triton.jit
def tilefuse_primer(x, y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + i, mask=i < n, other=0.0)
    tl.store(y + i, v * 2.0 + tl.sum(v, 0), mask=i < n)
"""


def prime() -> str:
    """Compile a tiny kernel into a throwaway cache: a process's first Triton compile pays
    for loading the compiler (MLIR, LLVM, the backend's passes) — 0.4–0.9 s of a first task on
    an H200 host, against 0.05 s for the same kernel compiled next — so that no real kernel
    waits for it. "" when it compiled, else why not (ignored: the first real task pays instead)."""
    import shutil
    import tempfile

    # the primer's binary, dumps and overrides in a folder of its own, on the plain file cache
    # (not a cache manager or remote cache the user configured)
    names = ("TRITON_CACHE_DIR", "TRITON_DUMP_DIR", "TRITON_OVERRIDE_DIR", "TRITON_CACHE_MANAGER",
             "TRITON_REMOTE_CACHE_BACKEND", "TRITON_KERNEL_DUMP", "TRITON_KERNEL_OVERRIDE")
    saved = {name: os.environ.get(name) for name in names}
    folder = None
    try:
        folder = tempfile.mkdtemp(prefix="tilefuse-primer-")
        for name in names:
            os.environ.pop(name, None)
        os.environ["TRITON_CACHE_DIR"] = os.path.join(folder, "cache")
        path = os.path.join(folder, "tilefuse_primer.py")
        with open(path, "w") as f:
            f.write(_PRIMER)
        fn = _kernel(path, "tilefuse_primer", "tilefuse_primer")
        fn.warmup(_tensor_of("float32"), _tensor_of("float32"), 1000, BLOCK=1024, grid=(1,))
        return ""
    except Exception as err:  # noqa: BLE001 — only an optimisation
        return f"{type(err).__name__}: {err}"
    finally:
        _modules.pop("tilefuse_primer", None)
        sys.modules.pop("tilefuse_primer", None)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def _threads() -> int:
    """This process's native threads (Python's and any library's)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0  # unknown: not forked


def _keep_torch_out() -> bool:
    """Before Triton 3.9 the argument binder (native code) imports PyTorch at its first call, to
    know PyTorch's tensor type: 4–5 s of the workers' start on an H100 host, for a type no task
    passes (a task's tensors are Triton's `MockTensor`s). A worker on such a Triton that has not
    imported PyTorch marks it absent, as on a machine without it: the binder reads `MockTensor`
    as before and keys the binary the same (`tests/backends/test_compile_pool.py`). Triton 3.9
    looks PyTorch up without importing it (and fails on a module marked absent): left alone, as
    is a Triton without `MockTensor`, whose tasks need PyTorch's dtypes. True if marked."""
    if "torch" in sys.modules or not _builds_launch_stubs() or _target is None or _target.backend != "cuda":
        return False  # (elsewhere the launch stubs come from the real driver, which imports it)
    try:
        from triton.runtime.jit import MockTensor  # noqa: F401
    except ImportError:
        return False
    sys.modules["torch"] = None  # (`import torch` now raises ImportError in this process)
    return True


def _has_torch() -> bool:
    return sys.modules.get("torch") is not None


def _prepare(target, took: dict) -> str:
    """Import Triton, answer device questions with `target`, keep PyTorch out
    (`_keep_torch_out`), warm the compiler up; the seconds of each step in `took`. "" when
    ready, else why not."""
    t0 = time.perf_counter()
    try:
        import triton  # noqa: F401 — (not PyTorch: a task's dtypes are names, the driver is ours)

        _install_target(target)
        kept_out = _keep_torch_out()
    except Exception as err:  # noqa: BLE001 — the parent compiles in-process instead
        return f"{type(err).__name__}: {err}"
    t1 = time.perf_counter()
    why = prime()
    retried = bool(why) and kept_out
    if retried:  # (a Triton that needs PyTorch after all: as before, with it)
        sys.modules.pop("torch", None)
        why = prime()
    if why:  # (on stderr, not an error: the first real task pays instead)
        print(f"tilefuse compile worker: warm-up compile failed: {why}", file=sys.stderr)
    took.update(import_s=round(t1 - t0, 3), prime_s=round(time.perf_counter() - t1, 3),
                imported_torch=_has_torch(), kept_torch_out=kept_out and not retried, retried=retried)
    return ""


def serve(tasks, replies) -> int:
    """Compile tasks from `tasks` until it closes, one reply each on `replies`."""
    while True:
        task = read_message(tasks)
        if task is None:
            return 0
        task_id, path, module_name, fn_name, args, options, env, backend_hash = task
        t0 = time.perf_counter()
        digest = ""
        try:
            digest = compile_kernel(path, module_name, fn_name, args, options, env, backend_hash)
            error = ""
        except Exception as err:  # noqa: BLE001 — reported; the parent compiles it itself
            error = f"{type(err).__name__}: {err}"[:2000]
        write_message(replies, (task_id, time.perf_counter() - t0, error, digest, _has_torch()))


def _forked_workers(target, pairs: list) -> int:
    """Prepare once, then fork one worker per (task fd, reply fd) pair: each inherits the
    imported and warmed-up compiler instead of importing it itself (16 processes importing
    PyTorch at once took 4–6 s on an H200 host, one 1.5–2). This process then only waits for
    its workers. Forking is refused — each worker's thread in the parent then starts a process
    of its own — when another thread runs here (a child gets only the forking thread, and any
    lock another one held) or a fork fails."""
    for fd in (fd for pair in pairs for fd in pair):  # (not passed on to ptxas and the like)
        os.set_inheritable(fd, False)
    took: dict = {}
    why = _prepare(target, took)
    threads = _threads()
    if not why and threads != 1:
        why = f"{FORK_REFUSED}: {threads} threads in the process that would fork"
    if why:
        _refuse(pairs, why, took)
        return 1
    children = []
    for k, (task_fd, reply_fd) in enumerate(pairs):
        try:
            pid = os.fork()
        except OSError as err:
            _refuse(pairs[k:], f"{FORK_REFUSED}: {type(err).__name__}: {err}", took)
            break
        if pid == 0:  # a worker: only its own pair open (the earlier ones are closed here already)
            code = 1
            try:
                for other in pairs[k + 1:]:
                    os.close(other[0])
                    os.close(other[1])
                replies = os.fdopen(reply_fd, "wb")
                write_message(replies, ("ready", os.getpid(), "", took))
                code = serve(os.fdopen(task_fd, "rb"), replies)
            finally:
                os._exit(code)
        children.append(pid)
        os.close(task_fd)
        os.close(reply_fd)
    for _ in children:
        try:
            os.wait()
        except ChildProcessError:
            break
    return 0


def _refuse(pairs: list, why: str, took: dict) -> None:
    """Say `why` as the "ready" reply on each pair, and close them."""
    for task_fd, reply_fd in pairs:
        try:
            with os.fdopen(reply_fd, "wb") as replies:
                write_message(replies, ("ready", None, why, took))
        except OSError:
            pass
        os.close(task_fd)


def main(argv: list) -> int:
    """`compile_worker.py TARGET` serves on stdin/stdout; `compile_worker.py TARGET --fork
    T:R,T:R,...` forks a worker per pair of inherited pipes (`_forked_workers`). TARGET is the
    JSON list (backend, arch, warp size)."""
    target = tuple(json.loads(argv[1]))
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, not into the replies
    if len(argv) > 3 and argv[2] == "--fork":
        replies.close()
        pairs = [tuple(int(fd) for fd in pair.split(":")) for pair in argv[3].split(",")]
        return _forked_workers(target, pairs)
    took: dict = {}
    why = _prepare(target, took)
    write_message(replies, ("ready", os.getpid(), why, took))
    return 1 if why else serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
