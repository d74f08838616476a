"""Each backend's `Target` (`tile.target`): the machine facts the tile layer asks for, and the
operations the compiler and the tuner use — generate, load, check against the limits, time.

* `triton`: a CUDA GPU; Triton source, compiled by Triton (in worker processes where there
  are any), timed with CUDA events after an L2 flush.
* `interpret`: the Triton interpreter on CPU tensors (tests); GPU block rules, small tiles.
* `cpu`: C++ kernels built by the system compiler, timed on the host; a kernel the C++ printer
  cannot print runs on the interpreter target instead (`fallback`).
"""
from __future__ import annotations

import time

from .. import logs
from ..tile.target import Machine, Target
from .limits import kernel_check, target_limits


def target_for(backend: str, device) -> Target:
    """The target of `backend` ("triton", "cpu", "interpret") for tensors on `device`."""
    limits = target_limits(backend, device)
    if backend == "cpu":
        from . import cpu

        return Target("cpu", Machine.CPU, threads=parallel_units(device), limits=limits, title="C++",
                      require=cpu.require_compiler, transposes_tiles=False,
                      generate=cpu.generate, load=cpu.load_kernel, load_variant=cpu.CppKernel,
                      check=kernel_check("cpu", limits), timer=_HostTimer,
                      unsupported=cpu.CppUnsupported, fallback=target_for("interpret", device))
    from . import triton

    interpret = backend == "interpret"
    return Target(backend, Machine.GPU, interpret=interpret, sm_count=sm_count(device),
                  tma=_tma_capable(device, backend), limits=limits, title="the Triton interpreter" if interpret else "Triton",
                  generate=lambda kernel: triton.generate(kernel, interpret=interpret),
                  load=lambda kernel, source: triton.load_kernel(kernel, source, interpret),
                  load_variant=lambda kernel, source: triton.TritonKernel(kernel, source, interpret),
                  check=kernel_check(backend, limits), timer=_HostTimer if interpret else _CudaTimer,
                  require=_require_interpreter if interpret else None)


def _require_interpreter() -> None:
    from .triton import interpreter

    interpreter.require()


def sm_count(device) -> int:
    """The GPU's multiprocessors (0 for a CPU device or none to ask)."""
    if device is None or getattr(device, "type", None) != "cuda":
        return 0
    import torch

    if not torch.cuda.is_available():
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def parallel_units(device) -> int:
    """What a plan spreads its programs over: the GPU's multiprocessors, or on a CPU the
    threads PyTorch runs with (a compiled graph's plans, and so their cache keys, depend on
    it: `passes.split_reduction`)."""
    if getattr(device, "type", None) == "cuda":
        return sm_count(device)
    import torch

    return torch.get_num_threads()


def _tma_capable(device, backend: str) -> bool:
    """Hopper or newer, and a Triton that builds tensor descriptors in kernels."""
    if backend != "triton" or getattr(device, "type", None) != "cuda":
        return False
    import torch

    if not torch.cuda.is_available():
        return False
    import triton.language as tl

    return torch.cuda.get_device_capability(device)[0] >= 9 and hasattr(tl, "make_tensor_descriptor")


class _HostTimer:
    """Host time of one call (the median of 5): C++ kernels and the interpreter run synchronously."""

    def __init__(self, device=None):
        self.device = device

    def __call__(self, run) -> float:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        return sorted(times)[2]


#: GPU clock cycles (about 0.2 ms) the timer keeps the GPU busy before each timed launch, so that
#: what is timed is the launch's GPU work, not the host's time to queue it: a library call
#: (views made in Python, then cuBLAS) and a generated kernel compare by their GPU time, as in a
#: model whose host runs ahead of its GPU
HOST_HEADSTART_CYCLES = 400_000
#: the longest head start the timer grows to (about 50 ms)
MAX_HEADSTART_CYCLES = 100_000_000


class _CudaTimer:
    """GPU time of one call: the median of 5 launches, each timed by its own events (a clock or
    cache hiccup in one launch does not make a good configuration look bad), with the L2 cache
    flushed before each, as the kernel benchmark does (and Triton's and Inductor's
    benchmarkers): in a model a layer's weights come from memory, not from the L2 the previous
    launch filled, and a schedule with too few programs to pull them from memory at full rate
    must not look fast because 5 launches read them from L2.

    The host's time to queue a launch is not timed: the GPU sleeps (`HOST_HEADSTART_CYCLES`)
    while the host queues it. A host slower than the sleep — the compile workers busy on every
    core while a cold compile tunes — would leave the GPU waiting inside the timed span, and a
    library call, with more Python before its kernel than a generated one, would look slower
    than it is; so the timer also times the host's part, and when its median outlasted half the
    sleep it measures again with a sleep four times as long (at most twice a sample, up to
    `MAX_HEADSTART_CYCLES`). A longer sleep that made the host fit is kept for the plan's later
    samples; one that did not (a launch that waits for its own GPU work) is not."""

    def __init__(self, device):
        self.device = device
        self.flush = None  # a buffer twice the L2 size, made on the first call, kept while this timer lives
        self.cycles = HOST_HEADSTART_CYCLES
        self.cycle_s = None  # seconds per cycle of the GPU's sleep, measured on the first call

    def __call__(self, run) -> float:
        import torch

        if self.flush is None:
            l2 = getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 0) or (128 << 20)
            self.flush = torch.empty(2 * l2 // 4, dtype=torch.int32, device=self.device)
        sleep = getattr(torch.cuda, "_sleep", None)
        cycles = self.cycles
        for attempt in range(3):  # (a launch that waits for its own GPU work never fits: 3 tries)
            times, host = self._launches(torch, run, sleep, cycles)
            if sleep is None or host <= 0.5 * cycles * self._cycle_s(torch, sleep):
                self.cycles = cycles  # (kept for later samples only where it made the host fit)
                break
            if attempt == 2 or cycles >= MAX_HEADSTART_CYCLES:
                break
            logs.log("tune", "timer: the host took %.0f us to queue a launch (GPU %.0f us), longer than half the "
                     "GPU's head start of %.0f us: measured again with %d cycles", host * 1e6, times[2] * 1e3,
                     cycles * self._cycle_s(torch, sleep) * 1e6, min(4 * cycles, MAX_HEADSTART_CYCLES))
            cycles = min(4 * cycles, MAX_HEADSTART_CYCLES)
        return times[len(times) // 2] / 1e3

    def _launches(self, torch, run, sleep, cycles: int) -> tuple:
        """(sorted GPU ms of 5 launches, the median host time in seconds to queue one: one slow
        launch among them does not decide, as it does not decide the GPU time either)."""
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(5)]
        hosts = []
        for start, end in events:
            self.flush.zero_()
            if sleep is not None:  # the GPU waits while the host queues the launch
                sleep(cycles)
            start.record()
            t0 = time.perf_counter()
            run()
            hosts.append(time.perf_counter() - t0)
            end.record()
        events[-1][1].synchronize()
        return sorted(start.elapsed_time(end) for start, end in events), sorted(hosts)[len(hosts) // 2]

    def _cycle_s(self, torch, sleep) -> float:
        """Seconds per cycle of the GPU's sleep (measured once)."""
        if self.cycle_s is None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            sleep(HOST_HEADSTART_CYCLES)
            end.record()
            end.synchronize()
            self.cycle_s = start.elapsed_time(end) / 1e3 / HOST_HEADSTART_CYCLES
        return self.cycle_s


__all__ = ["target_for", "sm_count"]
