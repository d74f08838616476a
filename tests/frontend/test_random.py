"""Random ops (`frontend.lowerings.random`): dropout, rand, randn and bernoulli become
counter-based random numbers fused into kernels. Each value is checked exactly against the
reference (`ir.philox`) for the seed the graph draws, and each distribution against its
statistics (bounds a correct generator misses with probability below 1e-6)."""
import os

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.config import config
from tilefuse.frontend.lowerings.random import draw_seeds
from tilefuse.ir import philox

from backends_on_cpu import CPU_BACKENDS


def _compiled(fn, backend, dynamic=False):
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="tilefuse", dynamic=dynamic)

    def call(*args):
        with config.patch(target=backend):
            return compiled(*args)

    return call


def _seeds_after(generator_seed: int, count: int) -> list:
    """The seeds a compiled graph with `count` random ops draws right after `manual_seed`."""
    torch.manual_seed(generator_seed)
    return list(draw_seeds(count, torch.device("cpu")))


def _dropout_grad(drop, x):
    x = x.detach().clone().requires_grad_()
    y = drop(x)
    y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
    return y.detach(), x.grad


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_dropout_is_the_reference_mask_and_its_gradient(backend):
    x = torch.randn(37, 53) + 3  # no zeros: a zero in the output means dropped
    p = 0.3
    drop = _compiled(lambda x: F.dropout(x, p, training=True), backend)

    def step(x, p):
        return _dropout_grad(drop, x)

    step(x, p)  # compiles (tuning may draw random numbers)
    (seed,) = _seeds_after(5, 1)
    torch.manual_seed(5)
    y, grad = step(x, p)
    keep = philox.uniform_like(seed, x.shape) >= p
    torch.testing.assert_close(y, torch.where(keep, x / (1 - p), 0.0))
    g = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
    torch.testing.assert_close(grad, torch.where(keep, g / (1 - p), 0.0))
    # the kept fraction is 1 - p (2107 elements: 5 standard deviations)
    assert abs(keep.float().mean().item() - (1 - p)) < 5 * (p * (1 - p) / x.numel()) ** 0.5
    # a new call, a new mask; the same generator state, the same mask
    assert not torch.equal(step(x, p)[0], y)
    torch.manual_seed(5)
    assert torch.equal(step(x, p)[0], y)


def test_two_dropouts_of_one_graph_draw_two_masks():
    def two(x):
        return F.dropout(x, 0.5, training=True), F.dropout(x, 0.5, training=True)

    x = torch.rand(64, 65) + 1
    a, b = _compiled(two, "cpu")(x)
    assert not torch.equal(a != 0, b != 0)
    report = tilefuse.explain(two, x)
    assert len(report.externs) == 1, report.externs  # one call draws both seeds


def test_dropout_of_a_transposed_low_precision_input_in_eval_and_training():
    x = (torch.randn(33, 20) + 4).to(torch.bfloat16).t()  # non-contiguous

    def drop(x, training: bool):
        return F.dropout(x * 2, 0.25, training=training)

    out = _compiled(drop, "cpu")(x, False)
    torch.testing.assert_close(out, x * 2, rtol=0, atol=0)
    out = _compiled(drop, "cpu")(x, True)
    kept = out != 0
    # bf16 like eager's kernel: the product in float32, rounded once
    want = ((x * 2).float() / 0.75).to(torch.bfloat16)
    torch.testing.assert_close(out[kept], want[kept], rtol=0, atol=0)
    assert 0.6 < kept.float().mean().item() < 0.9


def test_dropout_with_symbolic_sizes():
    step = _compiled(lambda x: F.dropout(x, 0.5, training=True), "cpu", dynamic=True)
    for n in (17, 40, 123):
        x = torch.rand(n, 9) + 1
        out = step(x)
        kept = out != 0
        torch.testing.assert_close(out[kept], x[kept] * 2)
        assert 0.2 < kept.float().mean().item() < 0.8


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_rand_like_is_uniform_below_one(backend, dtype):
    # (the interpreter's Philox is slow: a smaller tensor there, its statistics on the C++ one)
    x = torch.empty(*((301, 207) if backend == "cpu" else (37, 41)), dtype=dtype)
    step = _compiled(lambda x: torch.rand_like(x) * 2 - 1, backend)
    step(x)
    (seed,) = _seeds_after(11, 1)
    torch.manual_seed(11)
    u = (step(x) + 1) / 2
    assert u.dtype == dtype and 0 <= u.min() and u.max() < 1
    exact = philox.uniform_like(seed, x.shape)
    if dtype in (torch.float32, torch.float64):
        torch.testing.assert_close(u, exact.to(dtype), rtol=0, atol=0)
    if backend == "cpu":
        assert abs(u.double().mean().item() - 0.5) < 0.005  # sd of the mean 0.0011


def test_randn_and_bernoulli_distributions():
    def draw(x, probs):
        return torch.randn_like(x), torch.bernoulli(probs), torch.rand(5, 7)

    x = torch.empty(200, 300)
    probs = torch.linspace(0, 1, 300).expand(200, 300)
    normal, coin, small = _compiled(draw, "cpu")(x, probs)
    assert abs(normal.mean().item()) < 0.03 and abs(normal.std().item() - 1) < 0.03
    assert abs((normal.abs() < 1).float().mean().item() - 0.6827) < 0.015
    assert set(coin.unique().tolist()) <= {0.0, 1.0}
    assert coin[:, 0].sum() == 0 and coin[:, -1].sum() == 200  # p = 0 and p = 1
    # the fraction of ones follows p column by column (pooled over thirds of the columns)
    for lo, hi in ((0, 100), (100, 200), (200, 300)):
        assert abs(coin[:, lo:hi].mean().item() - probs[0, lo:hi].mean().item()) < 0.02
    assert small.shape == (5, 7) and 0 <= small.min() and small.max() < 1


def test_an_explicit_generator_keeps_its_stream():
    """A call with its own torch.Generator is not lowered (its stream is not reproduced): the
    values are the generator's, as in eager."""
    gen = torch.Generator().manual_seed(3)

    def draw(x):
        return torch.rand(x.shape, generator=gen) + x

    x = torch.randn(4, 5)
    got = _compiled(draw, "cpu")(x)
    gen.manual_seed(3)
    assert torch.equal(got, draw(x))


def test_the_first_call_is_repeatable_under_manual_seed():
    """Compiling (tuning included) draws nothing from the user's generator: the same seed gives
    the same masks on a first call as on a later one."""
    def drop(x):
        return F.dropout(x, 0.5, training=True)

    x = torch.rand(40, 33) + 1
    torch.manual_seed(21)
    first = _compiled(drop, "cpu")(x)  # compiles
    torch.manual_seed(21)
    again = _compiled(drop, "cpu")(x)  # compiles again (a reset in between)
    assert torch.equal(first, again)


def test_kernels_on_the_test_device_reproduce_the_reference():
    """On the device the suite runs on (a GPU run: Triton's compiled helper) the values are
    ir.philox's, bit for bit."""
    device = os.environ.get("TILEFUSE_TEST_DEVICE", "cpu")
    torch._dynamo.reset()
    fn = torch.compile(lambda x: torch.rand_like(x) + x, backend="tilefuse")
    x = torch.zeros(129, 67, device=device)
    fn(x)
    torch.manual_seed(8)
    (seed,) = draw_seeds(1, torch.device(device))
    torch.manual_seed(8)
    got = fn(x).cpu()
    assert torch.equal(got, philox.uniform_like(seed.cpu(), x.shape))


def test_origins_name_each_ops_own_line():
    """The seeds' call is moved to the front of the graph; every node keeps the line of the op
    it came from (explain and profiles name the right source lines)."""
    def f(x):
        y = torch.sin(x) * 3
        return F.dropout(y.exp(), 0.2, training=True)

    torch._dynamo.reset()
    report = tilefuse.explain(f, torch.randn(8, 9))
    lines = report.reports[0].graph_ir.splitlines()[1:]
    first = next(i for i, line in enumerate(lines) if "draw_seeds" in line)
    assert first == 0, report.reports[0].graph_ir
    for line in lines:
        if "= sin(" in line or "* 3" in line:
            assert "native_dropout" not in line.split("#")[-1], line
        if "draw_seeds" in line:
            assert "native_dropout" in line.split("#")[-1], line
