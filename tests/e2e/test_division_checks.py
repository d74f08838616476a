"""Integer division and remainder by zero through torch.compile: on CPU tensors the generated
kernels raise what eager raises (`RuntimeError('ZeroDivisionError')`) for every integer dtype
and every division op, non-zero divisors give eager's exact results (floor and trunc rounding
of negative operands included), a divisor proven non-zero gets no check, and float division
by zero stays IEEE (inf, nan) as in eager."""
import dataclasses

import pytest
import torch

import tilefuse
from lowered_plans import recorded_lowerings
from tilefuse.compare import compare_outputs, to_fp64
from tilefuse.ir.bounds import CheckError, DivisionByZeroError
from tilefuse.tile.ir import checks_of
from tilefuse.tile.lower import lower_plan_kernels
from tilefuse.tile.target import Target
from backends_on_cpu import CPU_BACKENDS

OPS = {
    "floordiv": lambda a, b: a // b,
    "mod": lambda a, b: a % b,
    "fmod": torch.fmod,
    "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "floor_divide": torch.floor_divide,
    "remainder": torch.remainder,
}
DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]


def _compiled(fn, backend):
    torch._dynamo.reset()
    return torch.compile(fn, backend="tilefuse", dynamic=False)


def _operands(dtype, n=37, seed=0):
    """(a, b): values of both signs (signed dtypes), the dtype's extremes, no zero in b."""
    gen = torch.Generator().manual_seed(seed)
    info = torch.iinfo(dtype)
    a = torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, (n,), generator=gen).to(dtype)
    b = torch.randint(max(info.min, -40), min(info.max, 40) + 1, (n,), generator=gen).to(dtype)
    b[b == 0] = 7
    a[:4] = torch.tensor([info.min, info.max, info.min, info.max]).to(dtype)
    # min / -1 overflows: eager's own int32/int64 trunc division traps on it (SIGFPE), so only
    # the narrow dtypes (computed in int by C++'s promotion) try it
    minus = -1 if dtype in (torch.int8, torch.int16) else -2 if info.min < 0 else 1
    b[:4] = torch.tensor([minus, -1 if info.min < 0 else 2, 3, info.max]).to(dtype)
    return a, b


def _eager_error(fn, *args) -> BaseException:
    with pytest.raises(Exception) as eager:
        fn(*args)
    return eager.value


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", sorted(OPS))
def test_integer_division_matches_eager_and_raises_on_zero(op, dtype, backend):
    def fn(a, b):
        return OPS[op](a, b) + 1  # an epilogue: the division is fused, not the graph's only op

    a, b = _operands(dtype)
    with tilefuse.config.patch(target=backend, fallback="error"):
        compiled = _compiled(fn, backend)
        out = compiled(a, b)
        expected = fn(a, b)
        assert out.dtype == expected.dtype and torch.equal(out, expected), (a, b, out, expected)
        bad = b.clone()
        bad[11] = 0
        eager = _eager_error(fn, a, bad)
        with pytest.raises(type(eager)) as ours:
            compiled(a, bad)
    assert isinstance(ours.value, DivisionByZeroError), repr(ours.value)
    assert str(ours.value) == str(eager) == "ZeroDivisionError"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_unsigned_divisor_at_the_types_maximum(backend):
    """255 is `(uint8)-1`: the signed special case of a -1 divisor must not take it (`u // 255`
    gave -u, `u % 255` 0). A scalar -1 is 255 for a uint8 tensor, as eager casts it."""
    u = torch.tensor([0, 1, 100, 200, 254, 255, 37, 128], dtype=torch.uint8)
    fns = (lambda u: u // 255, lambda u: u // -1, lambda u: u % -1, lambda u: u % 255,
           lambda u: torch.fmod(u, 255), lambda u: u // u.flip(0).clamp(min=1) + u % torch.full_like(u, 255))
    for fn in fns:
        with tilefuse.config.patch(target=backend, fallback="error"):
            assert torch.equal(_compiled(fn, backend)(u), fn(u))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_division_by_a_zero_scalar_raises(backend):
    a = torch.arange(-6, 7, dtype=torch.int32)
    for fn in (lambda a: a // 0 + 1, lambda a: torch.remainder(a, 0) * 2, lambda a: torch.fmod(a, 0) - 1):
        eager = _eager_error(fn, a)
        with tilefuse.config.patch(target=backend, fallback="error"):
            with pytest.raises(type(eager)) as ours:
                _compiled(fn, backend)(a)
        assert str(ours.value) == str(eager) == "ZeroDivisionError"


KERNEL_KINDS = {
    # a division in a reduction's body (a row held whole, and a row looped over in tiles),
    # and a divisor read from a gathered row
    "row_sum": (lambda a, b: (a // b).sum(-1), (7, 50)),
    "looped_row": (lambda a, b: (a % b).amax(-1), (3, 9000)),
    "gathered": (lambda a, b: a // b[torch.tensor([2, 0, 1])], (3, 20)),
}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", sorted(KERNEL_KINDS))
def test_checks_in_every_kind_of_kernel(kind, backend):
    fn, shape = KERNEL_KINDS[kind]
    gen = torch.Generator().manual_seed(len(kind))
    a = torch.randint(-100, 100, shape, generator=gen)
    b = torch.randint(1, 9, shape, generator=gen) * (torch.randint(0, 2, shape, generator=gen) * 2 - 1)
    with tilefuse.config.patch(target=backend, fallback="error"):
        compiled = _compiled(fn, backend)
        torch.testing.assert_close(compiled(a, b), fn(a, b), rtol=0, atol=0)
        b[1, -1] = 0
        eager = _eager_error(fn, a, b)
        with pytest.raises(DivisionByZeroError) as ours:
            compiled(a, b)
    assert isinstance(eager, RuntimeError) and str(ours.value) == str(eager) == "ZeroDivisionError"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_float_division_by_zero_stays_ieee(backend):
    a = torch.tensor([1.0, -1.0, 0.0, 2.5, -3.0, float("nan")])
    b = torch.tensor([0.0, 0.0, 0.0, -0.0, 2.0, 0.0])
    for fn in (lambda a, b: a / b, lambda a, b: a // b, lambda a, b: a % b, torch.fmod,
               lambda a, b: torch.div(a, b, rounding_mode="trunc"), lambda a, b: a.nan_to_num().int() / b):
        with tilefuse.config.patch(target=backend, fallback="error"):
            out = _compiled(fn, backend)(a, b)
        bad = compare_outputs(out, fn(a, b), fn(*to_fp64((a, b))))
        assert bad is None, str(bad)


def _tile_ir(fn, *args) -> str:
    """The tile IR of every kernel compiling `fn` gives (C++ backend)."""
    with tilefuse.config.patch(target="cpu", fallback="error"):
        ex = tilefuse.explain(fn, *args)
    return "\n".join(k.tile_ir for r in ex.reports for k in r.kernels)


def test_divisor_proven_nonzero_gets_no_check():
    a = torch.randint(-50, 50, (6, 9), dtype=torch.int32)
    b = torch.randint(1, 5, (6, 9), dtype=torch.int32)  # no zero: explain runs the function
    proven = {
        "constant": lambda a, b: a // 3 + a % -7 + torch.fmod(a, 5),
        "trunc by a constant": lambda a, b: torch.div(a, -4, rounding_mode="trunc"),
        "iota shifted past 0": lambda a, b: a // (torch.arange(9, dtype=torch.int32) + 1),
        "clamped away from 0": lambda a, b: a % b.clamp(min=1),
        "a size": lambda a, b: a // a.shape[-1],
        "odd iota": lambda a, b: a // (torch.arange(9, dtype=torch.int32) * 2 - 17),  # in [-17, -1]
    }
    for what, fn in proven.items():
        assert "check" not in _tile_ir(fn, a, b), what
    # the same divisions by values that may be 0 do check (the test can fail)
    assert "ZeroDivisionError" in _tile_ir(lambda a, b: a // b, a, b)
    assert "ZeroDivisionError" in _tile_ir(lambda a, b: a % (b + 1), a, b)
    assert "ZeroDivisionError" in _tile_ir(lambda a, b: a // (torch.arange(9, dtype=torch.int32) * 2 - 9), a, b)
    # an int8 divisor b + 1 may wrap to 0 (127 + 1): not proven by the range [-127, 128]
    assert "ZeroDivisionError" in _tile_ir(lambda a, b: a // (b.clamp(min=0) + 1), a.to(torch.int8), b.to(torch.int8))


def test_generated_source_of_a_constant_divisor_has_no_error_flag():
    a = torch.randint(-50, 50, (64,), dtype=torch.int64)
    with tilefuse.config.patch(target="cpu", fallback="error"):
        ex = tilefuse.explain(lambda a: a // 5 + a % 3, a)
        (kernel,) = [k for r in ex.reports for k in r.kernels]
        assert "tf_err" not in ex.source(kernel.name)
        ex = tilefuse.explain(lambda a, b: a // b, a, a.abs() + 1)
        (kernel,) = [k for r in ex.reports for k in r.kernels]
        assert "tf_err" in ex.source(kernel.name)


def test_kernels_for_cuda_tensors_get_no_divisor_check():
    """Eager CUDA does not raise on an integer division by zero: kernels for CUDA tensors (the
    driver lowers them with divisor_checks off) carry no check — the same plan lowered for CPU
    tensors does."""
    a = torch.randint(-9, 9, (40,))
    with recorded_lowerings() as seen, tilefuse.config.patch(target="interpret", fallback="error"):
        _compiled(lambda a, b: a // b, "interpret")(a, a.abs() + 1)
    (graph, plan, options), = seen
    assert options.divisor_checks
    assert any(checks_of(tk.body) for tk in lower_plan_kernels(graph, plan, options))
    gpu = dataclasses.replace(options, target=Target.gpu(), divisor_checks=False)
    assert not any(checks_of(tk.body) for tk in lower_plan_kernels(graph, plan, gpu))


def test_divisor_checks_follow_the_index_checks_knob():
    a, b = torch.tensor([7, -7, 5]), torch.tensor([2, 0, -3])
    with tilefuse.config.patch(target="cpu", fallback="error", index_checks=False):
        out = _compiled(lambda a, b: a // b, "cpu")(a, b)
    assert out[0] == 3 and out[2] == -2  # no error, no crash; the element divided by 0 is unspecified


def test_division_error_is_the_programs_own():
    # it propagates as eager's error would: not a tilefuse failure, no eager fallback run
    a, b = torch.tensor([7, -7, 5]), torch.tensor([2, 0, -3])
    with tilefuse.config.patch(target="cpu", fallback="eager"):
        with pytest.raises(CheckError):
            _compiled(lambda a, b: a % b, "cpu")(a, b)
