"""The roofline cost model: predicted time of a schedule of a schedule space.

A kernel's time is bounded below by its bytes over the memory bandwidth, its `dot` flops over
the matrix throughput, and its other arithmetic over the vector throughput. The model counts
those for one schedule — including what the schedule changes: how often operand
tiles are re-read, how many programs run concurrently (shared memory, warps), the last
partial wave, and the smaller per-program efficiency of small tiles — and takes the largest.
It ranks and prunes a space before anything is measured; it does not replace measurement.
Each kernel family prices its own space (`KernelFamily.cost`: `tile.roofline` holds the terms
they share); this module reaches them through `tile.registry`.

The ceilings are the device's: measured once per device (`measure_ceilings`) and cached, or
nominal figures where nothing can be measured.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from ..tile.registry import family
from ..tile.schedule import Schedule
from ..tile.space import ScheduleSpace


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


def predict(space: ScheduleSpace, schedule: Schedule, ceilings: Ceilings = NOMINAL) -> float:
    """Predicted seconds of one launch of the space's kernel(s) under `schedule` (inf when the
    sizes are unknown: such spaces are not ranked), by the cost of the family that declared it."""
    return family(space.plan_kind).cost(space, schedule, ceilings)


def rank(space: ScheduleSpace, ceilings: Ceilings = NOMINAL,
         keep: int | None = None, scored: list | None = None) -> list[tuple[float, Schedule]]:
    """The space's schedules by predicted time, best first. A cut to `keep` always keeps
    the rules' default (the measured-good starting point) and the best-predicted schedule
    of each value of the space's `families` (a library call, a persistent program, a looped
    row: alternatives the model's terms cannot rank, each one measurement away from chosen).
    `scored`: the uncut ranking, when the caller has it already (`ceilings` then unused)."""
    if scored is None:
        memo = space.ranking  # (read once: another thread may rank it meanwhile)
        if memo is not None and memo[0] == ceilings:
            scored = memo[1]
        else:
            scored = sorted(((predict(space, s, ceilings), s) for s in space.schedules()), key=lambda x: x[0])
            space.ranking = (ceilings, scored)
    if keep is None or len(scored) <= keep:
        return list(scored)
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


def choose_without_measuring(space: ScheduleSpace, ceilings: Ceilings = NOMINAL) -> Schedule:
    """TILEFUSE_AUTOTUNE=0: the model's best, unless the rules' default is predicted within 10%
    of it (the model is too coarse to overrule a measured rule on a small margin)."""
    # the kind of kernel (a library, a persistent program, ...) is only switched by measurement
    scored = [x for x in rank(space, ceilings)
              if all(x[1].get(k) == space.default.get(k) for k in space.families)]
    best_t, best = scored[0]
    default_t = predict(space, space.default, ceilings)
    if not math.isfinite(best_t) or default_t <= 1.1 * best_t:
        return space.default
    return best


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
        gen = torch.Generator(device=device).manual_seed(0)  # (the user's random stream is left alone)
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device, generator=gen)
        b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device, generator=gen)
        return 2.0 * 8192**3 / timed(lambda: a @ b)

    bandwidth, matrix = copy_bandwidth(), matmul_rate()
    return Ceilings(props.name, bandwidth=bandwidth, matrix_flops=matrix, vector_flops=matrix / 12,
                    sm_count=props.multi_processor_count)


__all__ = ["Ceilings", "NOMINAL", "predict", "rank", "choose_without_measuring", "measure_ceilings"]
