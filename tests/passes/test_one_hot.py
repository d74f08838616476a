"""Sums over one-hot rows collapse into the selected term (a classification loss's gradient):
values follow the reference interpreter before the rewrite, and eager end to end, NaN included."""
import math

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from irgraphs import GraphBuilder
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import binary, cast, const, where
from tilefuse.ir.graph import Pointwise, Reduce
from tilefuse.ir.interpret import interpret
from tilefuse.passes import collapse_one_hot_sums


def _one_hot_sum(rows, classes, scale_depends_on_class=False, swapped=False, rounded=False):
    """sum over c of where(c == t[i], -1, 0) * s[i] (or * x[i, c]), as nll_loss_backward and
    log_softmax_backward_data spell it."""
    g = GraphBuilder("g")
    t = g.input("t", (rows,), dt.int64, strides="contiguous")
    s = g.input("s", (rows,), dt.float32, strides="contiguous")
    x = g.input("x", (rows, classes), dt.float32, strides="contiguous")

    def one_hot(i):
        hit = binary("eq", i[1], t.load((i[0],))) if not swapped else binary("eq", t.load((i[0],)), i[1])
        return where(hit, const(-1.0, dt.float32), const(0.0, dt.float32))

    hot = g.ctx.pointwise((rows, classes), dt.float32, one_hot)
    if scale_depends_on_class:
        scaled = g.ctx.pointwise((rows, classes), dt.float32, lambda i: hot.load(i) * x.load(i))
    else:
        scaled = g.ctx.pointwise((rows, classes), dt.float32, lambda i: hot.load(i) * s.load((i[0],)))
    if rounded:  # autocast's bf16 gradient, read back in fp32 by the sum
        low = g.ctx.pointwise((rows, classes), dt.bfloat16, lambda i: cast(scaled.load(i), dt.bfloat16))
        scaled = g.ctx.pointwise((rows, classes), dt.float32, lambda i: cast(low.load(i), dt.float32))
    total = g.ctx.reduce((rows, 1), (classes,), "sum", lambda i, r: scaled.load((i[0], r[0])), dt.float32)
    return g.output(total), total.name


@pytest.mark.parametrize("swapped,rounded", [(False, False), (True, False), (False, True)])
def test_the_sum_becomes_the_selected_term(swapped, rounded):
    rows, classes = 13, 37
    graph, name = _one_hot_sum(rows, classes, swapped=swapped, rounded=rounded)
    t = torch.randint(-3, classes + 3, (rows,))  # some targets select nothing
    s = torch.randn(rows)
    s[2], s[5] = math.inf, math.nan  # unselected terms are 0·inf = NaN in eager: kept
    x = torch.randn(rows, classes)
    before = interpret(graph, [t, s, x])[0]
    collapse_one_hot_sums(graph)
    assert isinstance(graph[name], Pointwise)
    after = interpret(graph, [t, s, x])[0]
    torch.testing.assert_close(after, before, equal_nan=True, rtol=0, atol=0)
    eager = torch.where(torch.arange(classes) == t[:, None], -1.0, 0.0).mul(s[:, None])
    if rounded:
        eager = eager.bfloat16().float()
    eager = eager.sum(1, keepdim=True)
    torch.testing.assert_close(after, eager, equal_nan=True, rtol=0, atol=0)


def test_a_factor_that_depends_on_the_class_keeps_the_sum():
    graph, name = _one_hot_sum(7, 11, scale_depends_on_class=True)
    collapse_one_hot_sums(graph)
    assert isinstance(graph[name], Reduce)


def test_a_single_class_keeps_the_sum():
    """With one class there is no unselected term whose NaN the rewrite would add."""
    graph, name = _one_hot_sum(5, 1)
    collapse_one_hot_sums(graph)
    assert isinstance(graph[name], Reduce)


def test_cross_entropy_backward_has_no_pass_over_the_classes():
    """`F.cross_entropy`'s gradient through the compiled graph: eager's values (fp64 rule), and
    the backward's only reductions are not over the classes any more."""
    torch.manual_seed(0)
    n, classes = 19, 53
    logits = torch.randn(n, classes, requires_grad=True)
    target = torch.randint(0, classes, (n,))
    target[3] = -100  # ignored

    def loss_fn(x, t):
        return F.cross_entropy(x * 1.5, t)

    torch._dynamo.reset()
    compiled = tilefuse.compile(loss_fn, target="cpu")
    (g_c,) = torch.autograd.grad(compiled(logits, target), logits)
    (g_e,) = torch.autograd.grad(loss_fn(logits, target), logits)
    x64 = logits.detach().double().requires_grad_()
    (g_r,) = torch.autograd.grad(F.cross_entropy(x64 * 1.5, target), x64)
    err_c, err_e = (g_c.double() - g_r).abs().max(), (g_e.double() - g_r).abs().max()
    assert err_c <= 2 * err_e + 1e-6
    backward = [r for r in tilefuse.last_compilations().reports if r.graph_name.startswith("backward")][-1]
    kinds = {str(k.kind) for k in backward.kernels if "nll_loss_backward" in k.ops}
    assert kinds and "reduction" not in kinds, [(k.name, k.kind, k.ops) for k in backward.kernels]


def test_a_selected_negative_zero_sums_to_positive_zero():
    """A sum starts from +0: eager's sum of a row whose selected term is −0 is +0."""
    rows, classes = 5, 9
    graph, name = _one_hot_sum(rows, classes)
    t = torch.randint(0, classes, (rows,))
    s = torch.randn(rows)
    s[2] = 0.0  # selected term −1·(+0) = −0
    collapse_one_hot_sums(graph)
    assert isinstance(graph[name], Pointwise)
    got = interpret(graph, [t, s, torch.randn(rows, classes)])[0]
    eager = torch.where(torch.arange(classes) == t[:, None], -1.0, 0.0).mul(s[:, None]).sum(1, keepdim=True)
    assert torch.equal(torch.signbit(got), torch.signbit(eager)) and torch.equal(got, eager)
