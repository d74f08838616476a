"""Products over a handful of terms (`passes.unroll_reductions.PRODUCT_TERMS_MAX`: MoE's
combination of its top-k experts' outputs) are spelt out as pointwise sums, not dots whose tiles
pad k to 16; and on a CPU, rows held whole that are shorter than a vector share a program
(`tile.reduction.SHORT_ROW`). Checked against the IR's interpreter, an fp64 reference and
eager, at sizes no block divides."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from backends_on_cpu import CPU_BACKENDS
from tilefuse.compiler import compile_ir
from tilefuse.config import config
from tilefuse.frontend.to_ir import lower_fx
from tilefuse.fusion.plan import PlanKind
from tilefuse.fusion.planner import plan_graph
from tilefuse.ir.interpret import interpret as evaluate
from tilefuse.passes import run_passes
from tilefuse.passes.unroll_reductions import PRODUCT_TERMS_MAX


def _plan(fn, *inputs):
    graph = run_passes(lower_fx(make_fx(fn)(*inputs), "g"))
    return graph, plan_graph(graph, 1024)


def combine(y, weights):
    """MoE's last step: each token's top-k experts' outputs weighted and summed."""
    return torch.einsum("tkd,tk->td", y, weights / weights.sum(-1, keepdim=True))


@pytest.mark.parametrize("k", [1, 2, 3, PRODUCT_TERMS_MAX])
def test_a_product_over_few_terms_is_pointwise(k):
    y, w = torch.randn(13, k, 77), torch.rand(13, k) + 0.1
    graph, plan = _plan(combine, y, w)
    assert [p.kind for p in plan.kernels] == [PlanKind.POINTWISE]
    want = combine(y.double(), w.double())
    (got,) = evaluate(graph, [y, w])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_a_product_over_more_terms_stays_a_dot():
    a, b = torch.randn(9, PRODUCT_TERMS_MAX + 1), torch.randn(PRODUCT_TERMS_MAX + 1, 31)
    _, plan = _plan(torch.mm, a, b)
    assert [p.kind for p in plan.kernels] == [PlanKind.CONTRACTION]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("strided", [False, True])
def test_few_term_products_compile_to_eager_results(backend, strided):
    """The outputs' terms contiguous or strided (a transposed view)."""
    y = torch.randn(37, 130, 2).transpose(1, 2) if strided else torch.randn(37, 2, 130)
    w = torch.rand(37, 2) + 0.1
    graph, _ = _plan(combine, y, w)
    compiled, _ = compile_ir(graph, torch.device("cpu"), options=config.options({"target": backend}))
    want, eager = combine(y.double(), w.double()), combine(y, w)
    (got,) = compiled(y, w)
    assert (got.double() - want).abs().max() <= (eager.double() - want).abs().max() + 1e-6


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("rows, length", [(301, 3), (1000, 2), (5, 7), (64, 15), (301, 9), (1000, 11)])
def test_short_rows_many_to_a_program(backend, rows, length):
    """Row sums, maxima and a softmax over rows shorter than a vector, rows not a multiple of
    a program's share."""
    x = torch.randn(rows, length)

    def fn(x):
        return x.sum(-1), x.amax(-1), torch.softmax(x, -1)

    graph = run_passes(lower_fx(make_fx(fn)(x), "g"))
    compiled, _ = compile_ir(graph, torch.device("cpu"), options=config.options({"target": backend}))
    for got, want in zip(compiled(x), fn(x.double())):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
