"""The target: what a backend tells the tile layer and the tuner about the machine its kernels
run on, as one value passed down with the lowering options.

The tile layer asks the target (which kind of machine, how many multiprocessors, whether blocks
can be read through tensor descriptors, its limits), never the device itself; the compiler and
the tuner ask it to generate, load, check and time kernels. Each backend builds its own
(`backends/targets.py`); `Target.gpu()`, `Target.cpu()` and `Target.interpreter()` give the
plain ones, with no operations, for lowering alone (tests, the cost model).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

from .limits import Limits


class Machine(str, enum.Enum):
    """Which machine's rules choose block sizes: a GPU's (programs of warps over tiles) or a
    CPU's (one OpenMP task per program, a vectorised inner loop)."""

    GPU = "gpu"
    CPU = "cpu"

    __str__ = str.__str__
    __format__ = str.__format__


def _operation(doc: str):
    """A backend operation: not part of the value's identity (two targets for the same machine
    are equal), not printed."""
    return field(default=None, compare=False, repr=False, hash=False, metadata={"doc": doc})


@dataclass(frozen=True)
class Target:
    #: the backend: "triton", "cpu" (C++) or "interpret" (the Triton interpreter)
    name: str = "triton"
    machine: Machine = Machine.GPU
    #: kernels run in the Triton interpreter (numpy): small tiles, no low-precision dots
    interpret: bool = False
    #: the GPU's multiprocessors (0: unknown, or not a GPU)
    sm_count: int = 0
    #: a CPU's threads, those its kernels' programs are spread over (0: unknown, or not a CPU)
    threads: int = 0
    #: blocks are read through tensor descriptors (Hopper's TMA, and a Triton that builds them)
    tma: bool = False
    #: tiles can be transposed in registers (`TransposeTile`; Triton's `tl.trans`)
    transposes_tiles: bool = True
    #: what one program may use (`tile.limits`; None: not checked)
    limits: Limits | None = None
    #: how messages name it ("C++", "the Triton interpreter")
    title: str = field(default="", compare=False, repr=False)
    #: `() -> None`: raises a clear error when this backend cannot run here (no C++ compiler)
    require: Callable | None = _operation("raises when the backend cannot run here")
    #: `(kernel) -> source`; raises `unsupported` for a kernel this backend cannot print
    generate: Callable | None = _operation("kernel -> source")
    #: `(kernel, source) -> launcher`
    load: Callable | None = _operation("(kernel, source) -> launcher")
    #: `(kernel, source) -> launcher` of one size variant of a kernel (no build of its own)
    load_variant: Callable | None = _operation("(kernel, source) -> launcher of a size variant")
    #: `(kernel) -> Violation | None`: the first limit the kernel exceeds (may have a `.source`)
    check: Callable | None = _operation("kernel -> the first limit it exceeds, or None")
    #: `(device) -> timer`; `timer(run)` gives the seconds of one call of `run` (a median)
    timer: Callable | None = _operation("device -> timer(run) -> seconds")
    #: the exception `generate` raises for a kernel it cannot print, and the target that runs
    #: such a kernel instead (None: none)
    unsupported: type | None = _operation("the error of a kernel this target cannot print")
    fallback: "Target | None" = _operation("the target a kernel it cannot print runs on")

    @property
    def on_cpu(self) -> bool:
        return self.machine is Machine.CPU

    @classmethod
    def gpu(cls, sm_count: int = 0, tma: bool = False, limits: Limits | None = None) -> "Target":
        return cls("triton", Machine.GPU, sm_count=sm_count, tma=tma, limits=limits)

    @classmethod
    def cpu(cls, limits: Limits | None = None) -> "Target":
        return cls("cpu", Machine.CPU, limits=limits)

    @classmethod
    def interpreter(cls, limits: Limits | None = None) -> "Target":
        return cls("interpret", Machine.GPU, interpret=True, limits=limits)


__all__ = ["Target", "Machine"]
