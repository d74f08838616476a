"""Long reductions with few outputs are split into partial reductions and a final one
(`passes.split_reduction`; a CPU splits by its threads): the split graph computes what the original does —
checked with the reference interpreter and on the C++ backend — and only column-like sums,
maxima and minima long enough to need it are split."""
import pytest
import sympy
import torch

import tilefuse
from torch.fx.experimental.proxy_tensor import make_fx

from tilefuse.compiler import compile_ir
from tilefuse.frontend.to_ir import lower_fx
from tilefuse.ir.graph import Reduce
from tilefuse.ir.interpret import interpret as evaluate
from tilefuse.passes import run_passes
from tilefuse.passes.split_reduction import split_reductions, splits_for


def _graph(fn, *inputs):
    gm = make_fx(fn)(*inputs)
    return run_passes(lower_fx(gm, "g"))


def _reduces(graph):
    return [n for n in graph.nodes.values() if isinstance(n, Reduce)]


def bias_grad(g):
    """A bias gradient: the sum over 8200 rows of a [8200, 72] tensor (not a power of two)."""
    return g.sum(0), g.amax(0), (g * 2.0).float().sum(0).to(torch.bfloat16)


def test_splits_are_chosen_for_occupancy():
    assert splits_for(3072, 8192, 132) == 16  # 48 programs of 64 columns: 16 ranges of 512 rows
    assert splits_for(768, 8192, 132) == 32  # (chunks of at least 256 rows)
    assert splits_for(768, 2048, 132) == 1  # short: one program walks it
    assert splits_for(768, 8192, 0) == 1  # a CPU target
    assert splits_for(100_000, 8192, 132) == 1  # enough programs already
    assert splits_for(3, 8200, 132) == 8  # 8200 = 8·1025: the ranges divide the axis
    assert splits_for(8192, 50_304, 132, columns=False) == 1  # a row per program: 8192 programs
    assert splits_for(30522, 8192, 132) == 1  # 477 blocks of columns, the last one partial: whole
    assert splits_for(30528, 8192, 132) == 2  # (whole blocks: split for occupancy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_graph_computes_the_same(dtype):
    g = torch.randn(8200, 72, dtype=dtype)
    graph = _graph(bias_grad, g)
    before = evaluate(graph, [g])
    n_before = len(_reduces(graph))
    split = split_reductions(graph, 132)
    assert len(_reduces(split)) == 2 * n_before
    parts = [n for n in _reduces(split) if n.name.endswith(tuple("0123456789")) and "_part" in n.name]
    assert parts and all(sympy.sympify(p.shape[0]) == 8 for p in parts)
    after = evaluate(split, [g])
    for b, a in zip(before, after):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-4)
    compiled, _ = compile_ir(split, torch.device("cpu"))  # the two-level plan runs on a backend
    for got, want in zip(compiled(g), [t.double() for t in bias_grad(g.double())]):
        torch.testing.assert_close(got.double(), want, rtol=1e-4 if dtype == torch.float32 else 2e-2, atol=1e-3)


def test_rows_softmax_and_products_are_not_split():
    x = torch.randn(4, 8192)
    w = torch.randn(8192, 8)

    def fn(x, w):
        return torch.softmax(x, -1), x.sum(-1), x @ w

    graph = _graph(fn, x, w)
    names = {n.name for n in _reduces(graph)}
    split = split_reductions(graph, 132)
    # the softmax's max and sum share one pass (kept whole); the row sum walks its contiguous
    # row with one program per row — 4 programs: it is split; the product is the product paths'
    kept = {n.name for n in _reduces(split)} & names
    assert len(kept) == len(names)
    new = [n for n in _reduces(split) if n.name not in names]
    assert len(new) == 1 and len(new[0].ranges) == 1
    for a, b in zip(evaluate(split, [x, w]), evaluate(graph, [x, w])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def norm_grads(g, x):
    """LayerNorm's weight and bias gradients: sums over batch and time (two reduction axes) of
    an elementwise product and of the gradient itself."""
    return (g * x).sum((0, 1)), g.sum((0, 1)), g.amax((0, 1))


def test_reductions_over_several_axes_split_along_their_product():
    g, x = torch.randn(8, 1025, 72), torch.randn(8, 1025, 72)  # 8200 rows: not a power of two
    graph = _graph(norm_grads, g, x)
    whole = _reduces(graph)
    assert all(len(n.ranges) == 2 for n in whole)
    split = split_reductions(graph, 132)
    parts = [n for n in _reduces(split) if "_part" in n.name]
    # the elementwise product summed is an ordinary sum (split), like the others
    assert len(parts) == len(whole) and all(len(p.ranges) == 1 and sympy.sympify(p.shape[0]) == 8 for p in parts)
    for got, want in zip(evaluate(split, [g, x]), evaluate(graph, [g, x])):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    compiled, _ = compile_ir(split, torch.device("cpu"))
    for got, want in zip(compiled(g, x), norm_grads(g.double(), x.double())):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-3)


def test_a_weight_gradient_product_is_not_split():
    a, b = torch.randn(8, 1024, 4), torch.randn(8, 1024, 6)

    def fn(a, b):  # a weight gradient: [4, 6] from a sum over 8192 rows of a product
        return torch.einsum("btm,btn->mn", a, b)

    graph = _graph(fn, a, b)
    (product,) = _reduces(graph)
    assert product.body.op == "mul"  # its factors read different output coordinates
    split = split_reductions(graph, 132)
    assert [n.name for n in _reduces(split)] == [product.name]
    # (against fp64: a sum of 8192 fp32 products differs from eager's by its own order's rounding)
    torch.testing.assert_close(evaluate(split, [a, b])[0], fn(a.double(), b.double()).float(), rtol=1e-4, atol=1e-3)


def test_a_dot_of_two_vectors_is_an_ordinary_sum():
    """bmm([B, 1, K], [B, K, 1]): its factors differ only in unit dims, no matrix dim: split."""
    a, b = torch.randn(2, 1, 16384), torch.randn(2, 16384, 1)
    graph = _graph(torch.bmm, a, b)
    split = split_reductions(graph, 132)
    assert any("_part" in n.name for n in _reduces(split))
    torch.testing.assert_close(evaluate(split, [a, b])[0], torch.bmm(a.double(), b.double()).float(),
                               rtol=1e-4, atol=1e-3)


def kl_loss(a, b):
    """A loss summed to one value that reads each row's log-sum-exp at the reduced row."""
    return torch.nn.functional.kl_div(torch.log_softmax(a, -1), torch.log_softmax(b, -1), log_target=True,
                                      reduction="batchmean")


def test_a_cpu_splits_a_loss_not_a_column_sum():
    """For a CPU (`columns=False`, its threads as SMs) the sum of a loss over 192·512 elements
    splits (its row statistics come from earlier kernels: the sum reads the log-softmax), and
    a sum over rows into 64 columns does not (the CPU's column tile reads each row
    contiguously; the parts would gather); a GPU splits that one too."""
    a, b = torch.randn(192, 512), torch.randn(192, 512)
    assert len(_reduces(split_reductions(_graph(kl_loss, a[:96], b[:96]), 2, columns=False))) == 5  # (short)
    graph = _graph(kl_loss, a, b)
    names = {n.name for n in _reduces(graph)}
    split = split_reductions(graph, 2, columns=False)
    new = [n for n in _reduces(split) if n.name not in names]
    assert len(new) == 1 and new[0].shape[0] == 8, new  # (4 programs per thread, 2 threads)
    (got,), (want,) = evaluate(split, [a, b]), evaluate(_graph(kl_loss, a, b), [a, b])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    g = torch.randn(4096, 64)
    assert len(_reduces(split_reductions(_graph(lambda g: g.sum(0), g), 2, columns=False))) == 1
    assert len(_reduces(split_reductions(_graph(lambda g: g.sum(0), g), 2))) == 2


@pytest.mark.parametrize("rows", [192, 131])
def test_the_cpu_splits_a_loss_over_its_threads(rows, monkeypatch):
    """End to end on the C++ backend with two threads (odd row counts: a split only where
    the chunks divide the axis), against fp64."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    a, b = torch.randn(rows, 512), torch.randn(rows, 512)
    torch._dynamo.reset()
    report = tilefuse.explain(kl_loss, a, b, options={"target": "cpu"})
    sums = [k for k in report.kernels if k.kind == "reduction"]
    assert len(sums) == 3, [k.name for k in sums]  # the row statistics, the parts, their sum
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # (one thread: nothing to spread over)
    torch._dynamo.reset()
    report = tilefuse.explain(kl_loss, a, b, options={"target": "cpu"})
    assert len([k for k in report.kernels if k.kind == "reduction"]) == 2
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    torch._dynamo.reset()
    out = torch.compile(kl_loss, backend="tilefuse", options={"target": "cpu"})(a, b)
    torch.testing.assert_close(out.double(), kl_loss(a.double(), b.double()), rtol=1e-5, atol=1e-7)
