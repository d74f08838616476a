"""Regression tests for bugs found in review; each once produced a wrong result or a crash."""
import os

import pytest
import torch

import tilefuse  # noqa: F401

DEVICE = os.environ.get("TILEFUSE_TEST_DEVICE", "cpu")


def _check(fn, *args, dynamic=None):
    args = tuple(a.to(DEVICE) for a in args)
    torch._dynamo.reset()
    out = torch.compile(fn, backend="tilefuse", dynamic=dynamic)(*args)
    ref = fn(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, equal_nan=True)


def test_negative_index_dividends_use_floor_semantics():
    _check(lambda x: x.roll(2, 1), torch.randn(4, 7), dynamic=True)
    _check(lambda z: z.reshape(12)[:9].flip(0) * 2, torch.arange(12.0).reshape(3, 4))


@pytest.mark.parametrize("shape,fn", [((0, 5), lambda x: x + 1), ((3, 0), lambda x: x.sum(1)),
                                      ((3, 0), lambda x: x.amax(1) if x.numel() else x.sum(1))])
def test_empty_tensors(shape, fn):
    _check(fn, torch.randn(shape))


def test_unsigned_and_bool_reduction_identities():
    u = torch.tensor([[200, 250, 201], [3, 9, 7]], dtype=torch.uint8)
    for fn in (lambda v: v.amin(1), lambda v: v.amax(1), lambda v: v.argmin(1), lambda v: v.argmax(1)):
        _check(fn, u)
    _check(lambda b: b.amax(1), torch.zeros(2, 5, dtype=torch.bool))
    _check(lambda b: b.amin(1), torch.ones(2, 5, dtype=torch.bool))


def test_pytorch_symbolic_functions_in_strides():
    _check(lambda x: x.flip(1)[:, 1:] * 2, torch.randn(4, 7), dynamic=True)


def test_float_floor_divide_and_remainder_match_pytorch():
    a = torch.tensor([1.0, 7.0, -3.5, 5.0, -7.25, 0.3])
    b = torch.tensor([0.1, -0.7, 2.0, -2.0, 0.5, 0.1])
    _check(lambda a, b: a // b, a, b)
    _check(lambda a, b: a % b, a, b)
    _check(lambda a, b: torch.fmod(a, b), a, b)
