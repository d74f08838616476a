"""Verify mode: a deliberately miscompiled kernel is caught on the first run and named — the
first diverging kernel, not a later one that reads its output — with its nodes and error."""
import re
import warnings

import pytest
import torch

import tilefuse
from tilefuse.api import TilefuseError, TilefuseFallbackWarning
from tilefuse.backends.triton.launcher import TritonKernel
from tilefuse.compare import compare_outputs


def f(x, w):
    return torch.relu(x @ w).sum(0) * 2  # forward_<tag>_mm_mm_0: buf2; forward_<tag>_red_relu_sum_mul_1


#: the two kernels of `f`
PRODUCT, REDUCTION = r"forward_[0-9a-f]{6}_mm_mm_0", r"forward_[0-9a-f]{6}_red_relu_sum_mul_1"


def _args():
    torch.manual_seed(0)
    return torch.randn(9, 12), torch.randn(12, 5)  # (K > 8: a product, not spelt out as pointwise)


def _miscompile(monkeypatch, kernel: str, delta: float = 1.0):
    """Make the kernel whose name matches the pattern `kernel` add `delta` to everything it writes."""
    real = TritonKernel.__call__

    def wrong(self, buffers, env):
        real(self, buffers, env)
        if re.fullmatch(kernel, self.kernel.name):
            for p in self.kernel.params:
                if p.kind == "buffer" and p.name in buffers and p.name.startswith("buf"):
                    if p.name in self.kernel.writes:
                        buffers[p.name].add_(delta)

    monkeypatch.setattr(TritonKernel, "__call__", wrong)


def test_correct_graph_passes_silently():
    torch._dynamo.reset()
    with tilefuse.config.patch(verify=True), warnings.catch_warnings():
        warnings.simplefilter("error", TilefuseFallbackWarning)
        out = torch.compile(f, backend="tilefuse")(*_args())
    torch.testing.assert_close(out, f(*_args()))


@pytest.mark.parametrize("kernel,nodes", [(PRODUCT, "buf2"), (REDUCTION, "buf4, buf5")])
def test_names_the_first_diverging_kernel(kernel, nodes, monkeypatch):
    _miscompile(monkeypatch, kernel)
    torch._dynamo.reset()
    with tilefuse.config.patch(verify=True, fallback="error"), pytest.raises(TilefuseError) as info:
        torch.compile(f, backend="tilefuse")(*_args())
    msg = str(info.value)
    assert re.search(f"first diverging kernel: {kernel} ", msg), msg
    assert f"computing {nodes}" in msg, msg
    assert "max error 1 against the reference interpreter" in msg or "max error 2 against" in msg, msg
    assert "tilefuse.explain" in msg
    # the IR definition of the kernel's nodes is shown, and the program line it computes
    assert f"  {nodes.split(', ')[0]}:" in msg
    assert "  from test_verify.py:" in msg and "torch.relu(x @ w)" in msg, msg


def counted(x, w, calls):
    calls.add_(1)  # as a batch norm counts its batches in training: the graph writes an input
    return torch.relu(x @ w).sum(0) * 2


def test_an_input_the_graph_writes_is_read_as_it_was_before_the_call(monkeypatch):
    """The bisection replays the kernels from the inputs as the call found them: a graph that
    increments an input is not reported as diverging at the increment (it was, reading the
    input after the compiled call had written it), but at the kernel that is wrong."""
    _miscompile(monkeypatch, r"forward_[0-9a-f]{6}_red_relu_sum_mul_\d")
    torch._dynamo.reset()
    calls = torch.tensor(7)
    with tilefuse.config.patch(verify=True, fallback="error"), pytest.raises(TilefuseError) as info:
        torch.compile(counted, backend="tilefuse")(*_args(), calls)
    msg = str(info.value)
    assert re.search(r"first diverging kernel: forward_[0-9a-f]{6}_red_relu_sum_mul_\d ", msg), msg


def test_eager_mode_warns_and_returns_eager_results(monkeypatch):
    _miscompile(monkeypatch, REDUCTION, delta=5.0)
    torch._dynamo.reset()
    x, w = _args()
    with tilefuse.config.patch(verify=True, fallback="eager"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(f, backend="tilefuse")
        first, second = compiled(x, w), compiled(x, w)
    torch.testing.assert_close(first, f(x, w))
    torch.testing.assert_close(second, f(x, w))  # the graph runs eagerly from then on
    msgs = [str(w.message) for w in caught if issubclass(w.category, TilefuseFallbackWarning)]
    assert len(msgs) == 1 and re.search(f"first diverging kernel: {REDUCTION}", msgs[0])


def test_without_verify_the_miscompile_goes_unnoticed(monkeypatch):
    """The injected bug is real: without verify mode the wrong result reaches the program."""
    _miscompile(monkeypatch, REDUCTION)
    torch._dynamo.reset()
    x, w = _args()
    out = torch.compile(f, backend="tilefuse")(x, w)
    assert compare_outputs(out, f(x, w), f(x.double(), w.double())) is not None


def test_compare_rule():
    ref = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    eager = torch.tensor([1.0, 2.0, 3.0])
    assert compare_outputs([eager + 1e-6], [eager], [ref]) is None
    assert compare_outputs([eager + 1e-3], [eager], [ref]) is not None
    bf = eager.bfloat16()
    assert compare_outputs([bf], [bf], [ref]) is None
    assert compare_outputs([torch.tensor([1, 2])], [torch.tensor([1, 3])]) is not None
    nan = torch.tensor([float("nan"), 1.0])
    assert compare_outputs([nan], [nan], [nan.double()]) is None
    assert compare_outputs([torch.tensor([0.0, 1.0])], [nan], [nan.double()]) is not None
    assert compare_outputs([torch.zeros(2, 3)], [torch.zeros(3, 2)]) is not None
