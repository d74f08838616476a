"""Launching a compiled Triton kernel without going through `JITFunction.run` each time.

`fn[grid](*args)` binds the arguments to the kernel's signature, computes every argument's
specialisation (pointer alignment, integers equal to 1 or divisible by 16, 32- or 64-bit),
looks the binary up by it and only then launches: tens of microseconds of host time per
launch, more than a small kernel runs on the GPU. Here the first launch of each
specialisation goes that way and keeps the compiled kernel Triton returns; later launches
whose arguments specialise the same call that kernel's own launcher (`CompiledKernel[grid]`),
as Inductor's launchers do. The key computed here is at least as fine as Triton's (two
argument lists with the same key get the same binary from Triton), so a launch never runs a
binary compiled for another specialisation.

The launch itself calls the compiled kernel's launcher (`CompiledKernel.run`) with the current
stream, as the compiled kernel's own `[grid]` runner does, without building that runner and its
launch metadata each time (about 3 µs of an 8 µs launch on the H200's host). While a launch
hook is installed (a profiler such as Proton) launches go through the runner, which calls it.
A caller that knows its arguments' specialisation cheaper than `specialisation` (the kernel's
launcher: its sizes are fixed per set of sizes) passes its own key, which must be at least as
fine.

A first launch that Triton refuses for want of resources (`OutOfResources`: the binary needs
more shared memory than the device has, as a deep software pipeline can where the limits
check estimated less) is retried with one pipeline stage fewer, down to one, and the launch
options stay there for this kernel's later specialisations: the same tiles, a shallower
pipeline, never a failed graph. A refusal at one stage, or for another resource, is raised
as Triton raised it.
"""
from __future__ import annotations

from ... import logs

_I32 = (-(1 << 31), 1 << 31)


def recorded_specialisation(args) -> tuple:
    """What a binary record is kept under (`binaries`): Triton's specialisation of the
    arguments and the tensors' dtypes — the same in any process for the same launch, and
    coarser than a caller's key by sizes (one record serves every size Triton compiles alike)."""
    return specialisation(args), tuple(str(a.dtype) for a in args if hasattr(a, "data_ptr"))


def _three_dims(grid) -> tuple:
    return tuple(grid) + (1,) * (3 - len(grid))


def specialisation(args) -> tuple:
    """What Triton specialises a launch on, for the arguments tilefuse passes (tensors, ints,
    floats)."""
    key = []
    for a in args:
        kind = type(a)
        if kind is int:
            key.append((a == 1, a % 16 == 0, _I32[0] <= a < _I32[1], a >= 1 << 63))
        elif kind is float or kind is bool or a is None:
            key.append(kind)
        else:  # a tensor: its dtype is the graph's; its base address may move
            key.append(a.data_ptr() % 16 == 0)
    return tuple(key)


class DirectLaunch:
    """The launches of one generated kernel: `launch(grid, args)` with the kernel's
    non-constexpr arguments in signature order."""

    def __init__(self, fn, options: dict, constexprs: dict, refit: bool = True, records=None):
        self.fn = fn
        self.options = options
        self.refit = refit  # retry a launch refused for resources with fewer stages (not while tuning)
        self.records = records  # `binaries.BinaryRecords`: binaries found without the JIT (None: none)
        self._by_record: dict = {}  # recorded_specialisation -> compiled kernel, once launched in this process
        self._compiled: dict = {}  # specialisation -> (compiled kernel, constexpr values, `_launcher_of` it)
        names = list(getattr(fn, "arg_names", None) or ())
        self._names = names
        self._constexprs = constexprs
        self.enabled = bool(names)
        self.retries = 0  # first launches retried with fewer stages

    def _tail(self, n_args: int):
        """The constexpr values after the first `n_args` parameters (None: a parameter that
        is not a known constexpr, and this kernel is launched the generic way)."""
        rest = self._names[n_args:]
        if any(name not in self._constexprs for name in rest):
            return None
        return [self._constexprs[name] for name in rest]

    def __call__(self, grid, args: list, key=None):
        if self.enabled:
            key = specialisation(args) if key is None else key
            kept = self._compiled.get(key)
            if kept is not None:
                compiled, tail, launcher = kept
                grid = _three_dims(grid)  # (the launcher takes all three grid dims)
                if launcher is not None and _no_launch_hooks():
                    run, function, packed = launcher
                    run(*grid, _current_stream(), function, packed, None, None, None, *args, *tail)
                else:
                    compiled[grid](*args, *tail)
                return compiled
        recorded = recorded_specialisation(args) if self.enabled and self.records is not None else None
        compiled = None
        if recorded is not None:
            compiled = self._by_record.get(recorded)
            if compiled is not None:  # another key Triton compiles alike (new sizes): its binary
                compiled[_three_dims(grid)](*args, *self._tail(len(args)))
            else:
                compiled = self._recorded_launch(grid, args, recorded)
        if compiled is None:
            compiled = self._first_launch(grid, args)
            if recorded is not None:
                self.records.keep(recorded, compiled, self.options)
        if recorded is not None:
            self._by_record[recorded] = compiled
        if self.enabled:
            self._keep(key, compiled, len(args))
        return compiled

    def _recorded_launch(self, grid, args: list, recorded):
        """The first launch of a specialisation on the binary a record names (`binaries`),
        without the JIT; None where there is no record or its binary does not load (the record
        is then discarded). An error of the launch itself is raised: the kernel may have run."""
        from .binaries import launched

        tail = self._tail(len(args))
        found = self.records.find(recorded) if tail is not None else None
        if found is None:
            return None
        compiled, options = found
        try:
            runner = compiled[_three_dims(grid)]  # (loads the binary's handles)
        except Exception as err:  # noqa: BLE001 - the JIT's way instead, which reports its own errors
            why = f"{type(err).__name__}: {err}"
            logs.log("runtime", "%s: recorded binary did not load (%s); compiling through the JIT",
                     getattr(self.fn, "__name__", "kernel"), why)
            self.records.forget(recorded, why)
            return None
        runner(*args, *tail)
        launched[0] += 1
        if options != self.options:  # (retried with fewer stages in the process that recorded it)
            self.options = options
        return compiled

    def _first_launch(self, grid, args: list):
        while True:
            try:
                return self.fn[grid](*args, **self.options)
            except Exception as err:  # noqa: BLE001 - only Triton's refusal for resources is retried
                stages = self.options.get("num_stages") or 1
                if not self.refit or type(err).__name__ != "OutOfResources" or "shared memory" not in str(err) \
                        or stages <= 1:
                    raise
                name = getattr(self.fn, "__name__", "kernel")
                logs.log("runtime", "%s: %s; launching with num_stages=%d instead of %d", name,
                         str(err).split(". ")[0], stages - 1, stages)
                self.options = dict(self.options, num_stages=stages - 1)
                self.retries += 1

    def kept(self, key):
        """(launcher, function handle, packed metadata, constexpr values) of the binary kept for
        specialisation `key`; None where there is none, or its launches take the runner."""
        kept = self._compiled.get(key) if self.enabled else None
        if kept is None or kept[2] is None:
            return None
        _, tail, (run, function, packed) = kept
        return run, function, packed, tail

    def _keep(self, key, compiled, n_args: int) -> None:
        tail = self._tail(n_args)
        if tail is None or compiled is None or not callable(getattr(compiled, "__getitem__", None)):
            self.enabled = False  # a Triton without the compiled kernel's launcher
            return
        self._compiled[key] = (compiled, tail, _launcher_of(compiled))


def _launcher_of(compiled):
    """(launcher, function handle, packed metadata) of a compiled kernel that was launched once
    (its handles are loaded), or None where Triton's layout differs: the runner is used then."""
    try:
        run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
        _triton_runtime()
    except (AttributeError, ImportError):
        return None
    return (run, function, packed) if callable(run) and function is not None else None


_RUNTIME: list = []  # [triton.knobs.runtime, triton.runtime.driver], once a launcher is kept


def _triton_runtime() -> list:
    if not _RUNTIME:
        from triton import knobs
        from triton.runtime import driver

        _RUNTIME[:] = [knobs.runtime, driver]
    return _RUNTIME


def no_launch_hooks() -> bool:
    """Whether launches may skip the runner (no launch hook installed)."""
    return not _RUNTIME or _no_launch_hooks()


def current_stream():
    """The stream a launch goes to now (the current CUDA stream's handle)."""
    return _current_stream()


def _no_launch_hooks() -> bool:
    runtime = _RUNTIME[0]
    return _unset(runtime.launch_enter_hook) and _unset(runtime.launch_exit_hook)


def _unset(hook) -> bool:
    """No hook: None (Triton 3.6), or an empty chain of hooks (later Tritons)."""
    if hook is None:
        return True
    calls = getattr(hook, "calls", None)
    return isinstance(calls, list) and not calls


def _current_stream():
    active = _RUNTIME[1].active
    return active.get_current_stream(active.get_current_device())


__all__ = ["DirectLaunch", "specialisation", "recorded_specialisation", "no_launch_hooks", "current_stream"]
