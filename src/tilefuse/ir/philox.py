"""Counter-based random numbers: the one definition every backend reproduces bit for bit.

`rand(seed, offset)` in the IR is Philox4x32-10 (Salmon et al., "Parallel random numbers: as
easy as 1, 2, 3", SC'11) keyed by the 64-bit `seed` (low word k0, high word k1) on the counter
(offset's low word, offset's high word, 0, 0); its first output word's top 24 bits, times 2⁻²⁴,
are the value: a float32 uniform on [0, 1) that is exact in every backend.

A random tensor's element is `rand(seed, linear index of the element)`, so any kernel that
computes the element, in any tiling, fused into anything, and in a backward pass that
recomputes it, gets the same value. The Triton helper (`backends.triton.helpers`) and the C++
one (`backends.cpu.runtime`) implement the same rounds; this module is the reference the
interpreter and eager code use, written with int64 tensor arithmetic (no uint32 in PyTorch).
"""
from __future__ import annotations

import torch

ROUND_A = 0xD2511F53
ROUND_B = 0xCD9E8D57
KEY_A = 0x9E3779B9
KEY_B = 0xBB67AE85
ROUNDS = 10
WORD = 0xFFFFFFFF
#: the value is the first word's top 24 bits times this (exact in float32)
UNIT = 2.0 ** -24
#: seeds are drawn below this bound: non-negative int64 on every backend
SEED_BOUND = 2 ** 62


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of a·b for a constant a and words b (int64 holding uint32):
    by 16-bit halves, so nothing overflows int64."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    b_hi, b_lo = b >> 16, b & 0xFFFF
    low = a_lo * b_lo
    mid = a_hi * b_lo + a_lo * b_hi + (low >> 16)
    lo = ((mid & 0xFFFF) << 16) | (low & 0xFFFF)
    hi = a_hi * b_hi + (mid >> 16)
    return hi & WORD, lo


#: elements per slice of `uniform_like` (its int64 temporaries stay a few hundred MB)
CHUNK = 1 << 22


def uniform(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """rand(seed, offset) as float32, broadcasting `seed` against `offset` (both integers)."""
    seed = torch.as_tensor(seed).to(torch.int64)
    offset = torch.as_tensor(offset, device=seed.device).to(torch.int64)
    if seed.dim() == 0:  # one key: its words stay scalars
        k0, k1 = seed & WORD, (seed >> 32) & WORD
    else:
        seed, offset = torch.broadcast_tensors(seed, offset)
        k0, k1 = seed & WORD, (seed >> 32) & WORD
    c0, c1 = offset & WORD, (offset >> 32) & WORD
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(ROUNDS):
        hi0, lo0 = _mulhilo(ROUND_A, c0)
        hi1, lo1 = _mulhilo(ROUND_B, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + KEY_A) & WORD
        k1 = (k1 + KEY_B) & WORD
    return (c0 >> 8).to(torch.float32) * UNIT


def uniform_like(seed: torch.Tensor, shape, device=None) -> torch.Tensor:
    """A tensor of `shape` whose element at linear index n is rand(seed, n)."""
    n = 1
    for d in shape:
        n *= int(d)
    device = device if device is not None else seed.device
    seed = seed.reshape(()).to(device)
    out = torch.empty(n, dtype=torch.float32, device=device)
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        out[start:stop] = uniform(seed, torch.arange(start, stop, dtype=torch.int64, device=device))
    return out.reshape(tuple(int(d) for d in shape))
