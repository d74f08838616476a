"""Loading and launching generated Triton kernels.

Generated source goes through the disk cache (namespace "triton", keyed by the source and the
environment fingerprint) and is imported from the cached file, because `triton.jit` needs a
real file to read the source from.

Triton's own binary cache is left where Triton puts it (its default, or the user's
`TRITON_CACHE_DIR`): tilefuse changes no environment variable and no process-wide Triton knob.
Scoping `triton.knobs.cache.dir` to our launches was rejected: the knob is process-global, so a
user's kernel compiled in another thread during one of our launches would land in our directory.
Triton keys its binaries by their full source and options, so sharing its cache is safe, and a
second process with the same graph still compiles nothing new. `tilefuse cache clear` clears
tilefuse's cache only; Triton's cache is Triton's to manage.

A kernel's module is imported once while a kernel holds it, outside `sys.modules` (a dropped
graph leaves nothing behind); its size arguments and grid per set of sizes are a bounded
`SizeCache`, shared read-only by launches from any thread.

Interpreted kernels (`interpret`) run through `interpreter.py`, which scopes Triton's
interpreter to tilefuse's own launches, without `TRITON_INTERPRET`.

A kernel with index checks (`tl.device_assert`) is built in Triton's debug mode, as Inductor
builds kernels with indirect indexing: `debug=True` keeps the asserts, `sanitize_overflow=False`
keeps Triton's integer-overflow asserts out. On a GPU a failed check is a device-side assert
(the CUDA context reports it at the next synchronisation, as eager CUDA indexing does). The
interpreter has its own debug switch, turned on around the launch; a failed check there raises
the error eager raises, naming the op.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import sys
import threading
import weakref

from ... import logs
from ...config import config
from ...ir import symbolic
from ...cache import scratch
from ...cache.disk import DiskCache, cache_key, environment_fingerprint
from ..size_cache import SizeCache, size_key
from ...ir.bounds import index_error
from ...tile.ir import TileKernel, check_message, checks_of
from . import compile_pool, interpreter
from .binaries import BinaryRecords
from .direct_launch import DirectLaunch, current_stream, no_launch_hooks
from ..inline_call import SKIP, STREAM, Buf, Expect, InlineCall

_import_lock = threading.Lock()
# module name -> the imported kernel module, while a kernel holds it: a dropped graph (a
# recompile, `torch._dynamo.reset()`) leaves nothing behind
_modules: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()
_caches: dict[str, DiskCache] = {}


_key_thread: list = []


def prefetch_triton_key() -> None:
    """Start Triton's hash of its own sources in a background thread. Triton computes it once
    per process before its first compile or launch (about 0.4 s on a GPU machine); started
    when a graph reaches the backend, it runs while Dynamo and AOTAutograd trace (the hashing
    releases the GIL), so a graph loaded from the graph cache does not wait for it."""
    if _key_thread:
        return
    try:
        from triton.runtime.cache import triton_key
    except Exception:  # noqa: BLE001 - a Triton without it: nothing to prefetch
        return
    thread = threading.Thread(target=_quietly, args=(triton_key,), name="tilefuse-triton-key", daemon=True)
    _key_thread.append(thread)
    thread.start()


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - the first launch computes it again and reports any error
        pass


def kernel_cache() -> DiskCache:
    """The process's handle on the "triton" cache namespace (its hit/miss/build counters
    tell whether a run compiled anything new)."""
    root = config.cache_dir
    cache = _caches.get(root)
    return cache if cache is not None else _caches.setdefault(root, DiskCache("triton", root))


def _import_source(source: str, key: str, interpret: bool):
    mod_name = f"tilefuse_kernel_{key[:24]}_{'i' if interpret else 'g'}"
    module = _modules.get(mod_name)
    if module is not None:
        return module
    cache = kernel_cache()
    cache.get_or_create(key, lambda: {"kernel.py": source.encode()})
    entry = cache.path_of(key)
    path = os.path.join(entry, "kernel.py") if entry is not None else None
    if path is None:  # cache unusable: a private copy, kept until this process exits
        path = scratch.keep_file(source.encode(), ".py")
    with _import_lock:
        module = _modules.get(mod_name)  # imported by another thread meanwhile
        if module is not None:
            return module
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        module.__tilefuse_path__ = path  # a compile worker imports the same file
        module.__tilefuse_launched__ = False
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        finally:
            # in sys.modules only while it runs: held there, every recompile's module would stay
            # (Triton reads the source from the file and the globals from the function)
            sys.modules.pop(mod_name, None)
        _modules[mod_name] = module
    return module


class _Sized:
    """A kernel's launch for one set of sizes: size arguments, grid, emptiness, the argument
    list with the sizes in place (`template`), and the sizes' key."""

    __slots__ = ("values", "grid", "empty", "template", "key")

    def __init__(self, values: dict, grid: tuple, empty: bool, template: list, key: tuple):
        self.values, self.grid, self.empty, self.template, self.key = values, grid, empty, template, key


class TritonKernel:
    """A launchable kernel: binds buffers and sizes to the kernel's parameters."""

    def __init__(self, kernel: TileKernel, source: str, interpret: bool):
        self.kernel = kernel
        self.source = source
        self.interpret = interpret
        key = cache_key("triton-kernel", source, interpret, environment_fingerprint())
        self.module = _import_source(source, key, interpret)  # (held: `_modules` holds it weakly)
        fn = getattr(self.module, kernel.name)
        self.fn = interpreter.launchable(fn) if interpret else fn
        self._shapes = SizeCache()  # size_key(env) -> _Sized
        self._warming = None  # the worker's compile of this kernel, until the first launch
        self.described = _described_buffers(kernel.body)  # read through tensor descriptors (TMA)
        self.checks = checks_of(kernel.body)
        self.debug = {"debug": True, "sanitize_overflow": False} if self.checks and not interpret else {}
        self._launch_options = dict(kernel.constexprs, num_warps=kernel.num_warps, num_stages=kernel.num_stages,
                                    **self.debug)
        records = None if interpret else BinaryRecords(fn, key, self._launch_options, config.cache_dir)
        self._direct = DirectLaunch(self.fn, self._launch_options, kernel.constexprs, records=records)
        self.arg_plan = []
        for p in kernel.params:
            if p.kind == "buffer":
                self.arg_plan.append(("buffer", p.name, None))
            elif "_stride" in p.name and p.name.rsplit("_stride", 1)[1].isdigit():
                buf, k = p.name.rsplit("_stride", 1)
                self.arg_plan.append(("stride", buf, int(k)))
            else:
                self.arg_plan.append(("size", p.name, None))
        # what a launch fills into a set of sizes' template: (position, 0 buffer | 1 stride, name, dim)
        self._fills = [(pos, 0 if kind == "buffer" else 1, name, k)
                       for pos, (kind, name, k) in enumerate(self.arg_plan) if kind != "size"]

    def measured_as_is(self) -> "TritonKernel":
        """For the tuner: a launch refused for resources raises (the candidate is dropped)
        instead of being retried with fewer pipeline stages (`DirectLaunch`)."""
        self._direct.refit = False
        self._direct.records = None  # (a candidate's binary is not worth a record: most are never used again)
        return self

    def __tilefuse_reduce__(self):  # a stored graph rebuilds it (`runtime.artifact`)
        return self.kernel, self.source, self.interpret

    def _shape(self, env: dict) -> "_Sized":
        sizes = size_key(env)
        shape = self._shapes.get(sizes)
        if shape is None:  # sizes, grid and emptiness once per set of sizes: sympy stays off the hot path
            values = {name: int(symbolic.evaluate(_symbol(name), env)) for kind, name, _ in self.arg_plan
                      if kind == "size"}
            empty = int(symbolic.evaluate(self.kernel.numel, env)) == 0
            grid = tuple(self.kernel.grid_size(env))
            template = [values[name] if kind == "size" else None for kind, name, _ in self.arg_plan]
            shape = self._shapes.put(sizes, _Sized(values, grid, empty, template, sizes))
        return shape

    def _args(self, buffers: dict, values: dict, launch: bool = True) -> list:
        args = []
        for kind, name, k in self.arg_plan:
            if kind == "buffer":
                t = buffers[name]
                if launch and name in self.described and t.data_ptr() % 16:
                    t = _aligned_copy(t)  # TMA needs a 16-byte aligned base (a view at an odd offset)
                args.append(t)
            elif kind == "stride":
                args.append(buffers[name].stride(k))
            else:
                args.append(values[name])
        return args

    def _launch_args(self, buffers: dict, sized: "_Sized") -> tuple:
        """(arguments, specialisation key) of a launch: the sizes from `sized`'s template, the
        buffers and their strides from `buffers`. The key — the set of sizes, each tensor's
        16-byte alignment, the strides — is at least as fine as Triton's own."""
        args = list(sized.template)
        aligned, strides = [], []
        for pos, kind, name, k in self._fills:
            if kind == 0:
                t = buffers[name]
                ptr = t.data_ptr()
                if ptr % 16 and name in self.described:
                    t = _aligned_copy(t)  # TMA needs a 16-byte aligned base (a view at an odd offset)
                    ptr = t.data_ptr()
                args[pos] = t
                aligned.append(ptr % 16 == 0)
            else:
                st = buffers[name].stride(k)
                args[pos] = st
                strides.append(st)
        return args, (sized.key, tuple(aligned), tuple(strides))

    def precompile(self, buffers: dict, env: dict) -> bool:
        """Compile the kernel in a worker process (`compile_pool`) for a launch on `buffers`
        (tensors, meta tensors will do) with sizes `env`; its first launch waits for it. False
        where nothing was started: no pool, an interpreted or already launched kernel, sizes
        not known."""
        if self.interpret or self.module.__tilefuse_launched__ or self._warming is not None:
            return False
        try:
            sized = self._shape(env)
            args = [a.dtype if hasattr(a, "dtype") else a for a in self._args(buffers, sized.values, launch=False)]
        except (KeyError, TypeError, ValueError):  # a size or buffer only known at run time
            return False
        if sized.empty:
            return False
        options = self._launch_options
        key = cache_key("triton-precompile", self.module.__name__, repr(args), sorted(options.items()))
        self._warming = compile_pool.submit(key, self.module.__tilefuse_path__, self.module.__name__,
                                            self.kernel.name, args, options)
        return self._warming is not None

    def compiling(self) -> tuple[bool, float | None, float | None] | None:
        """Its compile in a worker (`compile_pool.compile_progress`): (done, seconds running so
        far, seconds it took); done for a kernel no worker compiles (or, after its first launch,
        no longer does); None where the pool cannot be relied on."""
        return compile_pool.compile_progress(self._warming)

    def __call__(self, buffers: dict, env: dict) -> None:
        sized = self._shape(env)
        if sized.empty:
            return  # empty output: nothing to compute
        if self.described:
            _ensure_allocator()
        if self.interpret:
            args = self._args(buffers, sized.values)
            with interpreter.running():
                self._interpret(sized.grid, args, env)
            return
        args, key = self._launch_args(buffers, sized)
        if self._warming is not None:  # compiling in a worker: Triton finds the binary on disk after it
            future, self._warming = self._warming, None
            # the worker compiled for 16-byte aligned tensors; a view at another offset is
            # another specialisation, which this launch compiles itself
            expected = compile_pool.wait(future) if all(key[1]) else ""
            retries = self._direct.retries
            compiled = self._direct(sized.grid, args, key)
            # (a launch retried with fewer stages runs another binary than the worker's: not a miss)
            compile_pool.launched(expected if self._direct.retries == retries else "", compiled)
        else:
            self._direct(sized.grid, args, key)
        self.module.__tilefuse_launched__ = True

    def inline(self, buffers: dict, env: dict):
        """This launch for the compiled graph's generated call (`backends.inline_call`): the
        binary's own launcher with the sizes, grid and strides of `buffers` in place; None where
        launches take the general way (interpreted, no binary kept, a descriptor's buffer not
        16-byte aligned)."""
        if self.interpret:
            return None
        sized = self._shape(env)
        if sized.empty:
            return SKIP
        if any(buffers[name].data_ptr() % 16 for name in self.described):
            return None
        _, key = self._launch_args(buffers, sized)
        kept = self._direct.kept(key)
        if kept is None:
            return None
        run, function, packed, tail = kept
        values = list(sized.template)
        strided = {name for _, kind, name, _ in self._fills if kind == 1}
        expects = {}
        for pos, kind, name, k in self._fills:
            t = buffers[name]
            values[pos] = Buf(name) if kind == 0 else t.stride(k)
            expects[name] = Expect(tuple(t.stride()) if name in strided else None, t.data_ptr() % 16 == 0)
        grid = tuple(sized.grid) + (1,) * (3 - len(sized.grid))
        return InlineCall(run, (*grid, STREAM, function, packed, None, None, None, *values, *tail), expects,
                          label=self.kernel.name, guard=no_launch_hooks,
                          setup=_ensure_allocator if self.described else None, stream=current_stream)

    def _interpret(self, grid, args: list, env: dict) -> None:
        launch = self.fn[grid]
        options = dict(self.kernel.constexprs, num_warps=self.kernel.num_warps, num_stages=self.kernel.num_stages)
        if not self.checks:
            launch(*args, **options)
            return
        with _interpreter_asserts():
            try:
                launch(*args, **options)
            except Exception as err:  # noqa: BLE001 - a failed check is re-raised as eager raises it
                failed = self._check_failure(err, env)
                if failed is None:
                    raise
                raise failed from None

    def _check_failure(self, err: BaseException, env: dict):
        """The error of the check whose assert failed under the interpreter (None if `err` is
        something else)."""
        cause = err.__cause__ if isinstance(err.__cause__, AssertionError) else err
        text = str(cause)
        for check in self.checks:
            if check_message(check) in text:
                return index_error(check.error, f"{check_message(check, env)} (kernel {self.kernel.name})")
        return None


@contextlib.contextmanager
def _interpreter_asserts():
    """Device asserts on in the Triton interpreter (its builder's debug option, which
    `TRITON_DEBUG` does not reach), integer-overflow asserts off."""
    try:
        from triton.runtime.interpreter import interpreter_builder
        old = interpreter_builder.options
    except (ImportError, AttributeError):  # another interpreter layout: asserts as it has them
        yield
        return
    fields = {f.name for f in dataclasses.fields(old)} if dataclasses.is_dataclass(old) else set()
    changes = {k: v for k, v in (("debug", True), ("sanitize_overflow", False)) if k in fields}
    interpreter_builder.options = dataclasses.replace(old, **changes) if changes else old
    try:
        yield
    finally:
        interpreter_builder.options = old


def _described_buffers(stmts) -> set:
    from ...tile.ir import For, MakeDescriptor

    found = set()
    for s in stmts:
        if isinstance(s, MakeDescriptor):
            found.add(s.buffer)
        elif isinstance(s, For):
            found |= _described_buffers(s.body)
    return found


def _aligned_copy(t):
    import torch

    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _scratch_for_descriptors(size: int, alignment: int, stream):
    import torch

    return torch.empty(size, dtype=torch.int8, device=_scratch_device())


@functools.cache
def _scratch_device() -> str:
    """Where descriptor scratch lives (asked once: `torch.cuda.is_available()` costs about 5 µs,
    and Triton asks for scratch at every launch of a kernel that builds descriptors)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# per thread: Triton keeps its allocator in a context variable, which a new thread starts without
_allocator_ready = threading.local()


def _ensure_allocator() -> None:
    """Kernels that build tensor descriptors on the device need global scratch from an
    allocator; install one backed by PyTorch's caching allocator unless the program set its own
    (checked once per thread: later launches read a flag)."""
    if getattr(_allocator_ready, "ok", False):
        return
    _install_allocator()
    _allocator_ready.ok = True


def _install_allocator() -> None:
    import triton

    try:
        from triton.runtime import _allocation
        current = _allocation._allocator
        current = current.get() if hasattr(current, "get") else current
        if current is not None and not isinstance(current, _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):  # another Triton layout: install ours
        pass
    triton.set_allocator(_scratch_for_descriptors)


def _symbol(name: str):
    import sympy

    return sympy.Symbol(name)


def load_kernel(kernel: TileKernel, source: str, interpret: bool) -> TritonKernel:
    logs.log("code", "%s:\n%s", kernel.name, source)
    return TritonKernel(kernel, source, interpret)
