"""Measuring during a compile (`tune.tuner.real_tensors`) leaves AOTAutograd's fake-tensor mode
and the Python dispatcher: under the dispatcher ATen's `matmul(a, b, out=c)` computes a new
tensor and copies it into `c`, and a library product was measured a third slower than it runs."""
import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.profiler import profile

from tilefuse.tune.tuner import real_tensors


def _ops(fn) -> set:
    with profile() as prof:
        fn()
    return {e.name for e in prof.events()}


def test_a_library_product_writes_its_output_in_place_while_measured():
    a, b, out = torch.randn(33, 16), torch.randn(40, 16).t(), torch.empty(33, 40)

    def product():
        torch.matmul(a, b, out=out)

    with enable_python_dispatcher():
        assert "aten::copy_" in _ops(product)  # what the compile's context does to it
        with real_tensors():
            assert "aten::copy_" not in _ops(product)
        assert "aten::copy_" in _ops(product)  # (the dispatcher is back afterwards)
    torch.testing.assert_close(out, a @ b)


def test_tensors_made_while_measuring_are_real():
    with FakeTensorMode():
        with real_tensors():
            t = torch.randn(3)
            assert not isinstance(t, torch._subclasses.fake_tensor.FakeTensor)
            assert t.abs().sum() > 0


def test_nothing_changes_until_the_context_is_entered():
    with FakeTensorMode():
        ctx = real_tensors()
        assert isinstance(torch.randn(3), torch._subclasses.fake_tensor.FakeTensor)
        with ctx:
            assert not isinstance(torch.randn(3), torch._subclasses.fake_tensor.FakeTensor)
        assert isinstance(torch.randn(3), torch._subclasses.fake_tensor.FakeTensor)
