"""Roofline terms the kernel families' cost formulas share: how many programs run at once, the
fraction of matrix throughput one tile reaches, and the time of a memory-bound kernel (the
pointwise and reduction families' cost).

Each family prices its own schedule space (`KernelFamily.cost`); `tune.cost` ranks a space
with it against the device's ceilings (a `tune.cost.Ceilings`: bandwidth, matrix and vector
throughput, SM count).
"""
from __future__ import annotations

import math

from .space import MAX_WARPS_PER_SM, SMEM_PER_BLOCK


def tile_efficiency(bm: int, bn: int, warps: int) -> float:
    """The fraction of peak matrix throughput one program reaches: larger output tiles reuse
    each loaded operand more; 4 warps on a large tile lack the issue slots of 8."""
    eff = min(1.0, (bm * bn / (128.0 * 128.0)) ** 0.35)
    if bm * bn >= 128 * 256 and warps < 8:
        eff *= 0.8
    return eff


def concurrency(smem: int, warps: int, sm_count: int) -> int:
    per_sm = max(1, min(SMEM_PER_BLOCK // max(smem, 1), MAX_WARPS_PER_SM // warps))
    return sm_count * per_sm


#: seconds from a program's first load to its data (DRAM latency and the program's start):
#: by Little's law the bytes in flight over this bound the bandwidth a kernel can reach
MEMORY_LATENCY = 1e-6


def memory_time(space, schedule, c) -> float:
    """Reductions and pointwise kernels: their bytes over the bandwidth — or over what the
    programs resident at once keep in flight, when each moves too few bytes (one 64-element
    row per program: 98304 programs took 60 µs on the H200 where 64 rows each took 8) —, slowed
    when too few programs keep the SMs busy, by a ragged last wave, and by spilling (many
    elements per thread)."""
    s = space.sizes
    total, rows, R = s.get("bytes"), s.get("rows"), s.get("R") or 1
    if total is None or rows is None:
        return math.inf
    xblock, warps = schedule.get("XBLOCK", 1), schedule["warps"]
    rblock = schedule.get("RBLOCK", space.default.get("RBLOCK", R))
    programs = math.ceil(rows / xblock)
    if programs == 0 or total == 0:
        return 3e-6  # an empty launch
    slots = c.sm_count * min(MAX_WARPS_PER_SM // warps, 32)
    waves = math.ceil(programs / slots)
    fill = programs / (waves * slots)
    busy = min(1.0, programs / (2.0 * c.sm_count))
    per_thread = xblock * min(rblock, max(R, 1)) / (32.0 * warps)
    spill = 1.0 + max(0.0, per_thread - 64.0) / 256.0
    looped = 1.0
    if rblock < R:  # a row walked in tiles: each program streams; few warps or narrow tiles
        # leave too few bytes in flight (measured on H200: 4 warps or 1024-wide tiles lose 5-12%)
        looped += (0.05 if warps < 8 else 0.0) + (0.02 if rblock < 2048 else 0.0)
    in_flight = min(programs, slots) * total / programs
    rate = min(c.bandwidth, in_flight / MEMORY_LATENCY)
    return total / rate / max(0.05, busy) / (0.85 + 0.15 * fill) * spill * looped + 3e-6


__all__ = ["tile_efficiency", "concurrency", "memory_time"]
