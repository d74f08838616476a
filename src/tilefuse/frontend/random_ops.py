"""tilefuse's own random ops, for code that must draw the same numbers twice.

A forward and the backward that recomputes it (`attention_chains`: dropout on attention
probabilities, regenerated tile by tile instead of stored) need random numbers that are a
function of a saved seed, not of a generator's state:

* `tilefuse::seed(like, tag)` draws a fresh seed from PyTorch's generator on `like`'s device
  (so `torch.manual_seed` makes a run repeatable). `tag` only keeps two seeds of one graph
  apart when common-subexpression elimination compares their arguments; the op is tagged
  `nondeterministic_seeded`, so AOTAutograd's partitioner saves it rather than redraw it.
* `tilefuse::philox_uniform(seed, size)` is `ir.philox`'s counter-based uniform: the element at
  linear index n is `rand(seed, n)`. Eager, the reference interpreter and every generated
  kernel give the same bits, so a forward compiled by tilefuse and a backward that fell back
  to eager still agree.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..ir import philox


@torch.library.custom_op("tilefuse::seed", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def seed(like: torch.Tensor, tag: int) -> torch.Tensor:
    return torch.randint(0, philox.SEED_BOUND, (), dtype=torch.int64, device=like.device)


@seed.register_fake
def _seed_fake(like, tag):
    return torch.empty((), dtype=torch.int64, device=like.device)


@torch.library.custom_op("tilefuse::philox_uniform", mutates_args=())
def philox_uniform(seed: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    return philox.uniform_like(seed, size)


@philox_uniform.register_fake
def _philox_uniform_fake(seed, size):
    return torch.empty(tuple(size), dtype=torch.float32, device=seed.device)
