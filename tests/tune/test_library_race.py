"""On a CPU at the default tuning level, a static product large enough for the library is raced:
the rules' generated kernel against ATen's matmul (or, for a product with an epilogue, the
library's product and the epilogue's kernel against the fused kernel), and the faster runs.
Which wins depends on the host, so these tests decide the race by a stand-in timer and check
that each outcome compiles the graph that way and computes the right result."""
import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.backends import cpu
from tilefuse.tune import tuner

pytestmark = pytest.mark.skipif(cpu.find_compiler() is None, reason="no C++ compiler")


def _favour(monkeypatch, impl: str, slow_loser_s: float = 0.0) -> list:
    """Make the race's timer call `impl` faster (the loser's samples taking `slow_loser_s` of
    real time each); returns the impls it measured."""
    import time

    seen = []

    def measure(self, schedule):
        self._kernels(schedule)  # built and run once: a candidate that fails still fails
        seen.append(schedule.get("impl"))
        if schedule.get("impl") != impl:
            time.sleep(slow_loser_s)
        return 1e-6 if schedule.get("impl") == impl else 1e-3 + slow_loser_s

    monkeypatch.setattr(tuner._Bench, "measure", measure)
    return seen


def _compile(fn, args, tmp_path, autotune="1"):
    with tilefuse.config.patch(cache_dir=str(tmp_path), backend="cpu"):
        torch._dynamo.reset()
        rep = tilefuse.explain(fn, *args, options={"autotune": autotune})
        torch._dynamo.reset()
        out = tilefuse.compile(fn, options={"autotune": autotune})(*args)
    return [k.kind for k in rep.kernels], out


def _close_to_fp64(fn, args, out):
    ref = fn(*(a.double() for a in args))
    err = (fn(*args).double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 4 * err + 1e-5


def _product(a, b):
    return a @ b


def _gelu_product(a, b):
    return F.gelu(a @ b.T) * 2.0


@pytest.mark.parametrize("winner,kinds", [("aten", ["aten-matmul"]), ("generated", ["contraction"])])
def test_a_plain_product_runs_as_the_race_decides(monkeypatch, tmp_path, winner, kinds):
    seen = _favour(monkeypatch, winner)
    args = [torch.randn(96, 80), torch.randn(80, 72)]  # 552960 multiply-adds
    got, out = _compile(_product, args, tmp_path)
    assert got == kinds
    assert set(seen) == {"aten", "generated"}
    _close_to_fp64(_product, args, out)


@pytest.mark.parametrize("winner,kinds", [("split", ["aten-matmul", "pointwise"]), ("generated", ["contraction"])])
def test_a_product_with_an_epilogue_is_raced_split_against_fused(monkeypatch, tmp_path, winner, kinds):
    seen = _favour(monkeypatch, winner)
    args = [torch.randn(70, 96), torch.randn(88, 96)]
    got, out = _compile(_gelu_product, args, tmp_path)
    assert got == kinds
    assert set(seen) == {"split", "generated"}
    _close_to_fp64(_gelu_product, args, out)


def test_bf16_products_race_too(monkeypatch, tmp_path):
    seen = _favour(monkeypatch, "generated")
    args = [torch.randn(64, 64).bfloat16(), torch.randn(64, 64).bfloat16()]
    got, out = _compile(_product, args, tmp_path)
    assert got == ["contraction"] and set(seen) == {"aten", "generated"}
    torch.testing.assert_close(out, _product(*args), atol=0.05, rtol=0.02)


def test_without_tuning_a_large_product_goes_to_the_library(monkeypatch, tmp_path):
    seen = _favour(monkeypatch, "generated")
    args = [torch.randn(96, 80), torch.randn(80, 72)]
    got, out = _compile(_product, args, tmp_path, autotune="0")
    assert got == ["aten-matmul"] and not seen
    _close_to_fp64(_product, args, out)


def test_a_small_product_is_generated_without_a_race(monkeypatch, tmp_path):
    seen = _favour(monkeypatch, "aten")
    args = [torch.randn(20, 16), torch.randn(16, 24)]  # 7680 multiply-adds
    got, out = _compile(_product, args, tmp_path)
    assert got == ["contraction"] and not seen
    _close_to_fp64(_product, args, out)


def test_symbolic_sizes_go_to_the_library_unraced(monkeypatch, tmp_path):
    seen = _favour(monkeypatch, "generated")
    with tilefuse.config.patch(cache_dir=str(tmp_path), backend="cpu"):
        torch._dynamo.reset()
        compiled = tilefuse.compile(_product, dynamic=True, options={"autotune": "1"})
        b = torch.randn(80, 72)
        for m in (96, 131):
            a = torch.randn(m, 80)
            _close_to_fp64(_product, [a, b], compiled(a, b))
        kinds = [k.kind for k in tilefuse.last_compilations(1).kernels]
    assert kinds == ["aten-matmul"] and not seen


def test_the_race_is_two_schedules():
    from tilefuse.tile.schedule import Schedule
    from tilefuse.tile.space import ScheduleSpace

    default = Schedule({"BLOCK_M": 32, "BLOCK_N": 64, "impl": "generated"})
    space = ScheduleSpace("contraction", {"BLOCK_M": (16, 32, 64), "BLOCK_N": (32, 64), "impl": ("generated", "aten")},
                          default)
    race = tuner.library_race(space)
    assert race.schedules() == [default, default.replace(impl="aten")]


def test_a_slow_library_call_does_not_keep_the_generated_kernel_from_being_timed(monkeypatch, tmp_path):
    """Each sample of the library taking longer than the race's whole budget (a 1024³ fp32
    product in MKL takes 10 ms on a small host) must not end the race before the generated
    kernel is timed."""
    seen = _favour(monkeypatch, "generated", slow_loser_s=0.03)
    args = [torch.randn(96, 80), torch.randn(80, 72)]
    got, out = _compile(_product, args, tmp_path)
    assert got == ["contraction"] and "generated" in seen
    _close_to_fp64(_product, args, out)


def test_a_race_that_cannot_run_leaves_the_product_to_the_library(monkeypatch, tmp_path):
    seen = _favour(monkeypatch, "generated")

    def broken(space):
        raise RuntimeError("no race today")

    monkeypatch.setattr(tuner, "library_race", broken)
    for fn, args, kinds in ((_product, [torch.randn(96, 80), torch.randn(80, 72)], ["aten-matmul"]),
                            (_gelu_product, [torch.randn(70, 96), torch.randn(88, 96)], ["aten-matmul", "pointwise"])):
        got, out = _compile(fn, args, tmp_path)
        assert got == kinds and not seen
        _close_to_fp64(fn, args, out)


def test_the_wide_search_measures_the_library_too(monkeypatch, tmp_path):
    monkeypatch.setitem(tuner.CPU_LEVELS, "max", (3, 0.2))  # a short search for the test
    seen = _favour(monkeypatch, "aten")
    args = [torch.randn(96, 80), torch.randn(80, 72)]
    got, out = _compile(_product, args, tmp_path, autotune="max")
    assert got == ["aten-matmul"] and "aten" in seen and "generated" in seen
    _close_to_fp64(_product, args, out)
