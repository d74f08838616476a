"""Allocations written into a generated call (`runtime.straight_line`): PyTorch's own allocation
without the dispatcher, the function Inductor's generated wrappers call, where this PyTorch has
it (0.45 µs a buffer on a CPU against `torch.empty_strided`'s 1.05; a small training step
allocates over a hundred buffers a call).

Only CPU buffers take it: the CUDA one allocates on the current device, which a call need not
have set to the graph's."""
from __future__ import annotations

import torch

try:
    from torch._C._dynamo.guards import _empty_strided_cpu as _EMPTY_CPU
except ImportError:  # pragma: no cover - a PyTorch without it
    _EMPTY_CPU = None


def fast_empty(device: torch.device):
    """`empty(shape, strides, dtype) -> Tensor` allocating on `device`, or None where only
    `torch.empty_strided` serves."""
    if torch.device(device).type == "cpu" and _EMPTY_CPU is not None:
        return _EMPTY_CPU
    return None
