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
"""
from __future__ import annotations

_I32 = (-(1 << 31), 1 << 31)


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

    def __init__(self, fn, options: dict, constexprs: dict):
        self.fn = fn
        self.options = options
        self._compiled: dict = {}  # specialisation -> (Triton's compiled kernel, constexpr values)
        names = list(getattr(fn, "arg_names", None) or ())
        self._names = names
        self._constexprs = constexprs
        self.enabled = bool(names)

    def _tail(self, n_args: int):
        """The constexpr values after the first `n_args` parameters (None: a parameter that
        is not a known constexpr, and this kernel is launched the generic way)."""
        rest = self._names[n_args:]
        if any(name not in self._constexprs for name in rest):
            return None
        return [self._constexprs[name] for name in rest]

    def __call__(self, grid, args: list):
        if self.enabled:
            key = specialisation(args)
            kept = self._compiled.get(key)
            if kept is not None:
                compiled, tail = kept
                # (the compiled kernel's launcher takes all three grid dims; `run` pads them)
                compiled[tuple(grid) + (1,) * (3 - len(grid))](*args, *tail)
                return compiled
        compiled = self.fn[grid](*args, **self.options)
        if self.enabled:
            self._keep(key, compiled, len(args))
        return compiled

    def _keep(self, key, compiled, n_args: int) -> None:
        tail = self._tail(n_args)
        if tail is None or compiled is None or not callable(getattr(compiled, "__getitem__", None)):
            self.enabled = False  # a Triton without the compiled kernel's launcher
            return
        self._compiled[key] = (compiled, tail)


__all__ = ["DirectLaunch", "specialisation"]
