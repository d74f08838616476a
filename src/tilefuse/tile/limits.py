"""Target limits: what one program of a tile kernel may use on the machine that runs it.

A configuration — from a knob, the tuner or the tuning cache — becomes a tile kernel, and a
kernel over its target's limits does not fail politely: Triton rejects a tensor of more than
2**20 elements or a block wanting more shared memory than the device has, and a C++ program
whose tile arrays outgrow its thread's stack kills the process. So every kernel is measured
here against the `Limits` its backend supplies (`backends/limits.py`) before code is
generated, and `tile/fit.py` replaces a configuration that does not fit.

What is measured, from the tile IR alone:

* the largest tile (elements), and its elements per thread (`num_warps` warps of 32);
* Triton's shared memory for `dot` operands: an operand loaded inside a loop is pipelined
  over `num_stages` buffers, one loaded before the loop is staged once, and one computed in
  registers (a flash kernel's probabilities) takes none — (BM·BK + BK·BN)·bytes·stages for a
  matmul, stages·BN·(DK + DN)·bytes + BM·DK·bytes for attention; sequential loops (an
  attention kernel's masked and unmasked key ranges) reuse the same memory, so the largest
  loop counts, not their sum;
* the C++ stack bytes are the backend's to count (its printer decides which tiles become
  arrays); they arrive here as a number.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.expr import Cast, Var, Where
from .ir import (Arange, ArgReduceTile, BroadcastTile, DescriptorLoad, DotTile, For, Full, Let, LoadTile,
                 MakeDescriptor, ReduceTile, TileKernel, TransposeTile, expr_names)

@dataclass(frozen=True)
class Limits:
    """A target's limits; None: not a limit of this target."""

    target: str  # "cpu", "triton (<device>)", "interpret"
    stack_bytes: int | None = None  # C++: tile arrays of one program (on its thread's stack)
    shared_memory: int | None = None  # Triton: bytes per block
    max_numel: int | None = None  # elements of one tile
    max_warps: int | None = None
    max_per_thread: int | None = None  # elements of one tile per thread

    def __str__(self) -> str:
        parts = [f"{name} {value}" for name, value in (
            ("stack", _bytes(self.stack_bytes)), ("shared memory", _bytes(self.shared_memory)),
            ("elements per tile", self.max_numel), ("warps", self.max_warps),
            ("elements per thread", self.max_per_thread)) if value is not None]
        return f"{self.target}: {', '.join(parts) or 'no limits'}"


@dataclass(frozen=True)
class Violation:
    """Why a kernel does not fit: the `resource` ("stack", "shared memory", "elements",
    "warps", "registers") and a sentence giving the kernel's figure and the limit."""

    kernel: str
    resource: str
    message: str

    def __str__(self) -> str:
        return f"{self.kernel}: {self.message}"


def _bytes(n: int | None) -> str | None:
    if n is None:
        return None
    if n >= 1 << 20:
        return f"{n / (1 << 20):.3g} MiB"
    return f"{n / 1024:.3g} KiB" if n >= 1024 else f"{n} B"


def tile_shapes(kernel: TileKernel) -> dict[str, tuple]:
    """Every tile value's shape (extents along the tile's axes, 1 where it broadcasts)."""
    cx = kernel.constexprs
    shapes: dict[str, tuple] = {}
    descriptors: dict[str, tuple] = {}

    def ext(d) -> int:
        return int(cx.get(d, 1)) if isinstance(d, str) else int(d)

    def of(e) -> tuple:
        out = (1,)
        for n in expr_names(e):
            if n in shapes:
                out = _broadcast(out, shapes[n])
        return out

    def walk(stmts) -> None:
        for s in stmts:
            if isinstance(s, For):
                walk(s.body)
            elif isinstance(s, Arange):
                shape = [1] * s.ndim
                shape[s.axis] = ext(s.block)
                shapes[s.name] = tuple(shape)
            elif isinstance(s, (Full, BroadcastTile)):
                shapes[s.name] = tuple(ext(d) for d in s.shape)
            elif isinstance(s, Let):
                shapes[s.name] = of(s.value)
            elif isinstance(s, TransposeTile):
                shapes[s.name] = tuple(reversed(of(s.value)))
            elif isinstance(s, LoadTile):
                shapes[s.name] = _broadcast(of(s.offset), of(s.mask) if s.mask is not None else (1,))
            elif isinstance(s, (ReduceTile, ArgReduceTile)):
                shape = list(of(s.value))
                if s.axis < len(shape):
                    shape[s.axis] = 1
                shapes[s.name] = tuple(shape)
            elif isinstance(s, DotTile):
                a, b = of(s.a), of(s.b)
                shapes[s.name] = (a[0] if len(a) == 2 else 1, b[-1])
            elif isinstance(s, MakeDescriptor):
                descriptors[s.name] = tuple(ext(d) for d in s.block)
            elif isinstance(s, DescriptorLoad):
                block = descriptors.get(s.descriptor, (1, 1))
                shapes[s.name] = block[::-1] if s.transpose else block

    walk(kernel.body)
    return shapes


def _broadcast(a: tuple, b: tuple) -> tuple:
    rank = max(len(a), len(b))
    a, b = (1,) * (rank - len(a)) + a, (1,) * (rank - len(b)) + b
    return tuple(max(x, y) for x, y in zip(a, b))


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def largest_tile(kernel: TileKernel) -> tuple[str, int]:
    """(name, elements) of the kernel's largest tile ("", 1 when it has none)."""
    best = ("", 1)
    for name, shape in tile_shapes(kernel).items():
        n = _numel(shape)
        if n > best[1]:
            best = (name, n)
    return best


def shared_memory_bytes(kernel: TileKernel) -> int:
    """Triton's shared memory for the kernel's `dot` operands (see the module docstring)."""
    shapes = tile_shapes(kernel)
    defs: dict[str, tuple] = {}  # name -> (its Let or load, its loop depth)

    def index(stmts, depth: int) -> None:
        for s in stmts:
            if isinstance(s, For):
                index(s.body, depth + 1)
            elif isinstance(s, (Let, LoadTile, DescriptorLoad)):
                defs[s.name] = (s, depth)

    index(kernel.body, 0)

    def loaded(e):
        """The load a dot operand is, through masks (`where(m, x, 0)`) and casts; else None."""
        for _ in range(8):
            if isinstance(e, Cast):
                e = e.x
            elif isinstance(e, Where):
                e = e.a
            elif isinstance(e, Var) and e.name in defs:
                s, _ = defs[e.name]
                if not isinstance(s, Let):
                    return s
                e = s.value
            else:
                return None
        return None

    outer: dict[str, int] = {}  # operands loaded before the loops that use them: staged once

    def visit(stmts, depth: int) -> int:
        """The staged bytes of this block's loop: its own operands, plus the largest of the
        loops inside it (sequential loops reuse the same shared memory: Triton allocates by
        liveness)."""
        own, inner, counted = 0, 0, set()
        for s in stmts:
            if isinstance(s, For):
                inner = max(inner, visit(s.body, depth + 1))
            elif isinstance(s, DotTile):
                for operand in (s.a, s.b):
                    load = loaded(operand)
                    if load is None:
                        continue
                    size = _numel(shapes.get(load.name, (1,))) * load.dtype.itemsize
                    if defs[load.name][1] >= depth and depth > 0:
                        if load.name not in counted:
                            counted.add(load.name)
                            own += size * max(1, kernel.num_stages)
                    else:
                        outer[load.name] = size
        return own + inner

    staged = visit(kernel.body, 0)
    return staged + sum(outer.values())


def violation(kernel: TileKernel, limits: Limits, stack_bytes: int | None = None) -> Violation | None:
    """The first limit `kernel` exceeds on its target, or None when it fits. `stack_bytes`:
    the C++ printer's count of the kernel's tile arrays (C++ targets)."""
    name, numel = largest_tile(kernel)
    on = limits.target
    if limits.stack_bytes is not None and stack_bytes is not None and stack_bytes > limits.stack_bytes:
        return Violation(kernel.name, "stack", f"its tile arrays take {_bytes(stack_bytes)} of stack per program, "
                                               f"over the {_bytes(limits.stack_bytes)} a program may use on {on}")
    if limits.max_numel is not None and numel > limits.max_numel:
        return Violation(kernel.name, "elements", f"tile {name} has {numel} elements, over the {limits.max_numel} "
                                                  f"of one tile on {on}")
    warps = kernel.num_warps
    if limits.max_warps is not None and (warps < 1 or warps > limits.max_warps or warps & (warps - 1)):
        return Violation(kernel.name, "warps", f"{warps} warps: a power of two up to {limits.max_warps} on {on}")
    if limits.max_per_thread is not None and numel > limits.max_per_thread * 32 * max(1, warps):
        return Violation(kernel.name, "registers", f"tile {name} has {numel // (32 * max(1, warps))} elements per "
                                                   f"thread over {warps} warp(s), over the {limits.max_per_thread} "
                                                   f"of {on}")
    if limits.shared_memory is not None:
        smem = shared_memory_bytes(kernel)
        if smem > limits.shared_memory:
            return Violation(kernel.name, "shared memory",
                             f"its dot operands need {_bytes(smem)} of shared memory over {kernel.num_stages} "
                             f"stage(s), over the {_bytes(limits.shared_memory)} of a block on {on}")
    return None


__all__ = ["Limits", "Violation", "violation", "tile_shapes", "largest_tile", "shared_memory_bytes"]
