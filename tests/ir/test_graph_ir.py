"""Printer, verifier and reference interpreter of the graph IR."""
import pytest
import sympy
import torch

from irgraphs import GraphBuilder
from tilefuse.ir import IRVerificationError, Index, Load, Pointwise, dtypes as dt, unary, verify
from tilefuse.ir.interpret import interpret


def _softmax_like():
    g = GraphBuilder("g")
    x = g.input("x", (5, 9))
    m = g.ctx.reduce((5,), (9,), "max", lambda i, r: x.load((i[0], r[0])), dt.float32)
    e = g.ctx.pointwise((5, 9), dt.float32, lambda i: unary("exp", x.load(i) - m.load((i[0],))))
    return g.output(e)


def test_printer_is_readable():
    text = str(_softmax_like())
    assert "def g(x: float32[5, 9]):" in text
    assert "max[r0<9](x[i0, r0])" in text
    assert "exp((x[i0, i1] - buf" in text


def test_interpreter_matches_torch():
    x = torch.randn(5, 9)
    (out,) = interpret(_softmax_like(), [x])
    torch.testing.assert_close(out, (x - x.amax(-1, keepdim=True)).exp())


def test_interpreter_binds_symbolic_sizes():
    s = sympy.Symbol("s0", integer=True, positive=True)
    g = GraphBuilder("g")
    x = g.input("x", (s, 3))
    y = g.ctx.pointwise((s, 3), dt.float32, lambda i: x.load(i) * Index(i[0].expr, dt.float32))
    graph = g.output(y)
    for n in (2, 7):
        xv = torch.randn(n, 3)
        torch.testing.assert_close(interpret(graph, [xv])[0], xv * torch.arange(n)[:, None])


def test_verifier_rejects_bad_graphs():
    graph = _softmax_like()
    verify(graph)
    bad = GraphBuilder("bad")
    x = bad.input("x", (4,))
    bad.graph.add(Pointwise("p", dt.float32, (sympy.Integer(4),), body=Load("x", (Index(sympy.Integer(0)), Index(sympy.Integer(0))), dt.float32)))
    bad.graph.outputs = ["p"]
    with pytest.raises(IRVerificationError, match="rank"):
        verify(bad.graph)
    bad2 = GraphBuilder("bad2")
    bad2.input("x", (4,))
    bad2.graph.add(Pointwise("p", dt.float32, (sympy.Integer(4),), body=Load("nope", (Index(sympy.Integer(0)),), dt.float32)))
    with pytest.raises(IRVerificationError, match="not defined"):
        verify(bad2.graph)
    del x
