"""Products a GPU library runs get rows padded to 16 bytes when theirs are not (GPT-2's
50257-word head): the output buffer's strides are padded, and the library call computes the
aligned columns and the few left in two calls. Checked on the interpreter target (GPU rules,
ATen's products on CPU tensors) against fp64 references."""
import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.ir.storage import MIN_PADDED_ROW, is_row_padded, padded_row, row_padded_strides
from tilefuse.ir.expr import size_symbol

GPU_RULES = {"matmul": "aten", "target": "interpret"}


def _fp64_close(fn, args, out, slack=2.0):
    ref = fn(*[t.double() for t in args])
    eager_err = (fn(*args).double() - ref).abs().max().item()
    err = (out.double() - ref).abs().max().item()
    assert err <= slack * eager_err + 1e-5 * ref.abs().max().item(), (err, eager_err)


def _padding_decisions(fn, args, options):
    torch._dynamo.reset()
    ex = tilefuse.explain(fn, *args, options=options)
    return [d for r in ex.reports for d in r.decisions if "rows padded" in d], ex


def test_padded_row_lengths():
    assert padded_row(50257, 2) == 50264
    assert padded_row(301, 4) == 304
    assert padded_row(50264, 2) is None  # aligned already
    assert padded_row(MIN_PADDED_ROW - 1, 2) is None  # short rows stay
    assert padded_row(size_symbol(0), 2) is None  # symbolic: not known to be unaligned
    assert padded_row(1001, 8) == 1002


def test_row_padded_strides_are_recognised():
    s0 = size_symbol(0)
    assert row_padded_strides((3, 5, 301), 304) == (5 * 304, 304, 1)
    assert is_row_padded((3, 5, 301), (5 * 304, 304, 1))
    assert is_row_padded((3, 5, 301), (5 * 301, 301, 1))  # contiguous is the unpadded case
    assert is_row_padded((s0, 301), (304, 1))
    assert not is_row_padded((3, 5, 301), (5 * 304, 1, 5))  # rows not innermost
    assert not is_row_padded((3, 5, 301), (304, 5 * 304, 1))  # outer dims swapped
    assert not is_row_padded((5, 301), (300, 1))  # rows overlap


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,fn,shapes", [
    ("linear 3-D", lambda x, w: F.linear(x, w), [(3, 13, 40), (301, 40)]),
    ("linear with bias", lambda x, w, b: F.linear(x, w, b), [(37, 40), (261, 40), (261,)]),
    ("mm", lambda a, b: a @ b, [(29, 40), (40, 259)]),
])
def test_unaligned_rows_are_padded_and_right(dtype, name, fn, shapes):
    args = [torch.randn(s).to(dtype) for s in shapes]
    decisions, ex = _padding_decisions(fn, args, GPU_RULES)
    assert len(decisions) == 1, ex
    assert [k.kind for k in ex.kernels] == ["aten-matmul"], ex
    torch._dynamo.reset()
    out = tilefuse.compile(fn, options=GPU_RULES)(*args)
    n = shapes[-1][-1] if name == "mm" else shapes[1][0]
    assert out.stride(-2) == padded_row(n, out.element_size()), out.stride()
    assert out.shape == fn(*args).shape
    _fp64_close(fn, args, out)


def test_consumers_read_the_padded_product():
    """A padded product read by a reduction and by a pointwise epilogue in the same graph:
    the graph's outputs (computed by generated kernels) keep their traced layouts."""
    x, w, b = torch.randn(3, 13, 40), torch.randn(301, 40), torch.randn(301)
    for fn in (lambda x, w, b: torch.softmax(F.linear(x, w), -1),
               lambda x, w, b: F.gelu(F.linear(x, w, b)) * 2.0):
        decisions, ex = _padding_decisions(fn, (x, w, b), GPU_RULES)
        assert decisions, ex
        torch._dynamo.reset()
        out = tilefuse.compile(fn, options=GPU_RULES)(x, w, b)
        assert out.is_contiguous()
        _fp64_close(fn, (x, w, b), out)


def _head_gradients(logits, w, h, scale):
    """A language model head's backward: the loss's gradient of the logits (a softmax, written
    by a generated kernel) read by the products for the input's and the weight's gradients."""
    grad = torch.softmax(logits.float(), -1).to(logits.dtype) * scale
    return grad @ w, grad.t() @ h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_unaligned_operand_a_generated_kernel_writes_is_padded(dtype):
    """Both products read the gradient (rows of 301 or 1001 elements); it is stored with padded
    rows by its own kernel, and the library's calls read it through them."""
    n = 301 if dtype == torch.float32 else 1001
    args = [torch.randn(37, n).to(dtype), (torch.randn(n, 24) / 5).to(dtype), torch.randn(37, 24).to(dtype),
            torch.tensor(3.0).to(dtype)]
    decisions, ex = _padding_decisions(_head_gradients, args, GPU_RULES)
    assert any("library product reads 16-byte aligned rows" in d for d in decisions), decisions
    assert [k.kind for k in ex.kernels].count("aten-matmul") == 2, ex
    torch._dynamo.reset()
    compiled = tilefuse.compile(_head_gradients, options=GPU_RULES)
    for _ in range(3):  # (the general first call, then the generated call)
        outs = compiled(*args)
    for k in range(2):
        ref = _head_gradients(*[t.double() for t in args])[k]
        eager_err = (_head_gradients(*args)[k].double() - ref).abs().max().item()
        assert (outs[k].double() - ref).abs().max().item() <= 2 * eager_err + 1e-5 * ref.abs().max().item()


def test_training_graphs_keep_their_output_layouts():
    """A forward graph whose outputs the backward reads keeps eager's strides; the product
    and its gradients are right."""
    x = torch.randn(3, 13, 40, requires_grad=True)
    w = torch.randn(301, 40, requires_grad=True)
    fn = lambda x, w: F.linear(x, w)  # noqa: E731
    torch._dynamo.reset()
    out = tilefuse.compile(fn, options=GPU_RULES)(x, w)
    assert out.is_contiguous()
    grad = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, (x, w), grad)
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    rx, rw = torch.autograd.grad(fn(xd, wd), (xd, wd), grad.double())
    torch.testing.assert_close(gx.double(), rx, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gw.double(), rw, atol=1e-4, rtol=1e-4)


def test_no_padding_where_no_library_runs():
    x, w = torch.randn(37, 40), torch.randn(301, 40)
    fn = lambda x, w: F.linear(x, w)  # noqa: E731
    assert not _padding_decisions(fn, (x, w), {"matmul": "generated", "target": "interpret"})[0]
    assert not _padding_decisions(fn, (x, w), {"target": "cpu"})[0]  # MKL takes any leading dim
    short = torch.randn(MIN_PADDED_ROW - 3, 40)
    assert not _padding_decisions(fn, (x, short), GPU_RULES)[0]


def test_symbolic_rows_of_a_padded_product():
    fn = lambda x, w: F.linear(x, w)  # noqa: E731
    w = torch.randn(301, 40)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="tilefuse", options=GPU_RULES)
    for m in (17, 5, 33):
        x = torch.randn(m, 40)
        torch._dynamo.mark_dynamic(x, 0)  # (the rows symbolic; the padded row length is not)
        out = compiled(x, w)
        assert out.stride() == (304, 1)
        _fp64_close(fn, (x, w), out)
