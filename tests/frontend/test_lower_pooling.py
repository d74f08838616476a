"""Max pooling lowered as an unrolled window (`frontend.lowerings.pooling`): values and indices
equal to eager's, ties, NaN and -inf windows, padding, dilation, ceil mode, 2-D and 3-D, low
precision, non-contiguous and symbolic inputs; then through the C++ backend, and trained."""
import pytest
import torch
import torch.nn.functional as F
from lowering_harness import check, rand

F32, BF16 = torch.float32, torch.bfloat16

# (kernel, stride, padding, dilation, ceil_mode)
CONFIGS = [
    (3, 2, 1, 1, False),  # ResNet's stem
    (2, None, 0, 1, False),
    (3, 1, 1, 1, False),
    ((3, 2), (2, 1), (1, 0), 1, True),
    (3, 2, 1, 2, False),
    (2, 3, 1, 1, True),
]


def _pool(config, indices=True):
    k, s, p, d, c = config
    return lambda x: F.max_pool2d(x, k, s, p, d, ceil_mode=c, return_indices=indices)


def _special(x):
    """Ties (values rounded to halves), a NaN, and a corner of -inf (windows of -inf only)."""
    x = (x * 2).round() / 2
    x[..., 0, 0] = x[..., 1, 1] = float("nan")
    x[..., -3:, -3:] = float("-inf")
    return x


@pytest.mark.parametrize("config", CONFIGS)
def test_max_pool2d_values_and_indices(config):
    check(_pool(config), rand(2, 3, 11, 13), names=["values", "indices"])
    check(_pool(config), _special(rand(2, 3, 11, 13)), names=["values", "indices"])


def test_max_pool2d_nan_and_ties_pick_as_eager():
    x = torch.zeros(1, 1, 4, 4)
    x[0, 0, 1, 1] = x[0, 0, 0, 1] = 5.0  # a tie: the first in the window wins
    x[0, 0, 2, 2] = x[0, 0, 3, 3] = float("nan")  # two NaNs: the last wins
    x[0, 0, 2, 3] = 9.0
    check(_pool((2, 2, 0, 1, False)), x, names=["values", "indices"])
    check(_pool((3, 1, 1, 1, False)), x, names=["values", "indices"])


def test_max_pool2d_window_wholly_outside_the_input_starts_where_eager_does():
    """Dilation 2 over padding 1 of a 1×1 input: positions -1 and 1 both miss it; eager's
    index is the window's start stepped into the input (1 per dim: flat 2)."""
    fn = lambda x: F.max_pool2d(x, 2, 1, padding=1, dilation=2, return_indices=True)  # noqa: E731
    check(fn, rand(1, 1, 1, 1), names=["values", "indices"])
    check(fn, rand(2, 3, 2, 3), names=["values", "indices"])


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_max_pool2d_low_precision(dtype):
    check(_pool(CONFIGS[0]), rand(2, 4, 9, 10, dtype=dtype), names=["values", "indices"])


def test_max_pool2d_unbatched_noncontiguous_and_channels_last():
    check(_pool(CONFIGS[0]), rand(3, 11, 13))
    check(_pool(CONFIGS[3]), rand(2, 13, 11, 3).permute(0, 3, 2, 1))
    check(_pool(CONFIGS[0]), rand(2, 5, 12, 12).to(memory_format=torch.channels_last))


def test_max_pool2d_without_indices_fuses_with_its_producer():
    rec = check(lambda x: F.max_pool2d(torch.relu(x) * 2, 3, 2, 1), rand(2, 3, 11, 13))
    assert len(rec.graphs) == 1


def test_max_pool2d_symbolic_shapes():
    fn = _pool(CONFIGS[0])
    check(fn, rand(2, 3, 11, 13), dynamic=True)


def test_max_pool3d():
    fn = lambda x: F.max_pool3d(x, 3, 2, 1, return_indices=True)  # noqa: E731
    check(fn, rand(2, 2, 5, 7, 6), names=["values", "indices"])
    check(fn, _special(rand(1, 2, 5, 7, 6)), names=["values", "indices"])


def test_max_pool_of_integers():
    check(_pool(CONFIGS[0]), torch.randint(-50, 50, (2, 3, 9, 8), dtype=torch.int32), names=["values", "indices"])


def test_large_windows_stay_aten():
    rec = check(lambda x: F.max_pool2d(x, 9, 4), rand(1, 2, 20, 20), allow_extern=("max_pool2d",))
    assert [n.target_name for n in rec.externs()]


# ---------------------------------------------------------------- the C++ backend


@pytest.mark.parametrize("config", CONFIGS)
def test_compiled_max_pool_matches_eager_exactly(config):
    torch._dynamo.reset()
    fn = lambda x: tuple(_pool(config)(x * 2 - 1))  # noqa: E731
    x = _special(rand(2, 5, 11, 13))  # (ties, NaNs, windows of -inf only)
    expected = fn(x)
    actual = torch.compile(fn, backend="tilefuse", options={"target": "cpu"})(x)
    torch.testing.assert_close(actual[0], expected[0], equal_nan=True, rtol=0, atol=0)
    assert torch.equal(actual[1], expected[1])


def test_compiled_max_pool_trains():
    torch._dynamo.reset()
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    x = rand(2, 3, 12, 11, low=-1, high=1)

    def step(x):
        y = F.max_pool2d(torch.relu(conv(x)), 3, 2, 1)
        return (y * y).sum()

    expected = torch.autograd.grad(step(x), conv.weight)[0]
    loss = torch.compile(step, backend="tilefuse", options={"target": "cpu"})(x)
    actual = torch.autograd.grad(loss, conv.weight)[0]
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("target", ["interpret", "cpu"])
def test_a_window_loads_each_position_once(target):
    """A 3-D window with its indices reads each of its 27 positions once per kernel (per run
    of columns on a CPU): the index's selection chain compares every position with the
    window's maximum, and guarded step by step it emitted the maximum again at each step
    (1512 loads, 7.7 MB of C++ that took GCC four minutes)."""
    import re

    import tilefuse

    torch._dynamo.reset()
    fn = lambda x: F.max_pool3d(x, 3, 2, 1, return_indices=True)  # noqa: E731
    x = _special(rand(2, 3, 7, 8, 9))
    compiled = tilefuse.compile(fn, target=target, fallback="error")
    actual, expected = compiled(x), fn(x)
    torch.testing.assert_close(actual[0], expected[0], equal_nan=True, rtol=0, atol=0)
    assert torch.equal(actual[1], expected[1])
    found = tilefuse.last_compilations(1)
    (kernel,) = found.reports[-1].kernels
    source = found.source(kernel.name)
    loads = len(re.findall(r"tl\.load\(" if target == "interpret" else r"ptr_arg0_1\[", source))
    runs = 1 if target == "interpret" else 3  # (a C++ kernel: one loop per run of columns)
    assert 27 <= loads <= 27 * runs, loads
