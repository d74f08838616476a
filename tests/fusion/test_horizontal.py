"""Horizontal fusion: independent pointwise outputs over the same number of elements share a
kernel (up to `MAX_HORIZONTAL_STAGES`), whatever their shapes and layouts; an output that
reads another kernel's result, or a different element count, opens its own. Results match
eager on the C++ backend and the Triton interpreter."""
import pytest
import torch

import tilefuse
from tilefuse.config import config
from tilefuse.fusion.planner import MAX_HORIZONTAL_STAGES
from backends_on_cpu import CPU_BACKENDS


def two_outputs(x, y):
    return torch.sin(x) + 1, (y * 2).t()  # (6, 35) and (7, 30): 210 elements each


def many_outputs(*xs):
    return tuple(torch.exp(x) * (k + 1) for k, x in enumerate(xs))


def different_sizes(x, z):
    return torch.sin(x), torch.cos(z)


def _kernels(fn, args, backend):
    with config.patch(target=backend):
        torch._dynamo.reset()
        report = tilefuse.explain(fn, *args)
        torch._dynamo.reset()
        out = torch.compile(fn, backend="tilefuse")(*args)
    for o, e in zip(out, fn(*args)):
        torch.testing.assert_close(o, e)
        assert o.stride() == e.stride()
    return [k for k in report.kernels]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_independent_outputs_share_a_kernel(backend):
    x, y = torch.randn(6, 35), torch.randn(30, 7)
    (k,) = _kernels(two_outputs, (x, y), backend)
    assert len(k.nodes) == 2


def test_at_most_a_few_outputs_per_kernel():
    xs = [torch.randn(5, 9) for _ in range(MAX_HORIZONTAL_STAGES + 1)]
    kernels = _kernels(many_outputs, xs, "cpu")
    assert [len(k.nodes) for k in kernels] == [MAX_HORIZONTAL_STAGES, 1]


def test_different_element_counts_keep_their_kernels():
    kernels = _kernels(different_sizes, (torch.randn(6, 35), torch.randn(6, 34)), "cpu")
    assert len(kernels) == 2
