"""`tilefuse::index_put_accumulate_`: an accumulating `index_put_` into whole rows, through
`index_add_` where that computes the same sums faster.

An embedding's gradient is `index_put_(table, [ids], grads, accumulate=True)`: the grads of
every token added into its row. ATen's accumulating `index_put_` is slow in two places:

- On a CPU it is fast on fewer than 32768 values (its parallel grain) and falls off a cliff
  from there: on a 2-core host, 17.7 µs for 511 rows of 64 floats, 87 µs for 512; 6.1 ms for
  1024 rows of 768 (BERT-base's width), where `index_add_` along dim 0 takes 0.2 ms.
  `index_add_` adds each row's contributions in the order of the index, as the serial
  `index_put_` does (its parallel path adds in another order: the same sums up to rounding).
- On a GPU it sorts the indices and adds the rows of one index serially: BERT's token-type
  embedding (every one of 8192 tokens reads row 0) took 5.4 ms of a 14 ms training step on an
  H200, where `index_add_`'s atomic adds take microseconds. The atomics add in no fixed order,
  as Inductor's generated scatter does; under `torch.use_deterministic_algorithms(True)` the
  call stays `index_put_` (sorted, deterministic), and so does a table of half precision
  (each atomic add would round; `index_put_` sums a row's values in fp32 and rounds once).

This op takes `index_add_` when it applies: one integer index tensor, the values shaped as the
rows it selects, and on a CPU at least `ROWS_FROM` of them. Negative indices are wrapped as
`index_put_` wraps them; an index out of range raises `IndexError` on a CPU, as there, and a
device-side assertion on a GPU, as `index_put_`'s own (a host check would wait for the GPU).
Any other call is `index_put_` itself.
"""
from __future__ import annotations

import torch

_LIB = torch.library.Library("tilefuse", "FRAGMENT")
_LIB.define("index_put_accumulate_(Tensor(a!) self, Tensor?[] indices, Tensor values) -> Tensor(a!)")


#: values from which `index_add_` is the faster way (ATen's parallel grain, `at::internal::GRAIN_SIZE`)
ROWS_FROM = 32768


def rows_added(base: torch.Tensor, indices, values: torch.Tensor) -> bool:
    """Whether the call is `index_add_` along dim 0 of `base` (see the module's docstring)."""
    if len(indices) != 1 or base.dim() < 1:
        return False
    if base.device.type == "cpu":
        if values.numel() < ROWS_FROM:
            return False
    elif (base.device.type != "cuda" or torch.are_deterministic_algorithms_enabled()
          or base.dtype not in (torch.float32, torch.float64)):
        return False  # (a half-precision atomic add rounds every addition; index_put_ sums in fp32)
    index = indices[0]
    return (index is not None and index.dtype in (torch.int64, torch.int32)
            and tuple(values.shape) == tuple(index.shape) + tuple(base.shape[1:]))


def _index_put_accumulate_(base, indices, values):
    if not rows_added(base, indices, values):
        return torch.ops.aten.index_put_.default(base, indices, values, True)  # (indices may hold None)
    index, rows = indices[0].reshape(-1), base.shape[0]
    if base.device.type != "cpu":
        index = torch.where(index < 0, index + rows, index)
        return base.index_add_(0, index, values.reshape((-1,) + tuple(base.shape[1:])))
    low, high = index.aminmax()
    if low < -rows or high >= rows:  # as index_put_ reports it (before wrapping)
        bad = int(low) if low < -rows else int(high)
        raise IndexError(f"index {bad} is out of bounds for dimension 0 with size {rows}")
    index = torch.where(index < 0, index + rows, index)
    return base.index_add_(0, index, values.reshape((-1,) + tuple(base.shape[1:])))


_LIB.impl("index_put_accumulate_", _index_put_accumulate_, "CompositeExplicitAutograd")

index_put_accumulate_ = torch.ops.tilefuse.index_put_accumulate_.default

__all__ = ["index_put_accumulate_", "rows_added", "ROWS_FROM"]
