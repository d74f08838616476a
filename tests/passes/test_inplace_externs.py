"""A library scatter (`index_put` with accumulation, as an embedding's gradient is spelt) into a
buffer this graph computes and nothing else reads runs in place; a base read elsewhere, a
graph input or an output keeps the functional call. Each result against eager in fp64."""
import torch

import tilefuse

INDEX_PUT = "aten.index_put.default"
IN_PLACE = "aten.index_put_.default"


def _externs(fn, *args):
    torch._dynamo.reset()
    return [target for r in tilefuse.explain(fn, *args).reports for _, target, _ in r.externs]


def _check(fn, *args):
    torch._dynamo.reset()
    before = [a.clone() for a in args]
    out = torch.compile(fn, backend="tilefuse")(*args)
    for a, b in zip(args, before):
        assert torch.equal(a, b)  # no input written
    ref = fn(*(a.double() if a.is_floating_point() else a for a in args))
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o.double(), r, atol=1e-5, rtol=1e-5)


def _scatter_into_computed(x, idx, v):
    base = torch.zeros_like(x) + x * 0.5
    return torch.ops.aten.index_put(base, [idx], v, True)


def _base_read_twice(x, idx, v):
    base = x * 0.5
    return torch.ops.aten.index_put(base, [idx], v, True), base.sum(0)


def _scatter_into_input(x, idx, v):
    return torch.ops.aten.index_put(x, [idx], v, True) * 2


def test_a_scatter_into_a_buffer_nothing_else_reads_runs_in_place():
    x, idx, v = torch.randn(37, 5), torch.randint(0, 37, (53,)), torch.randn(53, 5)  # repeated rows
    assert _externs(_scatter_into_computed, x, idx, v) == [IN_PLACE]
    _check(_scatter_into_computed, x, idx, v)


def test_a_base_read_elsewhere_or_an_input_keeps_the_functional_call():
    x, idx, v = torch.randn(37, 5), torch.randint(0, 37, (53,)), torch.randn(53, 5)
    for fn in (_base_read_twice, _scatter_into_input):
        assert _externs(fn, x, idx, v) == [INDEX_PUT], fn.__name__
        _check(fn, x, idx, v)


def test_an_embeddings_gradient_accumulates_in_place():
    emb = torch.nn.Embedding(301, 7)
    ids = torch.randint(0, 301, (3, 29))

    def loss(ids):
        return (emb(ids) * torch.arange(7.0)).sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, backend="tilefuse")
    compiled(ids).backward()
    got = emb.weight.grad.clone()
    targets = [t for r in tilefuse.last_compilations(2).reports for _, t, _ in r.externs]
    assert IN_PLACE in targets and INDEX_PUT not in targets, targets
    emb.zero_grad()
    loss(ids).backward()
    torch.testing.assert_close(got, emb.weight.grad)


def test_the_reference_interpreter_scatters_into_a_copy():
    """The reference (`ir.interpret`, verify mode) runs an in-place scatter on a copy of its
    base: its buffers may be views of others (an input's, a constant's)."""
    import sympy

    from tilefuse.ir import dtypes as dt
    from tilefuse.ir.graph import Extern, TensorArg
    from tilefuse.ir.interpret import run_extern

    base, idx, v = torch.randn(6, 3), torch.tensor([1, 4, 1]), torch.randn(3, 3)
    node = Extern("out", dt.float32, (sympy.Integer(6), sympy.Integer(3)), target=torch.ops.aten.index_put_.default,
                  args=(TensorArg("base"), [TensorArg("idx")], TensorArg("v"), True))
    kept = base.clone()
    out = run_extern(node, {"base": base, "idx": idx, "v": v}, {})
    assert torch.equal(base, kept)
    torch.testing.assert_close(out, torch.ops.aten.index_put(kept, [idx], v, True))
