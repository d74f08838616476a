"""Constant scales leave sums of products: the contraction reads the unscaled (low-precision)
operands and the result is multiplied once; values follow the reference interpreter and eager."""
import pytest
import torch

from irgraphs import GraphBuilder
from tilefuse.fusion import plan_graph
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import cast, unary
from tilefuse.ir.graph import Pointwise, Reduce
from tilefuse.ir.interpret import interpret
from tilefuse.passes import hoist_scales, run_passes
from tilefuse.tile.ir import DotTile
from tilefuse.tile.lower import LoweringOptions, lower_plan_kernels


def _scaled_product(m, n, k, scale_q, scale_k, rounded=False, costly=False):
    g = GraphBuilder("g")
    q = g.input("q", (m, k), dt.bfloat16, strides="contiguous")
    kt = g.input("k", (n, k), dt.bfloat16, strides="contiguous")

    def scaled(x, c):
        def body(i):
            v = cast(x.load(i), dt.float32)
            return (unary("exp", v) if costly else v) * c
        s = g.ctx.pointwise((x.shape[0], k), dt.float32, body)
        if rounded:  # a bf16 scaled tensor: its value is not the scale of q
            r = g.ctx.pointwise(s.shape, dt.bfloat16, lambda i: cast(s.load(i), dt.bfloat16))
            return g.ctx.pointwise(s.shape, dt.float32, lambda i: cast(r.load(i), dt.float32))
        return s

    qs, ks = scaled(q, scale_q), scaled(kt, scale_k)
    prod = g.ctx.reduce((m, n), (k,), "sum", lambda i, r: qs.load((i[0], r[0])) * ks.load((i[1], r[0])),
                        dt.float32)
    return g.output(prod), prod.name


def _inputs(m, n, k):
    return [torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()]


def test_scales_leave_the_sum_and_values_are_kept():
    graph, name = _scaled_product(9, 13, 20, 0.37, 1 / 2.9)
    args = _inputs(9, 13, 20)
    before = interpret(graph, args)[0]
    hoist_scales(graph)
    node = graph[name]
    assert isinstance(node, Pointwise)
    (raw,) = [n for n in graph.nodes.values() if isinstance(n, Reduce)]
    assert raw.inputs() == {"q", "k"}  # reads the bf16 inputs, not the fp32 scaled copies
    torch.testing.assert_close(interpret(graph, args)[0], before, rtol=1e-6, atol=1e-6)


def test_the_product_runs_on_low_precision_operands():
    graph, _ = _scaled_product(33, 17, 40, 0.5, 0.25)
    graph = run_passes(graph)
    (plan,) = plan_graph(graph).kernels
    (tk,) = lower_plan_kernels(graph, plan, LoweringOptions())
    dots = [s for s in _walk(tk.body) if isinstance(s, DotTile)]
    assert dots and all(d.input_dtype == dt.bfloat16 for d in dots)


@pytest.mark.parametrize("kind", ["rounded", "costly"])
def test_scales_of_rounded_or_costly_factors_stay(kind):
    graph, name = _scaled_product(5, 6, 7, 0.5, 0.5, rounded=kind == "rounded", costly=kind == "costly")
    args = _inputs(5, 6, 7)
    before = interpret(graph, args)[0]
    hoist_scales(graph)
    assert isinstance(graph[name], Reduce)
    torch.testing.assert_close(interpret(graph, args)[0], before)


def _walk(stmts):
    for s in stmts:
        yield s
        yield from _walk(getattr(s, "body", ()) or ())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_scaled_operands_through_torch_compile(dtype):
    """`(q * s) @ (k * t)ᵀ` as users write it, odd sizes, a transposed input, against eager
    under the fp64 rule."""
    import tilefuse  # noqa: F401

    def fn(q, k):
        return (q * 0.125) @ (k / 3.0).transpose(-1, -2)

    q = torch.randn(2, 37, 24).to(dtype)
    k = torch.randn(2, 24, 29).to(dtype).transpose(-1, -2)
    torch._dynamo.reset()
    out = torch.compile(fn, backend="tilefuse")(q, k)
    ref = fn(q.double(), k.double())
    eager_err = (fn(q, k).double() - ref).abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype
    assert (out.double() - ref).abs().max().item() <= 2 * eager_err + tol * (1 + ref.abs().max().item())
