"""A library scatter (`index_put` with accumulation, as an embedding's gradient is spelt) into a
buffer this graph computes and nothing else reads runs in place (accumulating:
`tilefuse::index_put_accumulate_`, `index_add_` along the rows on a CPU); a base read elsewhere,
a graph input or an output keeps the functional call. Each result against eager in fp64, the
row scatter bit for bit against `index_put_`."""
import pytest
import torch

import tilefuse
from tilefuse.frontend.row_scatter import ROWS_FROM, index_put_accumulate_, rows_added

INDEX_PUT = "aten.index_put.default"
IN_PLACE = "aten.index_put_.default"
ROW_SCATTER = "tilefuse.index_put_accumulate_.default"


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


def _overwrite_computed(x, idx, v):
    base = torch.zeros_like(x) + x * 0.5
    return torch.ops.aten.index_put(base, [idx], v, False)


def _scatter_into_input(x, idx, v):
    return torch.ops.aten.index_put(x, [idx], v, True) * 2


def test_a_scatter_into_a_buffer_nothing_else_reads_runs_in_place():
    x, idx, v = torch.randn(37, 5), torch.randint(0, 37, (53,)), torch.randn(53, 5)  # repeated rows
    assert _externs(_scatter_into_computed, x, idx, v) == [IN_PLACE]
    _check(_scatter_into_computed, x, idx, v)


def test_many_accumulated_values_take_the_row_scatter():
    width = ROWS_FROM // 53 + 1
    x, idx, v = torch.randn(37, width), torch.randint(-37, 37, (53,)), torch.randn(53, width)
    assert _externs(_scatter_into_computed, x, idx, v) == [ROW_SCATTER]
    _check(_scatter_into_computed, x, idx, v)


def test_a_number_of_values_known_at_run_time_takes_the_row_scatter():
    x, idx, v = torch.randn(37, 5), torch.randint(0, 37, (53,)), torch.randn(53, 5)
    torch._dynamo.reset()
    targets = [t for r in tilefuse.explain(_scatter_into_computed, x, idx, v, dynamic=True).reports
               for _, t, _ in r.externs]
    assert targets == [ROW_SCATTER], targets
    torch._dynamo.reset()
    compiled = torch.compile(_scatter_into_computed, backend="tilefuse", dynamic=True)
    for rows in (53, 9):
        args = (x, idx[:rows], v[:rows])
        want = _scatter_into_computed(*(a.double() if a.is_floating_point() else a for a in args))
        torch.testing.assert_close(compiled(*args).double(), want, atol=1e-5, rtol=1e-5)


def test_a_write_without_accumulation_runs_in_place_as_index_put_():
    x, idx, v = torch.randn(37, 5), torch.randperm(37)[:11], torch.randn(11, 5)  # distinct rows
    assert _externs(_overwrite_computed, x, idx, v) == [IN_PLACE]
    _check(_overwrite_computed, x, idx, v)


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


@pytest.mark.parametrize("target", ["aten", "tilefuse"])
def test_the_reference_interpreter_scatters_into_a_copy(target):
    """The reference (`ir.interpret`, verify mode) runs an in-place scatter on a copy of its
    base: its buffers may be views of others (an input's, a constant's)."""
    import sympy

    from tilefuse.ir import dtypes as dt
    from tilefuse.ir.graph import Extern, TensorArg
    from tilefuse.ir.interpret import run_extern

    base, idx, v = torch.randn(6, 3), torch.tensor([1, 4, 1]), torch.randn(3, 3)
    op, extra = (torch.ops.aten.index_put_.default, (True,)) if target == "aten" else (index_put_accumulate_, ())
    node = Extern("out", dt.float32, (sympy.Integer(6), sympy.Integer(3)), target=op,
                  args=(TensorArg("base"), [TensorArg("idx")], TensorArg("v")) + extra)
    kept = base.clone()
    out = run_extern(node, {"base": base, "idx": idx, "v": v}, {})
    assert torch.equal(base, kept)
    torch.testing.assert_close(out, torch.ops.aten.index_put(kept, [idx], v, True))


def _both_ways(base, indices, values):
    want = torch.ops.aten.index_put_.default(base.clone(), indices, values, True)
    got = index_put_accumulate_(base.clone(), indices, values)
    return got, want


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("index_shape", [(53,), (3, 29)])
def test_the_row_scatter_adds_the_same_sums_as_index_put(index_dtype, index_shape):
    """Repeated rows and negative indices: bit for bit each row's contributions added in the
    index's order (what the serial `index_put_` computes), and no further from an fp64
    reference than ATen's parallel `index_put_`, which adds in another order."""

    width = ROWS_FROM // 53 + 1  # (enough values to take `index_add_`)
    base = torch.randn(41, width)
    idx = torch.randint(-41, 41, index_shape, dtype=index_dtype)
    values = torch.randn(*index_shape, width)
    assert rows_added(base, [idx], values)
    assert not rows_added(base, [idx[..., :1]], values[..., :1, :])  # too few: index_put_ is faster
    got, want = _both_ways(base, [idx], values)
    in_order = base.clone()
    for i, row in enumerate(idx.reshape(-1).tolist()):
        in_order[row] += values.reshape(-1, width)[i]
    assert torch.equal(got, in_order)
    ref = base.double().index_put_([idx.long()], values.double(), accumulate=True)
    assert (got.double() - ref).abs().max() <= (want.double() - ref).abs().max() * 1.5 + 1e-6


def test_other_scatters_are_index_put_itself():

    base = torch.randn(9, 4000)
    rows, cols = torch.randint(0, 9, (40000,)), torch.randint(0, 4000, (40000,))
    cases = [([rows, cols], torch.randn(40000)),  # two index tensors: single elements
             ([rows], torch.randn(4000)),  # values broadcast over the selected rows
             ([torch.rand(9) > 0.5], torch.randn(4000)),  # a mask
             ([None, cols[:5]], torch.randn(9, 5))]  # a later dim indexed (None: the whole dim)
    for indices, values in cases:
        assert not rows_added(base, indices, values)
        got, want = _both_ways(base, indices, values)
        # (the same call both ways; ATen's parallel path adds repeated elements in any order)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_row_scatter_still_raises_for_an_index_out_of_range():

    for bad in (9, -10):
        with pytest.raises(IndexError, match=f"index {bad} is out of bounds"):
            index_put_accumulate_(torch.zeros(9, 20000), [torch.tensor([1, bad])], torch.randn(2, 20000))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_row_scatter_on_a_gpu_adds_every_row_with_atomics_unless_deterministic():
    """On a GPU every row scatter takes `index_add_` (atomics: the same sums, any order), with
    negative indices wrapped; heavy repetition (a token-type embedding's 8192 rows into one)
    included. Under deterministic algorithms it stays `index_put_`, bit for bit."""

    base = torch.randn(7, 96, device="cuda")
    idx = torch.cat([torch.zeros(3000, dtype=torch.int64), torch.randint(-7, 7, (1001,))]).cuda()
    values = torch.randn(4001, 96, device="cuda")
    assert rows_added(base, [idx], values)
    got = index_put_accumulate_(base.clone(), [idx], values)
    ref = base.double().index_put_([idx], values.double(), accumulate=True)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-3)
    torch.use_deterministic_algorithms(True)
    try:
        assert not rows_added(base, [idx], values)
        want = base.clone().index_put_([idx], values, accumulate=True)
        assert torch.equal(index_put_accumulate_(base.clone(), [idx], values), want)
    finally:
        torch.use_deterministic_algorithms(False)
    assert not rows_added(base.bfloat16(), [idx], values.bfloat16())  # (rounds once, in index_put_)
