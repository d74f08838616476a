"""Loading and launching generated C++ kernels.

The shared library is built through the disk cache (namespace "cpu", keyed by the source, the
compiler's version and flags, this CPU's ISA and the environment fingerprint), so a warm cache
compiles nothing, and is loaded in place with ctypes. Builds run in a thread pool
(`TILEFUSE_COMPILE_THREADS` compiler processes at once): `load_kernel` starts the build and
returns at once, the kernel waits for its library when it is first launched or `wait()`ed
(the compiler waits for every kernel of a graph before returning it, so a failed build is a
compile error). A launch passes the buffers' data
pointers (no copies: strides are kernel arguments), the size arguments, the grid and the
thread count PyTorch uses. A kernel with index checks also gets an error word (after the
buffers' pointers); a failed check leaves its number there, and the launch raises the error
eager raises for that op once the kernel has returned (no out-of-range element was read).

One kernel may run in several threads at once (ctypes releases the GIL during the call): a
launch's pointer, size and error arrays are built for that launch; what launches share (the
grid and size arguments per set of sizes, a bounded `SizeCache`) is only read.

A kernel with little work runs on one thread: one without a `dot` whose buffers hold at most
`SERIAL_MAX_BYTES` (a LayerNorm over 64 rows of 64, a decode step's RoPE) costs less than
waking a second thread and waiting for it at the end — on a loaded machine, where that thread
may not be running, several times less (as Inductor leaves loops of fewer than
`cpp.min_chunk_size` elements per thread serial). A grid smaller than the thread pool wakes
only as many threads as it has programs.

Large buffers a kernel writes are advised to use transparent huge pages first (Linux, when
THP is in `madvise` mode): a freshly allocated output is faulted in by the kernel's own
stores, and 2 MiB pages make that first touch several times cheaper than 4 KiB ones (on a
64 MiB output, a large share of a memory-bound kernel's time). The advice changes no value.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from ... import logs
from ...config import config
from ...ir import symbolic
from ...cache import scratch
from ...cache.disk import DiskCache
from ..inline_call import SKIP, Buf, Expect, InlineCall
from ..size_cache import SizeCache, size_key
from ...ir.bounds import index_error
from ...tile.ir import DotTile, TileKernel, check_message, checks_of, statements
from . import fast_call, toolchain
from .codegen import RANGE_SUFFIX

_lock = threading.Lock()
# build key -> the library (being) built, while a kernel (or the build itself) holds it: a
# graph that is dropped (a recompile, `torch._dynamo.reset()`) leaves no entry behind
_libraries: "weakref.WeakValueDictionary[str, Future]" = weakref.WeakValueDictionary()
_caches: dict[str, DiskCache] = {}
_pools: dict[int, ThreadPoolExecutor] = {}


#: a kernel without a dot whose buffers hold at most this many bytes in all runs on one thread
SERIAL_MAX_BYTES = 64 << 10

#: buffers at least this large that a kernel writes get the huge-page advice
HUGE_PAGE_MIN_BYTES = 4 << 20
_HUGE = 1 << 21
_MADV_HUGEPAGE = 14


@functools.lru_cache(maxsize=None)
def _madvise():
    """libc's `madvise` when transparent huge pages are in `madvise` mode, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[madvise]" not in f.read():
                return None
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(t: torch.Tensor) -> None:
    """Ask for huge pages over the 2 MiB-aligned part of a large tensor's storage."""
    madvise = _madvise()
    n = t.untyped_storage().nbytes()
    if madvise is None or n < HUGE_PAGE_MIN_BYTES:
        return
    p = t.untyped_storage().data_ptr()
    start, end = (p + _HUGE - 1) & ~(_HUGE - 1), (p + n) & ~(_HUGE - 1)
    if end > start:
        madvise(start, end - start, _MADV_HUGEPAGE)


def kernel_cache() -> DiskCache:
    root = config.cache_dir
    cache = _caches.get(root)
    return cache if cache is not None else _caches.setdefault(root, DiskCache("cpu", root))


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's pool threads: it starts its own pool, and
    builds the parent had in flight are asked for again (finished ones stay loaded)."""
    global _lock
    _lock = threading.Lock()
    _pools.clear()
    for key, future in list(_libraries.items()):
        if not future.done():
            del _libraries[key]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _pool() -> ThreadPoolExecutor:
    workers = config.compile_threads or os.cpu_count() or 1
    with _lock:
        if workers not in _pools:
            _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix="tilefuse-cxx")
        return _pools[workers]


def library_future(source: str) -> Future:
    """The shared library of `source`, built (or read from the cache) in the build pool; one
    build per source while any kernel holds it, however many kernels ask for it (the loaded
    code itself stays mapped: ctypes never unloads a library)."""
    cxx = toolchain.require_compiler()
    key = toolchain.build_key(source, cxx)
    cache, pool = kernel_cache(), _pool()
    with _lock:
        future = _libraries.get(key)
        if future is not None:
            return future
        future = _libraries[key] = pool.submit(_build_and_load, cache, key, source, cxx)
    # outside the lock: a build that has already failed runs the callback here at once
    future.add_done_callback(lambda f: f.exception() is not None and _forget(key, f))
    return future


def _forget(key: str, future: Future) -> None:
    """A failed build is not remembered: the next request tries again."""
    with _lock:
        if _libraries.get(key) is future:
            del _libraries[key]


def _build_and_load(cache: DiskCache, key: str, source: str, cxx: str) -> ctypes.CDLL:
    files = cache.get_or_create(key, lambda: {"kernel.cpp": source.encode(),
                                               "kernel.so": toolchain.build(source, cxx)})
    entry = cache.path_of(key)
    if entry is not None:
        try:
            return ctypes.CDLL(os.path.join(entry, "kernel.so"))
        except OSError:  # evicted or cleared since it was checked: the bytes are in hand
            pass
    with scratch.private_copy(files["kernel.so"], ".so") as path:  # deleted once loaded
        return ctypes.CDLL(path)


class CppKernel:
    """A launchable kernel with the Triton launcher's interface: `launch(buffers, env)`."""

    def __init__(self, kernel: TileKernel, source: str):
        self.kernel = kernel
        self.source = source
        self._library = library_future(source)  # built in the background
        self._fn = None
        self._range = None  # the address of its `<name>__programs`, once loaded
        self.buffers = [p.name for p in kernel.params if p.kind == "buffer"]
        self.sizes = []  # ("stride", buffer, dim) | ("size", name, None)
        for p in kernel.params:
            if p.kind == "buffer":
                continue
            if "_stride" in p.name and p.name.rsplit("_stride", 1)[1].isdigit():
                buf, k = p.name.rsplit("_stride", 1)
                self.sizes.append(("stride", buf, int(k)))
            else:
                self.sizes.append(("size", p.name, None))
        self._shapes = SizeCache()  # size_key(env) -> _shape(env)
        self.checks = checks_of(kernel.body)
        self._ptrs_array = ctypes.c_void_p * max(1, len(self.buffers) + bool(self.checks))
        self._sizes_array = ctypes.c_int64 * max(1, len(self.sizes))
        self._written = [name for name in self.buffers if name in set(kernel.writes)]
        # (a dot's work grows faster than its operands' bytes: those kernels keep their threads)
        self._may_serialise = not any(isinstance(st, DotTile) for st in statements(kernel.body))

    def _threads_for(self, buffers: dict, programs: int) -> int:
        """The programs a launch spreads over threads: all of them, or 1 for little work."""
        if programs > 1 and self._may_serialise:
            if sum(buffers[name].nbytes for name in self.buffers) <= SERIAL_MAX_BYTES:
                return 1
        return programs

    def __tilefuse_reduce__(self):  # a stored graph rebuilds it (`runtime.artifact`)
        return self.kernel, self.source

    def wait(self) -> "CppKernel":
        """Block until the kernel's library is built and loaded (raises its build error)."""
        if self._fn is None:
            # `lib[name]`, not `getattr`: a function object of this kernel's own, typed here
            # before it is published (getattr's is shared by every kernel of the library)
            fn = self._library.result()[self.kernel.name]
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32]
            try:  # (its address only: `fast_call.run_steps` calls it)
                self._range = ctypes.cast(self._library.result()[self.kernel.name + RANGE_SUFFIX], ctypes.c_void_p).value
            except AttributeError:
                self._range = None
            self._fn = fn
        return self

    @property
    def fn(self):
        return self.wait()._fn

    def _shape(self, env: dict) -> tuple:
        """(size arguments by name, grid, emptiness, programs) for one set of sizes."""
        values = {name: int(symbolic.evaluate(_symbol(name), env)) for kind, name, _ in self.sizes if kind == "size"}
        empty = int(symbolic.evaluate(self.kernel.numel, env)) == 0
        grid = self.kernel.grid_size(env)
        if len(grid) > 3:
            raise RuntimeError(f"{self.kernel.name}: grids of more than 3 dims")
        programs = grid[0] * (grid[1] if len(grid) > 1 else 1) * (grid[2] if len(grid) > 2 else 1)
        return values, (ctypes.c_int64 * 3)(*(grid + (1, 1))[:3]), empty, programs

    def inline(self, buffers: dict, env: dict):
        """This launch for the compiled graph's generated call (`backends.inline_call`): the
        kernel's function with its sizes and strides packed once. A kernel with index checks
        gets an error word of its own per call and raises as the general launch does."""
        key = size_key(env)
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes.put(key, self._shape(env))
        values, grid, empty, programs = shape
        if empty:
            return SKIP
        programs = self._threads_for(buffers, programs)
        sizes = self._sizes_array(*[buffers[name].stride(d) if kind == "stride" else values[name]
                                    for kind, name, d in self.sizes])
        strided = {name for kind, name, _ in self.sizes if kind == "stride"}
        expects = {name: Expect(tuple(buffers[name].stride())) for name in strided}
        advised = tuple(k for k, name in enumerate(self.buffers)
                        if name in self._written and buffers[name].nbytes >= HUGE_PAGE_MIN_BYTES)
        if self.checks:
            call = _CheckedLaunch(self.fn, self._ptrs_array, sizes, grid, programs, advised)
            call.checks, call.env, call.kernel_name = self.checks, dict(env), self.kernel.name
        else:
            call = _InlineLaunch(self.fn, self._ptrs_array, sizes, grid, programs, advised)
            call.range_fn, call.grid_programs = self._range, shape[3]
            call.work_bytes = sum(buffers[name].nbytes for name in self.buffers)
        return InlineCall(call, tuple(Buf(name) for name in self.buffers), expects, label=self.kernel.name)

    def __call__(self, buffers: dict, env: dict) -> None:
        # everything a launch fills is its own (ctypes releases the GIL during the call: another
        # thread may launch this kernel meanwhile); what is shared (the cached grid) is only read
        key = size_key(env)
        shape = self._shapes.get(key)
        if shape is None:  # sizes, grid and emptiness once per set of sizes
            shape = self._shapes.put(key, self._shape(env))
        values, grid, empty, programs = shape
        if empty:
            return
        ptrs = []
        for name in self.buffers:
            t = buffers[name]
            if not t.is_cpu:  # (`t.device` builds a device object: ten times the cost)
                raise RuntimeError(f"the cpu backend got a {t.device.type} tensor for {name}; use TILEFUSE_TARGET=triton")
            ptrs.append(t.data_ptr())
        for name in self._written:
            t = buffers[name]
            if t.nbytes >= HUGE_PAGE_MIN_BYTES:  # (a small output skips the storage lookup)
                advise_huge_pages(t)
        sizes = self._sizes_array(*[buffers[name].stride(d) if kind == "stride" else values[name]
                                    for kind, name, d in self.sizes])
        err = None
        if self.checks:
            err = (ctypes.c_int64 * 1)()
            ptrs.append(ctypes.addressof(err))
        fn = self._fn or self.wait()._fn  # (not the property: this is the launch path)
        # a grid smaller than the thread pool wakes only as many threads as it has programs
        # (waking the rest costs more than a small kernel, most of all on a busy machine)
        threads = max(1, min(torch.get_num_threads(), self._threads_for(buffers, programs)))
        fn(self._ptrs_array(*ptrs), sizes, grid, threads)
        if err is not None and err[0]:
            check = self.checks[err[0] - 1]
            raise index_error(check.error, f"{check_message(check, env)} (kernel {self.kernel.name})")


class RunStep(NamedTuple):
    """A launch as a step of a run of kernels (`runtime.straight_line`, `fast_call.run_steps`)."""

    fn: int  # the address of the kernel's `<name>__programs`
    sizes: int  # the address of its packed size arguments
    grid: int  # the address of its grid
    programs: int  # the grid's programs
    threaded: bool  # whether the launch on its own would spread over threads
    nbytes: int  # the bytes of the buffers it reads and writes


class _InlineLaunch:
    """A kernel's launch with its sizes, strides and grid packed: called with the buffers.
    Through the fast call (`fast_call`) where it could be built, else through ctypes."""

    __slots__ = ("fn", "ptrs", "sizes", "grid", "programs", "advised", "fast", "addresses", "range_fn",
                 "grid_programs", "work_bytes")

    def __init__(self, fn, ptrs, sizes, grid, programs: int, advised: tuple):
        self.fn, self.ptrs, self.sizes, self.grid = fn, ptrs, sizes, grid
        self.programs, self.advised = programs, advised
        self.range_fn, self.grid_programs, self.work_bytes = None, programs, 0
        self.fast = fast_call.launcher()
        # (the kernel's function, its sizes and grid arrays, which this launch keeps alive)
        self.addresses = (ctypes.cast(fn, ctypes.c_void_p).value, ctypes.addressof(sizes), ctypes.addressof(grid))

    def __call__(self, *tensors) -> None:
        for k in self.advised:
            advise_huge_pages(tensors[k])
        threads = max(1, min(torch.get_num_threads(), self.programs))
        if self.fast is not None:
            self.fast(*self.addresses, threads, *[t.data_ptr() for t in tensors])
        else:
            self.fn(self.ptrs(*[t.data_ptr() for t in tensors]), self.sizes, self.grid, threads)

    def direct(self):
        """(callable, its leading arguments, programs) for the generated call to call with the
        thread count and the buffers' pointers (`runtime.straight_line`); None: call this."""
        if self.fast is None or self.advised or len(self.addresses) + 1 + self.ptrs._length_ > 4 + fast_call.MAX_POINTERS:
            return None
        return self.fast, self.addresses, self.programs

    def step(self):
        """This launch as one step of a `fast_call.run_steps` call (the arrays whose addresses
        it gives stay alive with this launch): a `RunStep`; None: it cannot be one (no range
        function, pages to advise, no extension)."""
        if self.range_fn is None or self.direct() is None:
            return None
        return RunStep(self.range_fn, self.addresses[1], self.addresses[2], int(self.grid_programs),
                       self.programs > 1, int(self.work_bytes))


class _CheckedLaunch(_InlineLaunch):
    """An inline launch of a kernel with index checks: the error word is the call's own (a
    kernel may run in several threads at once), passed after the buffers' pointers; a failed
    check raises the error eager raises once the kernel has returned. (Through ctypes.)"""

    __slots__ = ("checks", "env", "kernel_name")

    def direct(self):
        return None

    def step(self):
        return None

    def __call__(self, *tensors) -> None:
        for k in self.advised:
            advise_huge_pages(tensors[k])
        err = (ctypes.c_int64 * 1)()
        threads = max(1, min(torch.get_num_threads(), self.programs))
        self.fn(self.ptrs(*[t.data_ptr() for t in tensors], ctypes.addressof(err)), self.sizes, self.grid, threads)
        if err[0]:
            check = self.checks[err[0] - 1]
            raise index_error(check.error, f"{check_message(check, self.env)} (kernel {self.kernel_name})")


def _symbol(name: str):
    import sympy

    return sympy.Symbol(name)


def load_kernel(kernel: TileKernel, source: str) -> CppKernel:
    logs.log("code", "%s:\n%s", kernel.name, source)
    return CppKernel(kernel, source)
