"""Elementwise results stored in the order of what they are computed from (`fusion.layout`):
BatchNorm and ReLU over a channels-last convolution store channels-last, so the next
convolution gets the layout it wants; the pointwise kernel walks its output in storage order;
an ATen result is compiled against its traced strides and made to conform when it comes back
otherwise; a buffer an op reads through its storage keeps the layout eager gave it. Results
are checked against an fp64 eager reference on the C++ backend and the Triton interpreter."""
import copy

import pytest
import sympy
import torch

import tilefuse
from tilefuse.config import config
from tilefuse.ir.storage import dense_order, storage_order, strides_for
from backends_on_cpu import CPU_BACKENDS

CL = torch.channels_last


def test_storage_order_reads_strides():
    assert storage_order((2, 3, 5, 7), (105, 35, 7, 1)) == (0, 1, 2, 3)
    assert storage_order((2, 3, 5, 7), (105, 1, 21, 3)) == (0, 2, 3, 1)  # channels-last
    # dims of extent 1 stay beside their logical neighbour, whatever their stride
    assert storage_order((2, 3, 1, 7), (21, 1, 999, 3)) == (0, 3, 1, 2)
    assert storage_order((2, 512, 1, 1), (512, 1, 512, 512)) == (0, 1, 2, 3)
    assert storage_order((4, 6), (0, 1)) is None  # a broadcast dim: no order
    s = sympy.Symbol("s0", integer=True, positive=True)
    assert storage_order((2, s, 3), (3 * s, 3, 1)) is None  # s0 = 1 would tie: undecided
    assert storage_order((s, 3), (1, s)) is None
    assert storage_order((2, s, 3), (3 * s + 3, 3, 1)) == (0, 1, 2)  # decided for every s0 ≥ 1


def test_dense_order_needs_contiguous_runs():
    assert dense_order((2, 3, 5, 7), strides_for((2, 3, 5, 7), (0, 2, 3, 1))) == (0, 2, 3, 1)
    assert dense_order((2, 3, 5, 7), (210, 70, 14, 2)) is None  # every other element
    assert dense_order((2, 3), None) is None


class ConvBlock(torch.nn.Module):
    """conv → BN → ReLU → conv → BN, with a residual add: ResNet's pattern at odd sizes."""

    def __init__(self, cin=3, c=5):
        super().__init__()
        self.c1 = torch.nn.Conv2d(cin, c, 3, padding=1, bias=False)
        self.b1 = torch.nn.BatchNorm2d(c)
        self.c2 = torch.nn.Conv2d(c, c, 1, bias=False)
        self.b2 = torch.nn.BatchNorm2d(c)
        for bn in (self.b1, self.b2):  # statistics that are not the identity
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.data.uniform_(0.5, 1.5)
            bn.bias.data.uniform_(-0.5, 0.5)

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        return torch.relu(self.b2(self.c2(y)) + y)


def _decisions(fn, *args):
    torch._dynamo.reset()
    report = tilefuse.explain(fn, *args)
    return [d for r in report.reports for d in r.decisions if "order, the order of the tensors" in d]


def _check(fn, args, tol=1e-4, reference=None):
    """`reference`: `fn` in fp64 where casting the arguments is not enough (a module)."""
    torch._dynamo.reset()
    out = torch.compile(fn, backend="tilefuse")(*args)
    ref = (reference or fn)(*(a.double() if isinstance(a, torch.Tensor) else a for a in args))
    eager = fn(*args)
    err = (out.double() - ref).abs().max().item()
    eager_err = (eager.double() - ref).abs().max().item()
    assert err <= 2 * eager_err + tol * (1 + ref.abs().max().item()), (err, eager_err)
    assert out.stride() == eager.stride()
    return out


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_batchnorm_relu_between_convolutions_store_channels_last(backend):
    torch.manual_seed(0)
    block = ConvBlock().eval().to(memory_format=CL)
    x = torch.randn(2, 3, 7, 9).to(memory_format=CL)
    with config.patch(target=backend), torch.no_grad():
        decisions = _decisions(block, x)
        assert any("(d0, d2, d3, d1) order" in d for d in decisions), decisions
        _check(block, (x,), reference=copy.deepcopy(block).double())


def test_a_contiguous_model_keeps_row_major():
    torch.manual_seed(0)
    block = ConvBlock().eval()
    x = torch.randn(2, 3, 7, 9)
    with config.patch(target="cpu"), torch.no_grad():
        assert _decisions(block, x) == []
        _check(block, (x,), reference=copy.deepcopy(block).double())


def nhwc_to_conv(x, w):
    """A permuted read: NHWC data viewed as NCHW, scaled, then convolved."""
    y = torch.relu(x.permute(0, 3, 1, 2)) * 1.5
    return torch.nn.functional.conv2d(y, w)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_permuted_read_stores_in_the_source_order(backend):
    torch.manual_seed(0)
    x, w = torch.randn(2, 5, 6, 3), torch.randn(4, 3, 1, 1)
    with config.patch(target=backend):
        decisions = _decisions(nhwc_to_conv, x, w)
        assert any("(d0, d2, d3, d1) order" in d for d in decisions), decisions
        _check(nhwc_to_conv, (x, w))


def majority(a, b, c, w):
    return torch.nn.functional.conv2d(a * 2 + b - c, w)


def test_most_inputs_decide_the_order():
    torch.manual_seed(0)
    a, b, c = (torch.randn(2, 3, 5, 4) for _ in range(3))
    w = torch.randn(2, 3, 1, 1)
    with config.patch(target="cpu"):
        two_of_three = (a.contiguous(memory_format=CL), b, c.contiguous(memory_format=CL), w)
        assert any("(d0, d2, d3, d1)" in d for d in _decisions(majority, *two_of_three))
        _check(majority, two_of_three)
        one_of_three = (a.contiguous(memory_format=CL), b, c, w)
        assert _decisions(majority, *one_of_three) == []
        _check(majority, one_of_three)


def storage_read(x):
    y = x * 2 + 1
    return torch.as_strided(y, (6,), (1,)) * 3


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_storage_reading_op_sees_the_layout_eager_gave_its_argument(backend):
    """`as_strided` reads storage: eager's `x * 2 + 1` of a channels-last `x` is channels-last,
    and the compiled graph must hand it the same storage order."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 5).to(memory_format=CL)
    with config.patch(target=backend):
        torch._dynamo.reset()
        out = torch.compile(storage_read, backend="tilefuse")(x)
        assert torch.allclose(out, storage_read(x))


def test_an_aten_result_in_another_layout_than_traced_is_made_to_conform():
    """Kernels reading an ATen call's result are compiled against its traced strides; when the
    call returns another layout the runtime copies it into the traced one."""
    from irgraphs import GraphBuilder, run_compiled
    from tilefuse.ir import dtypes as dt
    from tilefuse.ir.graph import Extern, TensorArg
    from tilefuse.frontend.values import BufferValue

    shape = tuple(sympy.Integer(n) for n in (2, 3, 4, 5))
    g = GraphBuilder("g")
    x = g.input("x", shape, strides="contiguous")
    traced = strides_for(shape, (0, 2, 3, 1))  # the trace said channels-last...
    ext = g.graph.add(Extern("ext", dt.float32, shape, target=torch.ops.aten.clone.default,
                             target_name="aten.clone.default", args=(TensorArg("x"),), strides=traced))
    e = BufferValue(ext.name, ext.dtype, ext.shape)
    y = g.ctx.pointwise(shape, dt.float32, lambda i: e.load(i) * 2.0)
    graph = g.output(y)
    arg = torch.randn(2, 3, 4, 5)  # ...the call returns row-major
    (out,), _ = run_compiled(graph, [arg])
    assert torch.equal(out, arg * 2)


def heads_for_an_aten_call(x, w, generated_reader, flipped=False):
    """A product's result viewed as heads, [B, S, H·D] read back as [B, H, S, D] (the gradient
    of an attention's output handed to its backward), then read by an ATen call (`cumsum`,
    which tilefuse does not lower) or by a generated kernel only."""
    y = (x @ w).view(2, 7, 3, 4).transpose(1, 2) * 1.5
    if flipped:
        y = y.flip(2)
    return y.sum(-1) if generated_reader else torch.cumsum(y, -1) + 1


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("generated_reader,flipped", [(False, False), (True, False), (False, True)])
def test_a_reshaped_read_is_stored_in_its_source_order_for_an_aten_call(backend, generated_reader, flipped):
    """For an ATen call the reshaped buffer takes the order its source's storage runs through
    it (its kernel is then a straight copy, and the call gets the strides eager would give it),
    also where a dim is read backwards (`flip`: the sequence stays outside the heads); a
    generated reader is left to the divisions-and-strides choice, which keeps row-major here."""
    torch.manual_seed(0)
    x, w = torch.randn(14, 5), torch.randn(5, 12)
    fn = lambda a, b: heads_for_an_aten_call(a, b, generated_reader, flipped)  # noqa: E731
    with config.patch(target=backend):
        decisions = _decisions(fn, x, w)
        assert any("(d0, d2, d1, d3) order" in d for d in decisions) == (not generated_reader), decisions
        _check(fn, (x, w))
