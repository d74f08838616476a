"""The lean Triton launch path (`backends.triton.direct_launch`): the first launch of each
specialisation goes through `JITFunction.run`, later ones through the compiled kernel's own
launcher with the same arguments and constexprs. Checked with stand-ins for Triton's objects
(CI has no GPU); the GPU tests launch real kernels this way."""
from __future__ import annotations

import pytest
import torch

from tilefuse.backends.triton.direct_launch import DirectLaunch, specialisation


class FakeCompiled:
    def __init__(self, log, key):
        self.log, self.key = log, key

    def __getitem__(self, grid):
        assert len(grid) == 3, "the compiled kernel's launcher takes three grid dims"

        def runner(*args):
            self.log.append(("direct", self.key, grid, args))
        return runner


class FakeJIT:
    arg_names = ["x_ptr", "out_ptr", "n", "XBLOCK"]
    compiled_kind = FakeCompiled  # what a first launch returns

    def __init__(self):
        self.log, self.compiled = [], {}

    def __getitem__(self, grid):
        def run(*args, **options):
            key = specialisation(args)
            self.log.append(("run", key, grid, args, options))
            return self.compiled.setdefault(key, self.compiled_kind(self.log, key))
        return run


def test_later_launches_of_a_specialisation_skip_the_generic_path():
    fn = FakeJIT()
    launch = DirectLaunch(fn, {"XBLOCK": 64, "num_warps": 4}, {"XBLOCK": 64})
    x, out = torch.randn(37), torch.empty(37)
    launch((1,), [x, out, 37])
    launch((1,), [x, out, 37])
    launch((2,), [x, out, 37])
    kinds = [entry[0] for entry in fn.log]
    assert kinds == ["run", "direct", "direct"]
    assert fn.log[1][2] == (1, 1, 1) and fn.log[2][2] == (2, 1, 1)
    assert fn.log[1][3] == (x, out, 37, 64)  # the constexpr after the arguments, in signature order
    assert fn.log[0][4] == {"XBLOCK": 64, "num_warps": 4}


def test_a_new_specialisation_goes_through_triton_again():
    fn = FakeJIT()
    launch = DirectLaunch(fn, {"XBLOCK": 64}, {"XBLOCK": 64})
    x, out = torch.randn(64), torch.empty(64)
    launch((1,), [x, out, 37])
    launch((1,), [x, out, 48])  # divisible by 16: another binary in Triton
    launch((1,), [x, out, 1])  # equal to 1: another binary
    launch((1,), [x[1:], out, 37])  # a base address off the 16-byte alignment
    launch((1,), [x, out, 3 << 31])  # 64-bit
    assert [entry[0] for entry in fn.log] == ["run"] * 5
    launch((1,), [x, out, 53])  # the first specialisation again
    assert fn.log[-1][0] == "direct"


def test_unknown_trailing_parameters_keep_the_generic_path():
    fn = FakeJIT()
    fn.arg_names = ["x_ptr", "out_ptr", "n", "XBLOCK", "MYSTERY"]
    launch = DirectLaunch(fn, {"XBLOCK": 64}, {"XBLOCK": 64})
    x, out = torch.randn(8), torch.empty(8)
    for _ in range(3):
        launch((1,), [x, out, 8])
    assert [entry[0] for entry in fn.log] == ["run"] * 3


def test_specialisation_separates_what_triton_separates():
    t = torch.randn(40)
    assert specialisation([t, 1]) != specialisation([t, 2])
    assert specialisation([t, 16]) != specialisation([t, 17])
    assert specialisation([t, 17]) == specialisation([t, 19])
    assert specialisation([t[1:], 17]) != specialisation([t, 17])
    assert specialisation([t, 2.5]) == specialisation([t, 0.5])
    assert specialisation([t, (1 << 31) + 1]) != specialisation([t, 3])


class FakeLaunchedKernel(FakeCompiled):
    """A compiled kernel after its first launch: its launcher and handles are loaded."""

    function, packed_metadata = "function-handle", "packed"

    def run(self, *args):
        self.log.append(("launcher", self.key, args))


class FakeJITWithLaunchers(FakeJIT):
    compiled_kind = FakeLaunchedKernel


def test_later_launches_call_the_launcher_with_the_current_stream(monkeypatch):
    from tilefuse.backends.triton import direct_launch

    monkeypatch.setattr(direct_launch, "_current_stream", lambda: "stream-7")
    fn = FakeJITWithLaunchers()
    launch = DirectLaunch(fn, {"XBLOCK": 64}, {"XBLOCK": 64})
    x, out = torch.randn(37), torch.empty(37)
    launch((1,), [x, out, 37])
    launch((2, 3), [x, out, 37])
    assert [e[0] for e in fn.log] == ["run", "launcher"]
    assert fn.log[1][2] == (2, 3, 1, "stream-7", "function-handle", "packed", None, None, None, x, out, 37, 64)
    # a launch hook (a profiler) is called by the runner: those launches take it
    from triton import knobs

    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):  # a chain of hooks (later Tritons): one added to it
        hook.add(_a_hook)
    else:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", _a_hook)
    try:
        launch((1,), [x, out, 37])
    finally:
        if hasattr(hook, "remove"):
            hook.remove(_a_hook)
    assert fn.log[-1][0] == "direct"
    launch((1,), [x, out, 37])
    assert fn.log[-1][0] == "launcher"


def _a_hook(*args):
    pass


def test_a_callers_key_replaces_the_specialisation():
    """The kernel's launcher passes its own key (sizes, alignments, strides): launches with the
    same key share the kept kernel, another key goes through Triton."""
    fn = FakeJIT()
    launch = DirectLaunch(fn, {"XBLOCK": 64}, {"XBLOCK": 64})
    x, out = torch.randn(37), torch.empty(37)
    launch((1,), [x, out, 37], key=("a",))
    launch((1,), [x, out, 37], key=("a",))
    launch((1,), [x, out, 37], key=("b",))
    assert [e[0] for e in fn.log] == ["run", "direct", "run"]


class OutOfResources(Exception):
    """Named as Triton's `triton.runtime.errors.OutOfResources`, which the launch recognises."""


class FakeJITShortOfSharedMemory(FakeJIT):
    """A kernel whose binary fits the device's shared memory only at `fits` stages or fewer."""

    def __init__(self, fits):
        super().__init__()
        self.fits = fits

    def __getitem__(self, grid):
        run = super().__getitem__(grid)

        def refusing(*args, **options):
            if options.get("num_stages", 1) > self.fits:
                self.log.append(("refused", options["num_stages"]))
                raise OutOfResources(f"out of resource: shared memory, Required: {options['num_stages'] * 65536}, "
                                     "Hardware limit: 232448. Reducing block sizes or `num_stages` may help.")
            return run(*args, **options)
        return refusing


def test_a_launch_refused_for_resources_runs_with_fewer_stages():
    fn = FakeJITShortOfSharedMemory(fits=2)
    launch = DirectLaunch(fn, {"XBLOCK": 64, "num_stages": 5}, {"XBLOCK": 64})
    x, out = torch.randn(37), torch.empty(37)
    launch((1,), [x, out, 37])
    assert [e for e in fn.log if e[0] == "refused"] == [("refused", 5), ("refused", 4), ("refused", 3)]
    assert fn.log[-1][0] == "run" and fn.log[-1][4] == {"XBLOCK": 64, "num_stages": 2}
    assert launch.retries == 3
    # the kept binary serves later launches; a new specialisation starts at the stages that fit
    launch((1,), [x, out, 37])
    assert fn.log[-1][0] == "direct"
    launch((1,), [x, out, 48])
    assert fn.log[-1][0] == "run" and fn.log[-1][4]["num_stages"] == 2 and launch.retries == 3


def test_a_refusal_at_one_stage_or_while_measuring_is_raised():
    x, out = torch.randn(37), torch.empty(37)
    launch = DirectLaunch(FakeJITShortOfSharedMemory(fits=0), {"XBLOCK": 64, "num_stages": 3}, {"XBLOCK": 64})
    with pytest.raises(OutOfResources):
        launch((1,), [x, out, 37])
    assert launch.options["num_stages"] == 1
    tuning = DirectLaunch(FakeJITShortOfSharedMemory(fits=2), {"XBLOCK": 64, "num_stages": 3}, {"XBLOCK": 64},
                          refit=False)
    with pytest.raises(OutOfResources):
        tuning((1,), [x, out, 37])
    assert tuning.options["num_stages"] == 3


def test_other_errors_are_not_retried():
    class Broken(FakeJIT):
        def __getitem__(self, grid):
            def run(*args, **options):
                self.log.append(("run",))
                raise ValueError("not a resource problem")
            return run

    fn = Broken()
    launch = DirectLaunch(fn, {"XBLOCK": 64, "num_stages": 4}, {"XBLOCK": 64})
    with pytest.raises(ValueError):
        launch((1,), [torch.randn(4), torch.empty(4), 4])
    assert fn.log == [("run",)]
