"""Fusion + tile lowering + Triton (interpreter) on hand-built graph IR, checked against the
reference interpreter and an fp64 PyTorch reference."""
import pytest
import sympy
import torch

from irgraphs import GraphBuilder, run_compiled
from tilefuse.config import config
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import Index, binary, cast, const, unary, where
from tilefuse.ir.interpret import interpret

F32 = dt.float32


def _rmsnorm_graph(n, c):
    g = GraphBuilder("rms")
    x = g.input("x", (n, c))
    w = g.input("w", (c,))
    ss = g.ctx.reduce((n, 1), (c,), "sum", lambda i, r: x.load((i[0], r[0])) * x.load((i[0], r[0])), F32)
    out = g.ctx.pointwise((n, c), F32, lambda i: x.load(i) * unary(
        "rsqrt", ss.load((i[0], Index(sympy.Integer(0)))) / float(c) + 1e-6) * w.load((i[1],)))
    return g.output(out)


def _softmax_graph(n, c):
    g = GraphBuilder("softmax")
    x = g.input("x", (n, c))
    mx = g.ctx.reduce((n, 1), (c,), "max", lambda i, r: x.load((i[0], r[0])), F32)
    e = g.ctx.pointwise((n, c), F32, lambda i: unary("exp", x.load(i) - mx.load((i[0], Index(sympy.Integer(0))))))
    s = g.ctx.reduce((n, 1), (c,), "sum", lambda i, r: e.load((i[0], r[0])), F32)
    out = g.ctx.pointwise((n, c), F32, lambda i: e.load(i) / s.load((i[0], Index(sympy.Integer(0)))))
    return g.output(out)


def _layernorm_graph(n, c):
    g = GraphBuilder("layernorm")
    x = g.input("x", (n, c))
    z = Index(sympy.Integer(0))
    s = g.ctx.reduce((n, 1), (c,), "sum", lambda i, r: x.load((i[0], r[0])), F32)
    mean = g.ctx.pointwise((n, 1), F32, lambda i: s.load(i) / float(c))
    d = g.ctx.pointwise((n, c), F32, lambda i: x.load(i) - mean.load((i[0], z)))
    v = g.ctx.reduce((n, 1), (c,), "sum", lambda i, r: d.load((i[0], r[0])) * d.load((i[0], r[0])), F32)
    out = g.ctx.pointwise((n, c), F32, lambda i: d.load(i) * unary("rsqrt", v.load((i[0], z)) / float(c) + 1e-5))
    return g.output(out, mean)


def _check(graph, args, expect_kernels=None, atol=1e-4):
    ref = interpret(graph, args)
    out, report = run_compiled(graph, args)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-4)
    if expect_kernels is not None:
        assert len(report.kernels) == expect_kernels, [k.nodes for k in report.kernels]
    assert not report.externs
    return out, report


@pytest.mark.parametrize("looped", [False, True])
@pytest.mark.parametrize("make", [_rmsnorm_graph, _softmax_graph, _layernorm_graph])
def test_row_normalisations_are_one_kernel(make, looped):
    n, c = 7, 45
    graph = make(n, c)
    args = [torch.randn(n, c) * 3 + 0.5]
    if graph.inputs[-1].name == "w":
        args.append(torch.randn(c))
    with config.patch(persistent_reduction_limit=16 if looped else 8192):
        _check(graph, args, expect_kernels=1)


def test_rmsnorm_matches_fp64_torch():
    n, c = 5, 77
    graph = _rmsnorm_graph(n, c)
    x, w = torch.randn(n, c), torch.randn(c)
    (out,), _ = run_compiled(graph, [x, w])
    xd, wd = x.double(), w.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * wd
    assert (out.double() - ref).abs().max() < 1e-5


def test_gelu_linear_is_one_contraction_kernel():
    m, k, n = 19, 37, 23
    g = GraphBuilder("gelu_linear")
    x = g.input("x", (m, k))
    w = g.input("w", (k, n))
    b = g.input("b", (n,))
    mm = g.ctx.reduce((m, n), (k,), "sum", lambda i, r: x.load((i[0], r[0])) * w.load((r[0], i[1])), F32)

    def gelu(i):
        v = mm.load(i) + b.load((i[1],))
        return v * 0.5 * (1.0 + unary("erf", v * 0.7071067811865476))

    out = g.ctx.pointwise((m, n), F32, gelu)
    graph = g.output(out)
    args = [torch.randn(m, k), torch.randn(k, n), torch.randn(n)]
    (res,), report = _check(graph, args, expect_kernels=1)
    assert report.kernels[0].kind == "contraction"
    assert "dot(" in report.kernels[0].tile_ir
    ref = torch.nn.functional.gelu(args[0].double() @ args[1].double() + args[2].double())
    assert (res.double() - ref).abs().max() < 1e-4


def test_bf16_batched_contraction_accumulates_in_fp32():
    bsz, m, k, n = 3, 17, 40, 9
    g = GraphBuilder("bmm")
    a = g.input("a", (bsz, m, k), dt.bfloat16)
    b = g.input("b", (bsz, k, n), dt.bfloat16)
    mm = g.ctx.reduce((bsz, m, n), (k,), "sum", lambda i, r: cast(a.load((i[0], i[1], r[0])), F32)
                      * cast(b.load((i[0], r[0], i[2])), F32), dt.bfloat16)
    graph = g.output(mm)
    args = [torch.randn(bsz, m, k).bfloat16(), torch.randn(bsz, k, n).bfloat16()]
    (res,), report = run_compiled(graph, args)
    ref = args[0].double() @ args[1].double()
    eager_err = (torch.bmm(*args).double() - ref).abs().max()
    assert (res.double() - ref).abs().max() <= eager_err * 2 + 1e-2
    assert report.kernels[0].kind == "contraction"


@pytest.mark.parametrize("combiner", ["sum", "max", "min", "prod", "argmax", "argmin", "any", "all"])
@pytest.mark.parametrize("looped", [False, True])
def test_reduction_combiners(combiner, looped):
    n, c = 6, 29
    g = GraphBuilder("red")
    x = g.input("x", (n, c))
    if combiner in ("any", "all"):
        body = lambda i, r: binary("gt", x.load((i[0], r[0])), const(-1.0 if combiner == "all" else 1.5, F32))
        out_dtype = dt.bool_
    else:
        body = lambda i, r: x.load((i[0], r[0]))
        out_dtype = dt.int64 if combiner.startswith("arg") else F32
    red = g.ctx.reduce((n,), (c,), combiner, body, out_dtype)
    graph = g.output(red)
    x0 = torch.randn(n, c)
    if combiner == "prod":
        x0 = 1 + 0.1 * x0
    with config.patch(persistent_reduction_limit=8 if looped else 8192):
        _check(graph, [x0], expect_kernels=1)


def test_column_reduction_over_leading_dim():
    n, c = 13, 10
    g = GraphBuilder("colsum")
    x = g.input("x", (n, c))
    red = g.ctx.reduce((c,), (n,), "sum", lambda i, r: x.load((r[0], i[0])), F32)
    graph = g.output(red)
    _check(graph, [torch.randn(n, c)], expect_kernels=1)


def test_padding_reads_are_masked():
    n = 11
    g = GraphBuilder("pad")
    x = g.input("x", (n,))
    i0 = sympy.Symbol("i0", integer=True, nonnegative=True)
    out = g.ctx.pointwise((n + 4,), F32, lambda i: where(
        binary("logical_and", binary("ge", i[0], Index(sympy.Integer(2))), binary("lt", i[0], Index(sympy.Integer(n + 2)))),
        x.load((Index(i[0].expr - 2),)), const(0.0, F32)))
    graph = g.output(out)
    (res,), _ = _check(graph, [torch.randn(n)], expect_kernels=1)
    assert res[0] == 0 and res[-1] == 0
    del i0


@pytest.mark.parametrize("looped", [False, True])
def test_reduction_body_independent_of_axis_and_broadcast_output(looped):
    """sum over an expanded axis counts each element R times; a full-row output that does not
    vary along the row is still written at every position."""
    n, c = 5, 32  # c a power of two: no masks at all in the persistent kernel
    g = GraphBuilder("bcast")
    x = g.input("x", (n,))
    s = g.ctx.reduce((n,), (c,), "sum", lambda i, r: x.load((i[0],)), F32)
    out = g.ctx.pointwise((n, c), F32, lambda i: s.load((i[0],)) + x.load((i[0],)))
    graph = g.output(out)
    xv = torch.randn(n)
    with config.patch(persistent_reduction_limit=8 if looped else 8192):
        (res,), _ = _check(graph, [xv], expect_kernels=1)
    torch.testing.assert_close(res, (xv * (c + 1))[:, None].expand(n, c))
