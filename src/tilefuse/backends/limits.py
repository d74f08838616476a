"""Each target's limits (`tile.limits.Limits`) and the check of a tile kernel against them.

* C++ (`cpu`): the stack bytes of one program's tile arrays, counted in the printed source,
  against the budget of `backends/cpu/stack.py`.
* Triton on a GPU: shared memory per block (the device's opt-in maximum when a GPU is
  present, else the H200's 227 KiB), Triton's 2**20 elements per tensor, 32 warps, and a
  sanity bound on elements per thread.
* The Triton interpreter: Triton's elements per tensor only.
"""
from __future__ import annotations

from typing import Callable

from ..tile.ir import TileKernel
from ..tile.limits import Limits, Violation, violation

#: Triton's largest tensor (elements; `triton._utils.TRITON_MAX_TENSOR_NUMEL`)
TRITON_MAX_NUMEL = 1 << 20
#: Triton's largest block: 1024 threads
TRITON_MAX_WARPS = 32
#: elements of one tile per thread beyond which a Triton kernel is nothing but register
#: spills (255 registers a thread; the largest tile a knob allows, 256×256 on one warp, is 2048)
TRITON_MAX_PER_THREAD = 2048
#: shared memory per block of an H200 (Hopper, opt-in), the target the GPU constants are for
H200_SHARED_MEMORY = 227 * 1024
#: shared memory per block (opt-in) by compute capability, for a device that cannot be asked
SHARED_MEMORY = {(7, 0): 96 * 1024, (7, 5): 64 * 1024, (8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 7): 163 * 1024,
                 (8, 9): 99 * 1024, (9, 0): 227 * 1024, (10, 0): 227 * 1024, (12, 0): 99 * 1024}


def target_limits(backend: str, device=None) -> Limits:
    """The limits of `backend` ("cpu", "triton", "interpret") on `device` (a torch.device)."""
    if backend == "cpu":
        from .cpu.stack import stack_budget

        return Limits("cpu", stack_bytes=stack_budget())
    if backend == "interpret":
        return Limits("interpret", max_numel=TRITON_MAX_NUMEL)
    name, smem = _gpu(device)
    return Limits(name, shared_memory=smem, max_numel=TRITON_MAX_NUMEL, max_warps=TRITON_MAX_WARPS,
                  max_per_thread=TRITON_MAX_PER_THREAD)


def _gpu(device) -> tuple[str, int]:
    """(name, shared memory per block) of the GPU, or the H200's when there is none to ask."""
    try:
        import torch

        if device is not None and device.type == "cuda" and torch.cuda.is_available():
            props = torch.cuda.get_device_properties(device)
            smem = getattr(props, "shared_memory_per_block_optin", 0) or \
                SHARED_MEMORY.get((props.major, props.minor), props.shared_memory_per_block)
            return f"triton ({props.name})", int(smem)
    except (ImportError, RuntimeError, AttributeError):
        pass
    return "triton (H200)", H200_SHARED_MEMORY


def kernel_check(backend: str, limits: Limits) -> Callable[[TileKernel], Violation | None]:
    """`check(kernel)`: the first limit the kernel exceeds on `backend`, or None. The C++
    check prints the kernel to count its arrays; `check.source(kernel)` hands that source on
    to the build (printing a flash kernel takes tens of milliseconds)."""
    if backend != "cpu":
        return lambda kernel: violation(kernel, limits)
    return _CppCheck(limits)


class _CppCheck:
    def __init__(self, limits: Limits):
        self.limits = limits
        self._sources: dict = {}  # id(kernel) -> (kernel, its C++ source)

    def __call__(self, kernel: TileKernel) -> Violation | None:
        from .cpu import CppUnsupported, generate
        from .cpu.stack import stack_bytes

        try:
            source = generate(kernel)
        except CppUnsupported:  # it runs in the Triton interpreter instead
            return violation(kernel, target_limits("interpret"))
        self._sources[id(kernel)] = (kernel, source)
        return violation(kernel, self.limits, stack_bytes(source))

    def source(self, kernel: TileKernel) -> str | None:
        """The source this check printed for `kernel` (None: not printed here)."""
        kept = self._sources.pop(id(kernel), None)
        return kept[1] if kept is not None and kept[0] is kernel else None


__all__ = ["target_limits", "kernel_check", "SHARED_MEMORY", "TRITON_MAX_NUMEL", "TRITON_MAX_WARPS",
           "TRITON_MAX_PER_THREAD", "H200_SHARED_MEMORY"]
