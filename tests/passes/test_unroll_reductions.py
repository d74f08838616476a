"""Reductions over a few elements become pointwise nodes: the reference interpreter gives the
same values before and after the rewrite (NaN included), eager agrees end to end, and larger,
symbolic or index-valued reductions stay reductions."""
import math

import pytest
import torch

import tilefuse
from irgraphs import GraphBuilder
from tilefuse.ir import dtypes as dt
from tilefuse.ir.graph import Pointwise, Reduce
from tilefuse.ir.interpret import interpret
from tilefuse.passes import unroll_small_reductions
from tilefuse.passes.unroll_reductions import UNROLL_MAX


def _reduction(rows, ranges, combiner, dtype=dt.float32):
    """combiner over the last dims of x[rows, *ranges] of x * 3 - 1."""
    g = GraphBuilder("g")
    x = g.input("x", (rows, *ranges), dtype, strides="contiguous")
    body = g.ctx.pointwise((rows, *ranges), dtype, lambda i: x.load(i) * 3 - 1)
    out = g.ctx.reduce((rows,), tuple(ranges), combiner, lambda i, r: body.load((i[0], *r)), dtype)
    return g.output(out), out.name


@pytest.mark.parametrize("ranges,combiner", [((2,), "sum"), ((3,), "max"), ((5,), "min"), ((4,), "prod"),
                                             ((2, 3), "sum"), ((1,), "sum"), ((UNROLL_MAX,), "max")])
def test_the_terms_are_spelt_out(ranges, combiner):
    rows = 11
    graph, name = _reduction(rows, ranges, combiner)
    x = torch.randn(rows, *ranges)
    x[3].view(-1)[0] = math.nan  # max and min carry NaN, as eager's amax does
    x[5].view(-1)[-1] = math.inf
    before = interpret(graph, [x])[0]
    unroll_small_reductions(graph)
    assert isinstance(graph[name], Pointwise)
    after = interpret(graph, [x])[0]
    torch.testing.assert_close(after, before, equal_nan=True, rtol=1e-5, atol=1e-6)  # (the interpreter sums pairwise)
    y = (x.double() * 3 - 1).flatten(1)
    eager = {"sum": y.sum(1), "max": y.amax(1), "min": y.amin(1), "prod": y.prod(1)}[combiner]
    torch.testing.assert_close(after.double(), eager, equal_nan=True, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ranges,combiner", [((UNROLL_MAX + 1,), "sum"), ((3, 3), "sum"), ((3,), "argmax")])
def test_larger_or_index_valued_reductions_stay(ranges, combiner):
    graph, name = _reduction(7, ranges, combiner)
    unroll_small_reductions(graph)
    assert isinstance(graph[name], Reduce)


def test_a_symbolic_extent_stays():
    import sympy

    g = GraphBuilder("g")
    n = sympy.Symbol("s0", integer=True, positive=True)
    x = g.input("x", (5, n), dt.float32, strides="contiguous")
    out = g.ctx.reduce((5,), (n,), "sum", lambda i, r: x.load((i[0], r[0])), dt.float32)
    graph = g.output(out)
    unroll_small_reductions(graph)
    assert isinstance(graph[out.name], Reduce)


def test_a_top2_weighting_compiles_to_one_pointwise_kernel():
    """`einsum("tkd,tk->td")` over k = 2 experts, renormalised: the sum of the weights and the
    weighting are pointwise, fused with the division (one kernel, no reduction), and match
    eager in fp64."""
    def weighting(y, w):
        w = w / w.sum(dim=-1, keepdim=True)
        return torch.einsum("tkd,tk->td", y, w)

    y, w = torch.randn(13, 2, 37), torch.rand(13, 2) + 0.1
    torch._dynamo.reset()
    out = torch.compile(weighting, backend="tilefuse")(y, w)
    torch.testing.assert_close(out.double(), weighting(y.double(), w.double()), rtol=1e-5, atol=1e-6)
    report = tilefuse.explain(weighting, y, w)
    kinds = [k.kind for k in report.kernels]
    assert kinds == ["pointwise"], kinds


def test_a_sum_of_squares_is_not_a_product():
    """A variance's `(x - m) * (x - m)` over 6 elements is spelt out (the 8-element rule); a
    product of two tensors over 6 terms stays a contraction (the 4-term rule)."""
    g = GraphBuilder("g")
    x = g.input("x", (5, 6), dt.float32, strides="contiguous")
    y = g.input("y", (6, 3), dt.float32, strides="contiguous")
    squares = g.ctx.reduce((5,), (6,), "sum", lambda i, r: x.load((i[0], r[0])) * x.load((i[0], r[0])), dt.float32)
    product = g.ctx.reduce((5, 3), (6,), "sum", lambda i, r: x.load((i[0], r[0])) * y.load((r[0], i[1])), dt.float32)
    graph = g.output(squares, product)
    a, b = torch.randn(5, 6), torch.randn(6, 3)
    before = interpret(graph, [a, b])
    unroll_small_reductions(graph)
    assert isinstance(graph[squares.name], Pointwise) and isinstance(graph[product.name], Reduce)
    for got, want in zip(interpret(graph, [a, b]), before):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
