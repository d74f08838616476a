"""The GPU timer of tuning (`backends.targets._CudaTimer`) against a simulated GPU: a launch's
host time is not timed while the host queues it within the GPU's head start, and a host slower
than that (every core busy compiling) gets a longer head start instead of timing the GPU's wait
for the launch. No GPU needed: the events, the sleep and the host clock are fakes."""
import types

import pytest
import torch

from tilefuse.backends import targets


class SimulatedGPU:
    """One stream: work runs in order, each item starting when the GPU is free and the host has
    queued it. The host's clock moves only when the test says so."""

    def __init__(self, ghz: float = 1.0):
        self.host = 0.0
        self.free_at = 0.0
        self.ghz = ghz
        self.sleeps = []

    def perf_counter(self) -> float:
        return self.host

    def enqueue(self, seconds: float) -> None:
        self.free_at = max(self.free_at, self.host) + seconds

    def sleep(self, cycles: int) -> None:
        self.sleeps.append(cycles)
        self.enqueue(cycles / (self.ghz * 1e9))

    def event_class(self):
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self):
                gpu.free_at = max(gpu.free_at, gpu.host)
                self.at = gpu.free_at

            def elapsed_time(self, end):
                return (end.at - self.at) * 1e3

            def synchronize(self):
                gpu.host = max(gpu.host, self.at)

        return Event


@pytest.fixture
def gpu(monkeypatch):
    sim = SimulatedGPU()
    monkeypatch.setattr(torch.cuda, "Event", sim.event_class())
    monkeypatch.setattr(torch.cuda, "_sleep", sim.sleep, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(L2_cache_size=1024))
    monkeypatch.setattr(targets, "time", types.SimpleNamespace(perf_counter=sim.perf_counter))
    return sim


def launch(gpu, host_s: float, gpu_s: float):
    def run():
        gpu.host += host_s  # the Python and driver work before the kernel is queued
        gpu.enqueue(gpu_s)
    return run


def test_a_fast_host_is_not_timed(gpu):
    timer = targets._CudaTimer("cpu")
    kernel = 50e-6
    assert timer(launch(gpu, host_s=30e-6, gpu_s=kernel)) == pytest.approx(kernel)
    assert timer.cycles == targets.HOST_HEADSTART_CYCLES  # one pass, the usual head start


def test_a_slow_host_gets_a_longer_head_start_instead_of_being_timed(gpu):
    """A library call whose host part (0.5 ms) outlasts the 0.4 ms sleep: timed naively, the GPU's
    wait for the launch (0.1 ms) would count as the kernel's; the timer measures again with a
    longer sleep and returns the kernel's own time, and keeps the longer sleep."""
    timer = targets._CudaTimer("cpu")
    kernel = 1e-3
    assert timer(launch(gpu, host_s=0.5e-3, gpu_s=kernel)) == pytest.approx(kernel)
    assert timer.cycles == 4 * targets.HOST_HEADSTART_CYCLES
    assert timer(launch(gpu, host_s=0.5e-3, gpu_s=kernel)) == pytest.approx(kernel)
    assert timer.cycles == 4 * targets.HOST_HEADSTART_CYCLES  # kept, not grown again


def test_a_launch_that_waits_for_itself_keeps_the_usual_head_start(gpu):
    """A host part that never fits (here 1 s: as if the launch waited for the GPU) is tried at
    most three times a sample, and the longer sleeps that did not help are not kept for the
    plan's later samples."""
    timer = targets._CudaTimer("cpu")
    timer(launch(gpu, host_s=1.0, gpu_s=1e-4))
    assert max(gpu.sleeps) == 16 * targets.HOST_HEADSTART_CYCLES  # tried up to 16x
    assert timer.cycles == targets.HOST_HEADSTART_CYCLES


def test_one_slow_launch_of_five_does_not_decide(gpu):
    """A first launch slow on the host (a module loaded lazily) among four quick ones: the
    median GPU time is already right, and no launch is measured again."""
    timer = targets._CudaTimer("cpu")
    kernel = 50e-6
    hosts = iter([5e-3, 30e-6, 30e-6, 30e-6, 30e-6])

    def run():
        gpu.host += next(hosts)
        gpu.enqueue(kernel)

    assert timer(run) == pytest.approx(kernel)
    assert len(gpu.sleeps) == 6  # five launches and the sleep's calibration
    assert timer.cycles == targets.HOST_HEADSTART_CYCLES
