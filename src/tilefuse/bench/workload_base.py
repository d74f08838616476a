"""The `Workload` record and the helpers that workload definitions share.

A workload is a plain PyTorch function plus what the harness needs around it: fresh random
inputs for a named size, its work (flop and byte counts, see the formulas in each module),
the axis of the size tuple that a dynamic-shape sweep varies, an optional fp64 reference
(for functions whose user-written form deliberately computes something in float32), and a
`requires` check that names why the workload cannot run on a device (fp8 needs sm_89+).

Whole models (`group="models"`) take the module as their first input; a training workload
also has a `step`, the program around the compiled call (backward, optimizer), and reports
throughput in `items` (tokens or images) per second.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

Inputs = tuple[torch.Tensor, ...]

EPS = 1e-6
#: the dtypes a benchmark runs in, by the name `--dtype` takes
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Workload:
    name: str
    #: make_inputs(size, device, dtype) -> fresh random input tensors
    make_inputs: Callable[[tuple[int, ...], torch.device, torch.dtype], Inputs]
    #: the program under test, plain PyTorch
    fn: Callable[..., torch.Tensor]
    flops: Callable[[Inputs], float]
    bytes: Callable[[Inputs], float]
    #: {"quick": shape tuple, "full": shape tuple}; the meaning of the tuple is per workload
    sizes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: "memory" (throughput in GB/s) or "compute" (throughput in TFLOP/s)
    bound: str = "memory"
    description: str = ""
    #: index into the size tuple of the batch or sequence axis a dynamic sweep varies
    dynamic_axis: int | None = 0
    #: the fp64 reference (default: `fn` on float64 copies of the floating-point inputs)
    ref_fn: Callable[..., torch.Tensor] | None = None
    #: requires(device) -> None, or the reason the workload cannot run there
    requires: Callable[[torch.device], str | None] | None = None
    #: the size-tuple fields, for reports ("M,K,N")
    size_names: str = ""
    #: "kernels" or "models" (`tilefuse bench --group`)
    group: str = "kernels"
    #: step(run, *inputs): the timed program around the compiled `run` (= fn compiled), e.g.
    #: a training step's backward and optimizer; None: the program is `run(*inputs)` itself
    step: Callable[..., object] | None = None
    #: items(inputs) -> tokens or images one call processes; throughput is then items/s
    items: Callable[[Inputs], float] | None = None
    item_unit: str = ""

    def size(self, name: str, layers: int | None = None) -> list[int]:
        """The size tuple called `name` ("quick", "full"), with a model's layer count replaced
        by `layers` when given (models whose size has a layers field)."""
        size = list(self.sizes[name])
        if layers is not None and self.group == "models" and "layers" in self.size_names:
            size[self.size_names.split(",").index("layers")] = layers
        return size

    def program(self, run: Callable[..., object]) -> Callable[..., object]:
        """The timed callable, given `run`: `fn` itself (eager) or `fn` compiled."""
        if self.step is None:
            return run
        step = self.step
        return lambda *inputs: step(run, *inputs)

    def throughput(self, inputs: Inputs, seconds: float) -> tuple[float, str]:
        """Throughput of one call that took `seconds`: (value, unit)."""
        if self.items is not None:
            return self.items(inputs) / seconds, self.item_unit
        if self.bound == "compute":
            return self.flops(inputs) / seconds / 1e12, "TFLOP/s"
        return self.bytes(inputs) / seconds / 1e9, "GB/s"

    def reference(self, inputs: Inputs):
        """The fp64 reference output for `inputs` (floating-point inputs promoted to float64,
        integer ones such as positions or int8 weights kept)."""
        promoted = [t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                    for t in inputs]
        return (self.ref_fn or self.fn)(*promoted)

    def unsupported(self, device: torch.device) -> str | None:
        """Why this workload cannot run on `device`, or None."""
        return self.requires(device) if self.requires else None

    def sweep_sizes(self, size: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Sizes of a dynamic-shape sweep: `size`, then the dynamic axis at 1/2, 3/4 and 3/2
        of its value (distinct, at least 1). Empty when the workload has no dynamic axis."""
        if self.dynamic_axis is None:
            return []
        v = size[self.dynamic_axis]
        out: list[tuple[int, ...]] = []
        for n in (v, v // 2, (3 * v) // 4, (3 * v) // 2):
            s = list(size)
            s[self.dynamic_axis] = max(1, n)
            if tuple(s) not in out:
                out.append(tuple(s))
        return out


def randn(shape, device, dtype, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    t = torch.randn(shape, device=device, dtype=torch.float32)
    if scale != 1.0 or shift != 0.0:
        t = t * scale + shift
    return t.to(dtype)


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def rope_tables(positions: int, d: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (positions, d) as Llama builds them (frequencies repeated twice)."""
    pos = torch.arange(positions, device=device, dtype=torch.float32)[:, None]
    freq = 10000.0 ** (-torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    angle = torch.cat((pos * freq, pos * freq), dim=-1)
    return angle.cos().to(dtype), angle.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as Llama writes it: rotate_half by slicing and cat."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w
