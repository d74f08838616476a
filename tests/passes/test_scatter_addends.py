"""`index_put(zeros, I, V, accumulate=True) + X` becomes a scatter into X
(`passes.scatter_addends`): a tied embedding's gradient needs no zero fill and no pass adding
two tables. Where the sum is anything else — a base that is not zeros, a broadcast, a scatter
read elsewhere, no accumulation — the graph keeps it. Results against the IR interpreter, an
fp64 reference and eager."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import tilefuse
from tilefuse import passes
from tilefuse.frontend.to_ir import lower_fx
from tilefuse.ir.graph import Extern, Pointwise, Reduce
from tilefuse.ir.interpret import interpret as evaluate
from tilefuse.passes import run_passes

V, D, N = 37, 6, 23


def _graph(fn, *inputs):
    return run_passes(lower_fx(make_fx(fn)(*inputs), "g"))


def _inputs():
    return torch.randn(N, D), torch.randint(-V, V, (N,)), torch.randn(V, 5), torch.randn(5, D)


def summed(vals, ids, a, b):
    return torch.ops.aten.index_put(torch.zeros(V, D, dtype=vals.dtype), [ids], vals, True) + a @ b


def summed_other_way(vals, ids, a, b):
    return a @ b + torch.ops.aten.index_put(torch.zeros(V, D, dtype=vals.dtype), [ids], vals, True)


@pytest.mark.parametrize("fn", [summed, summed_other_way])
def test_the_scatter_goes_into_the_other_term(fn):
    inputs = _inputs()
    graph = _graph(fn, *inputs)
    (scatter,) = [n for n in graph.nodes.values() if isinstance(n, Extern)]
    assert isinstance(graph[scatter.args[0].name], Reduce)  # into the product's result
    assert not any(isinstance(n, Pointwise) for n in graph.nodes.values()), str(graph)  # no fill, no add
    assert graph.outputs == [scatter.name]
    want = fn(*(t.double() if t.is_floating_point() else t for t in inputs))
    (got,) = evaluate(graph, list(inputs))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def not_zeros(vals, ids, a, b):
    return torch.ops.aten.index_put(torch.ones(V, D, dtype=vals.dtype), [ids], vals, True) + a @ b


def broadcast(vals, ids, a, b):
    return torch.ops.aten.index_put(torch.zeros(V, D, dtype=vals.dtype), [ids], vals, True) + b[0]


def read_twice(vals, ids, a, b):
    s = torch.ops.aten.index_put(torch.zeros(V, D, dtype=vals.dtype), [ids], vals, True)
    return s + a @ b, s.sum()


def overwritten(vals, ids, a, b):
    return torch.ops.aten.index_put(torch.zeros(V, D, dtype=vals.dtype), [torch.arange(5) * 7], vals[:5], False) + a @ b  # distinct rows


@pytest.mark.parametrize("fn", [not_zeros, broadcast, read_twice, overwritten])
def test_other_sums_stay_sums(fn):
    inputs = _inputs()
    graph = _graph(fn, *inputs)
    (scatter,) = [n for n in graph.nodes.values() if isinstance(n, Extern)]
    assert any(isinstance(n, Pointwise) and any(e == scatter.name for e in _reads(n)) for n in graph.nodes.values())
    want = fn(*(t.double() if t.is_floating_point() else t for t in inputs))
    got = evaluate(graph, list(inputs))
    for g, w in zip(got, want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)


def _reads(node):
    from tilefuse.ir.expr import Load, walk

    return {e.buffer for e in walk(node.body) if isinstance(e, Load)}


def test_a_tied_embeddings_gradient_is_one_scatter_into_the_products_result(monkeypatch):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(301, 24)
    head = torch.nn.Linear(24, 301, bias=False)
    head.weight = emb.weight
    norm = torch.nn.LayerNorm(24)

    def loss(ids, tgt):
        return torch.nn.functional.cross_entropy(head(norm(emb(ids))).flatten(0, 1), tgt.flatten())

    ids, tgt = torch.randint(0, 301, (3, 17)), torch.randint(0, 301, (3, 17))
    kernels = []
    for pipeline in (passes.PIPELINE, tuple(p for p in passes.PIPELINE if p[0] != "addends")):
        monkeypatch.setattr(passes, "PIPELINE", pipeline)
        torch._dynamo.reset()
        backward = tilefuse.explain(loss, ids, tgt, options={"graph_cache": False}).reports[-1]
        assert [t for _, t, _ in backward.externs] == ["aten.index_put_.default"]  # (in place; few values)
        kernels.append(len(backward.kernels))
    assert kernels[0] == kernels[1] - 2  # no zero fill, no sum of two tables
    monkeypatch.undo()
    torch._dynamo.reset()
    torch.compile(loss, backend="tilefuse")(ids, tgt).backward()
    got = emb.weight.grad.clone()
    emb.zero_grad()
    loss(ids, tgt).backward()
    eager = emb.weight.grad.clone()
    w64, nw, nb = (p.detach().double().requires_grad_() for p in (emb.weight, norm.weight, norm.bias))
    x = torch.nn.functional.layer_norm(torch.nn.functional.embedding(ids, w64), (24,), nw, nb)
    torch.nn.functional.cross_entropy((x @ w64.T).flatten(0, 1), tgt.flatten()).backward()
    err, eager_err = ((g.double() - w64.grad).abs().max().item() for g in (got, eager))
    assert err <= 2 * eager_err + 1e-7, (err, eager_err)


def fill_also_returned(vals, ids, a, b):
    z = torch.zeros(V, D, dtype=vals.dtype)
    return torch.ops.aten.index_put(z, [ids], vals, True) + a @ b, z


def fill_also_the_values(vals, ids, a, b):
    z = torch.zeros(V, D, dtype=vals.dtype)  # (one fill, read twice by the scatter)
    return torch.ops.aten.index_put(z, [torch.cat([ids, ids])[:V]], torch.zeros(V, D, dtype=vals.dtype), True) + a @ b


@pytest.mark.parametrize("fn", [fill_also_returned, fill_also_the_values])
def test_a_fill_read_elsewhere_stays(fn):
    inputs = _inputs()
    graph = _graph(fn, *inputs)
    want = fn(*(t.double() if t.is_floating_point() else t for t in inputs))
    got = evaluate(graph, list(inputs))
    for g, w in zip(got, want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    out = tilefuse.compile(fn, fallback="error")(*inputs)
    for g, w in zip(out if isinstance(out, tuple) else (out,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recompute", [True, False])
def test_the_sum_keeps_its_traced_layout(recompute):
    """A channels-last sum that the backward reads: the scatter in its place comes back in that
    layout (its strides promised as the sum's), so the gradients read the right elements."""
    n, c, h, w = 6, 4, 3, 5
    ids = torch.randint(0, n, (40,))

    def loss(v, x):
        y = x * 2 + torch.ops.aten.index_put(torch.zeros(n, c, h, w, dtype=v.dtype), [ids], v, True)
        return (y.sin() * torch.arange(c * h * w, dtype=v.dtype).view(c, h, w)).sum(), y

    def grads(fn, dtype):
        torch.manual_seed(0)
        v = torch.randn(40, c, h, w, dtype=dtype, requires_grad=True)
        x = torch.randn(n, c, h, w, dtype=dtype).to(memory_format=torch.channels_last).requires_grad_()
        out, y = fn(v, x)
        out.backward()
        return v.grad, x.grad, y

    torch._dynamo.reset()
    compiled = grads(tilefuse.compile(loss, fallback="error", recompute=recompute), torch.float32)
    eager, ref = grads(loss, torch.float32), grads(loss, torch.float64)
    assert compiled[2].stride() == eager[2].stride()
    for c_, e, r in zip(compiled, eager, ref):
        err, eager_err = ((t.double() - r).abs().max().item() for t in (c_, e))
        assert err <= 4 * eager_err + 1e-5 * (1 + r.abs().max().item()), (err, eager_err)
