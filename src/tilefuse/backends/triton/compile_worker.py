"""A worker process that compiles Triton kernels into Triton's on-disk cache.

Started by `compile_pool` as `python -m tilefuse.backends.triton.compile_worker`, never by a
user. It reads tasks from stdin and writes one reply per task to the stdout it was started
with (fd 1 is then pointed at stderr, so a print in Triton or a kernel cannot corrupt the
replies). Every message is a length-prefixed pickle between this process and the one that
started it, over its own pipes.

A task names a generated kernel module by its file, the kernel, its launch arguments (tensors
as their dtypes), options and the parent's `TRITON_*` environment; the worker runs
`JITFunction.warmup`, which compiles exactly what the first launch in the parent would compile,
builds the launch stub, and replies with the binary's cache hash (the parent checks that its
launch found that binary). The worker never
touches the GPU: Triton's driver is wrapped to report the parent's target (architecture and
warp size) instead of asking the device, so a worker creates no CUDA context.
"""
from __future__ import annotations

import importlib.util
import os
import pickle
import struct
import sys
import time

_HEADER = struct.Struct("<Q")


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


def compile_kernel(path: str, module_name: str, fn_name: str, args: list, options: dict, env: dict,
                   backend_hash: str = "") -> str:
    """Compile the kernel for a launch with `args` and `options`; its Triton cache hash."""
    _match_environment(env)
    _match_backend(backend_hash)
    fn = _kernel(path, module_name, fn_name)
    compiled = fn.warmup(*args, grid=(1,), **options)
    if _builds_launch_stubs():  # the launch stub (a C extension per signature, cached on disk) too
        try:
            from triton.runtime import driver

            driver.active.launcher_cls(compiled.src, compiled.metadata)
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

    import torch

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
        fn.warmup(torch.float32, torch.float32, 1000, BLOCK=1024, grid=(1,))
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


def main() -> int:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, not into the replies
    tasks = sys.stdin.buffer
    first = read_message(tasks)
    if first is None:
        return 0
    try:
        import torch  # noqa: F401 — Triton's driver and `warmup`'s dtypes are PyTorch's

        _install_target(first["target"])
        why = prime()
        if why:  # (on stderr, which the parent's log shows when a worker fails)
            print(f"tilefuse compile worker: warm-up compile failed: {why}", file=sys.stderr)
        write_message(replies, ("ready", None, ""))
    except Exception as err:  # noqa: BLE001 — the parent compiles in-process instead
        write_message(replies, ("ready", None, f"{type(err).__name__}: {err}"))
        return 1
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
        write_message(replies, (task_id, time.perf_counter() - t0, error, digest))


if __name__ == "__main__":
    raise SystemExit(main())
