"""A matrix-vector product whose matrix another row reduction also reads is planned as a
reduction in that row's pass (`Planner.matvec_in_row_pass`): LayerNorm's backward sums dy·w
and dy·w·x̂ over each row in one kernel, with no dot. A product with no such sibling (a
decode step's GEMV) stays a contraction."""
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tilefuse.compiler import compile_ir
from tilefuse.frontend.to_ir import lower_fx
from tilefuse.fusion.plan import PlanKind
from tilefuse.fusion.planner import plan_graph
from tilefuse.ir.interpret import interpret as evaluate
from tilefuse.passes import run_passes


def _plan(fn, *inputs):
    graph = run_passes(lower_fx(make_fx(fn)(*inputs), "g"))
    return graph, plan_graph(graph, 1024)


def layer_norm_backward(dy, x, mean, rstd, w, b):
    return torch.ops.aten.native_layer_norm_backward(dy, x, [x.shape[-1]], mean, rstd, w, b, [True, True, True])


def _norm_inputs(rows=(3, 37), c=72):
    x = torch.randn(*rows, c)
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    return torch.randn(*rows, c), x, mean, torch.rsqrt(var + 1e-5), torch.randn(c), torch.randn(c)


def test_layer_norm_backward_sums_each_row_in_one_pass():
    inputs = _norm_inputs()
    graph, plan = _plan(layer_norm_backward, *inputs)
    kinds = [k.kind for k in plan.kernels]
    assert PlanKind.CONTRACTION not in kinds
    rows = [k for k in plan.kernels if k.kind == PlanKind.REDUCTION and len(k.stages) >= 3]
    assert len(rows) == 1  # dy·w summed, dy·w·x̂ summed, and dx from both: one kernel
    assert any("matrix-vector product" in d for d in plan.decisions)
    want = layer_norm_backward(*(t.double() for t in inputs))
    for got, ref in zip(evaluate(graph, list(inputs)), want):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)
    compiled, _ = compile_ir(graph, torch.device("cpu"))
    for got, ref in zip(compiled(*inputs), want):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)


def test_a_matvec_with_no_sibling_stays_a_product():
    x, w = torch.randn(1, 96), torch.randn(96, 80)

    def decode_step(x, w):  # one token through a weight, and the row's own sum of squares
        return x @ w, (x * x).sum(-1)

    _, plan = _plan(decode_step, x, w)
    assert [k.kind for k in plan.kernels].count(PlanKind.CONTRACTION) == 1
    assert not any("matrix-vector product" in d for d in plan.decisions)


def test_two_matvecs_of_one_matrix_stay_products():
    """The sibling must be an ordinary reduction: two products of one matrix are still dots."""
    m, u, v = torch.randn(40, 96), torch.randn(96, 1), torch.randn(96, 1)

    def fn(m, u, v):
        return m @ u, m @ v

    _, plan = _plan(fn, m, u, v)
    assert [k.kind for k in plan.kernels].count(PlanKind.CONTRACTION) == 2


def test_a_sibling_reading_another_matrix_is_no_reason():
    v, w, y = torch.randn(1, 96), torch.randn(96, 80), torch.randn(80, 96)

    def fn(v, w, y):  # same axis, same number of outputs, another buffer
        return v @ w, y.sum(-1).unsqueeze(0)

    _, plan = _plan(fn, v, w, y)
    assert [k.kind for k in plan.kernels].count(PlanKind.CONTRACTION) == 1
    assert not any("matrix-vector product" in d for d in plan.decisions)


def test_a_sibling_reading_the_matrix_transposed_is_no_reason():
    v, w = torch.randn(1, 96), torch.randn(96, 96)

    def decode_step(v, w):  # W read along its columns by the product, along its rows by the sum
        return v @ w, w.sum(1).unsqueeze(0)

    graph, plan = _plan(decode_step, v, w)
    assert [k.kind for k in plan.kernels].count(PlanKind.CONTRACTION) == 1
    assert not any("matrix-vector product" in d for d in plan.decisions)
    for got, ref in zip(evaluate(graph, [v, w]), decode_step(v.double(), w.double())):
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_a_sibling_sharing_only_a_broadcast_vector_is_no_reason():
    x, w, y, mu = torch.randn(40, 96), torch.randn(96, 1), torch.randn(40, 96), torch.randn(40, 1)

    def fn(x, w, y, mu):  # both read mu; only the product reads x
        return (x - mu) @ w, (y * mu).sum(-1, keepdim=True)

    _, plan = _plan(fn, x, w, y, mu)
    assert [k.kind for k in plan.kernels].count(PlanKind.CONTRACTION) == 1
    assert not any("matrix-vector product" in d for d in plan.decisions)
