"""The roofline cost model: predicted time of a configuration of a schedule space.

A kernel's time is bounded below by its bytes over the memory bandwidth, its `dot` flops over
the matrix throughput, and its other arithmetic over the vector throughput. The model counts
those for one configuration — including what the configuration changes: how often operand
tiles are re-read, how many programs run concurrently (shared memory, warps), the last
partial wave, and the smaller per-program efficiency of small tiles — and takes the largest.
It ranks and prunes a space before anything is measured; it does not replace measurement.

The ceilings are the device's: measured once per device (`measure_ceilings`) and cached, or
nominal figures where nothing can be measured.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from ..tile.space import MAX_WARPS_PER_SM, SMEM_PER_BLOCK, ScheduleSpace


@dataclass(frozen=True)
class Ceilings:
    name: str
    bandwidth: float  # bytes/s, device memory
    matrix_flops: float  # flop/s, tensor cores at the kernels' input precision
    vector_flops: float  # flop/s, fp32 non-tensor arithmetic
    sm_count: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> "Ceilings":
        return Ceilings(**json.loads(text))


#: nominal ceilings when none were measured (an H100/H200-class GPU)
NOMINAL = Ceilings("nominal", bandwidth=4.0e12, matrix_flops=700e12, vector_flops=60e12, sm_count=132)


def _tile_efficiency(bm: int, bn: int, warps: int) -> float:
    """The fraction of peak matrix throughput one program reaches: larger output tiles reuse
    each loaded operand more; 4 warps on a large tile lack the issue slots of 8."""
    eff = min(1.0, (bm * bn / (128.0 * 128.0)) ** 0.35)
    if bm * bn >= 128 * 256 and warps < 8:
        eff *= 0.8
    return eff


def _concurrency(smem: int, warps: int, sm_count: int) -> int:
    per_sm = max(1, min(SMEM_PER_BLOCK // max(smem, 1), MAX_WARPS_PER_SM // warps))
    return sm_count * per_sm


def predict(space: ScheduleSpace, cfg: dict, ceilings: Ceilings = NOMINAL) -> float:
    """Predicted seconds of one launch of the space's kernel(s) under `cfg` (inf when the sizes
    are unknown: such spaces are not ranked)."""
    if space.kind == "contraction":
        return _contraction(space, cfg, ceilings)
    if space.kind == "flash":
        return _flash(space, cfg, ceilings)
    if space.kind == "memory":
        return _memory(space, cfg, ceilings)
    return math.inf


def _memory(space, cfg, c: Ceilings) -> float:
    """Reductions and pointwise kernels: their bytes over the bandwidth, slowed when too few
    programs keep the SMs busy, by a ragged last wave, and by spilling (many elements per
    thread)."""
    s = space.sizes
    total, rows, R = s.get("bytes"), s.get("rows"), s.get("R") or 1
    if total is None or rows is None:
        return math.inf
    xblock, warps = cfg.get("XBLOCK", 1), cfg["warps"]
    rblock = cfg.get("RBLOCK", space.default.get("RBLOCK", R))
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
    return total / c.bandwidth / max(0.05, busy) / (0.85 + 0.15 * fill) * spill * looped + 3e-6


def _contraction(space, cfg, c: Ceilings) -> float:
    s = space.sizes
    M, N, K, batch = s.get("M"), s.get("N"), s.get("K"), s.get("batch") or 1
    if None in (M, N, K):
        return math.inf
    bm, bn, bk, warps, stages = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["warps"], cfg["stages"]
    tm, tn = math.ceil(M / bm), math.ceil(N / bn)
    tiles = tm * tn * batch
    smem = stages * (bm + bn) * bk * space.itemsize
    slots = _concurrency(smem, warps, c.sm_count)
    waves = math.ceil(tiles / slots)
    per_sm = slots // c.sm_count
    # padded work of one wave, spread over the SMs at the tile's efficiency
    flops_per_tile = 2.0 * bm * bn * math.ceil(K / bk) * bk
    sm_rate = c.matrix_flops / c.sm_count * _tile_efficiency(bm, bn, warps) * (1.02 if cfg.get("tma") else 1.0)
    t_compute = waves * min(per_sm, math.ceil(tiles / c.sm_count)) * flops_per_tile / sm_rate
    persistent = bool(cfg.get("persistent"))
    if persistent:  # one program per SM, its tiles back to back
        t_compute = math.ceil(tiles / c.sm_count) * flops_per_tile / sm_rate
    if cfg.get("impl") == "aten":  # the vendor library: the device's measured matrix rate, its own pipelining
        return max(2.0 * M * N * K * batch / c.matrix_flops, (M * K + K * N + M * N) * batch * space.itemsize
                   / c.bandwidth) + 3e-6
    # operands re-read once per output tile row/column; grouped ordering lets L2 serve most
    reread = (M * K * tn + K * N * tm) * batch * space.itemsize / max(1.0, min(cfg.get("GROUP_M", 1), tm) ** 0.5)
    t_memory = (reread + M * N * batch * space.itemsize) / c.bandwidth
    # prologue/epilogue of the software pipeline, per program; a persistent program overlaps
    # the next tile's loads with this tile's epilogue
    pipeline = 1.0 + (0.05 if persistent else 0.15) / stages
    return max(t_compute, t_memory) * pipeline + 3e-6


def _flash(space, cfg, c: Ceilings) -> float:
    s = space.sizes
    M, N, D, batch = s.get("M"), s.get("N"), s.get("D"), s.get("batch") or 1
    if None in (M, N, D):
        return math.inf
    bm, bn, warps, stages = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["warps"], cfg["stages"]
    split = cfg.get("split", 1)
    programs = math.ceil(M / bm) * batch * split
    smem = stages * bn * 2 * D * space.itemsize + bm * D * space.itemsize
    slots = _concurrency(smem, warps, c.sm_count)
    waves = math.ceil(programs / slots)
    keys = math.ceil(N / split / bn) * bn
    flops = 4.0 * bm * keys * D  # two dots per key tile
    vector = 10.0 * bm * keys  # exp2, max, sum, scale per score
    per_sm = min(slots // c.sm_count, math.ceil(programs / c.sm_count))
    sm_rate = c.matrix_flops / c.sm_count * _tile_efficiency(bm, min(bn, D), warps)
    t_compute = waves * per_sm * max(flops / sm_rate, vector / (c.vector_flops / c.sm_count))
    kv_bytes = math.ceil(M / bm) * batch * N * 2 * D * space.itemsize
    t_memory = kv_bytes / c.bandwidth
    merge = 4e-6 if split > 1 else 0.0
    return max(t_compute, t_memory) * (1.0 + 0.15 / stages) + 3e-6 + merge


def rank(space: ScheduleSpace, ceilings: Ceilings = NOMINAL, keep: int | None = None) -> list[tuple[float, dict]]:
    """The space's configurations by predicted time, best first. A cut to `keep` always keeps
    the rules' default (the measured-good starting point) and the best-predicted configuration
    of each value of the space's `families` (a library call, a persistent program, a looped
    row: alternatives the model's terms cannot rank, each one measurement away from chosen)."""
    scored = sorted(((predict(space, cfg, ceilings), cfg) for cfg in space.configs()), key=lambda x: x[0])
    if keep is None or len(scored) <= keep:
        return scored
    # each kind of kernel (a combination of family values) gets an equal share of the head
    groups: dict = {}
    for x in scored:
        groups.setdefault(tuple(x[1].get(k) for k in space.families), []).append(x)
    share = max(1, keep // len(groups))
    default = next(x for x in scored if x[1] == space.default)
    must = []
    for group in groups.values():
        picks = [default] if any(x is default for x in group) else []
        picks += [x for x in group if x is not default][:max(0, share - len(picks))]
        must += picks
    head = must + [x for x in scored if not any(x is m for m in must)]
    return sorted(head[:max(keep, len(must))], key=lambda x: x[0])


def choose_without_measuring(space: ScheduleSpace, ceilings: Ceilings = NOMINAL) -> dict:
    """TILEFUSE_AUTOTUNE=0: the model's best, unless the rules' default is predicted within 10%
    of it (the model is too coarse to overrule a measured rule on a small margin)."""
    # the kind of kernel (a library, a persistent program, ...) is only switched by measurement
    scored = [x for x in rank(space, ceilings)
              if all(x[1].get(k) == space.default.get(k) for k in space.families)]
    best_t, best = scored[0]
    default_t = predict(space, space.default, ceilings)
    if not math.isfinite(best_t) or default_t <= 1.1 * best_t:
        return dict(space.default)
    return dict(best)


def measure_ceilings(device) -> Ceilings:
    """Copy bandwidth and bf16 matrix throughput, measured with PyTorch on `device`."""
    import torch

    props = torch.cuda.get_device_properties(device)

    def timed(fn, reps=10):
        fn()
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / reps

    def copy_bandwidth():  # 1 GiB read and written; freed on return
        x = torch.empty(256 * 1024 * 1024, dtype=torch.float32, device=device)
        y = torch.empty_like(x)
        return 2 * x.numel() * 4 / timed(lambda: y.copy_(x))

    def matmul_rate():
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
        b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
        return 2.0 * 8192**3 / timed(lambda: a @ b)

    bandwidth, matrix = copy_bandwidth(), matmul_rate()
    return Ceilings(props.name, bandwidth=bandwidth, matrix_flops=matrix, vector_flops=matrix / 12,
                    sm_count=props.multi_processor_count)


__all__ = ["Ceilings", "NOMINAL", "predict", "rank", "choose_without_measuring", "measure_ceilings"]
