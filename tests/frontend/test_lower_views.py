"""View / movement lowerings: no node for views, composed index maps, PyTorch's clamping
rules for slices, and the assembling ops (cat, pad, scatters)."""
import pytest
import sympy
import torch
from lowering_harness import compile_run, check, noncontig, rand

from tilefuse.ir import Pointwise
from tilefuse.ir.expr import Index, Load, walk

F32, BF16 = torch.float32, torch.bfloat16

VIEWS = [
    ("view_split", lambda x: x.reshape(5, 7, 13, 1).reshape(35, 13)),
    ("view_merge", lambda x: x.reshape(-1)),
    ("view_regroup", lambda x: x.reshape(7, 5, 13)),
    ("view_odd", lambda x: x.reshape(13, 35)),
    ("permute", lambda x: x.permute(2, 0, 1)),
    ("permute_neg", lambda x: x.permute(-1, -3, -2)),
    ("transpose", lambda x: x.transpose(0, 2)),
    ("t", lambda x: x[0].t()),
    ("expand", lambda x: x[:, :1].expand(5, 4, 13)),
    ("expand_new_dims", lambda x: x[0, 0].expand(3, 2, 13)),
    ("expand_minus1", lambda x: x[:1].expand(6, -1, -1)),
    ("slice", lambda x: x[1:4, ::2, 3:]),
    ("slice_step3", lambda x: x[..., 1::3]),
    ("slice_negative", lambda x: x[-3:, :-2, -5:-1]),
    ("slice_oversized", lambda x: x[2:100, -100:3]),
    ("slice_empty", lambda x: x[4:2] + 1),
    ("select", lambda x: x[2]),
    ("select_negative", lambda x: x[:, -1, -2]),
    ("squeeze", lambda x: x[:, :1, None].squeeze()),
    ("squeeze_dim", lambda x: x[:, :1].squeeze(1)),
    ("squeeze_dims", lambda x: x[:1, :1].squeeze((0, 1))),
    ("squeeze_noop", lambda x: x.squeeze(1)),
    ("unsqueeze", lambda x: x.unsqueeze(1).unsqueeze(-1)),
    ("flip", lambda x: x.flip(0, -1)),
    ("roll", lambda x: x.roll(3, 2)),
    ("roll_multi", lambda x: x.roll((-2, 9), (0, 1))),
    ("roll_flat", lambda x: x.roll(17)),
    ("repeat", lambda x: x[0].repeat(2, 1, 3)),
    ("unfold", lambda x: x.unfold(2, 4, 3)),
    ("diagonal", lambda x: x.diagonal(1, 1, 2)),
    ("diagonal_neg", lambda x: x.diagonal(-2)),
    ("split", lambda x: x.split(3, dim=2)),
    ("split_sizes", lambda x: x.split([2, 5, 6], dim=-1)),
    ("chunk", lambda x: x.chunk(3, dim=1)),
    ("unbind", lambda x: x.unbind(1)),
    ("narrow", lambda x: x.narrow(2, 3, 4)),
    ("movedim", lambda x: x.movedim(0, -1)),
    ("view_of_permute", lambda x: x.permute(1, 0, 2).reshape(7, 65)),
    ("slice_of_view", lambda x: x.reshape(35, 13)[3:30:4, 1::2].reshape(-1)),
    ("tril", lambda x: torch.tril(x[0])),
    ("triu", lambda x: torch.triu(x[0], 2)),
]


@pytest.mark.parametrize("name,fn", VIEWS, ids=[v[0] for v in VIEWS])
def test_view(name, fn):
    rec = check(lambda x: tuple(t * 2 for t in fn(x)) if name in ("split", "split_sizes", "chunk", "unbind")
                else fn(x) * 2, rand(5, 7, 13))
    # a view followed by one pointwise op is one node per output, never a copy
    if name in ("slice_empty", "roll", "roll_multi", "roll_flat", "tril", "triu"):
        return  # decomposed into index arithmetic by core ATen (or empty)
    g = rec.graphs[0]
    computed = [n for n in g.nodes.values() if isinstance(n, Pointwise)]
    assert len(computed) <= len(g.outputs)


@pytest.mark.parametrize("name,fn", VIEWS[:12], ids=[v[0] for v in VIEWS[:12]])
def test_view_noncontiguous_bf16(name, fn):
    x = noncontig(5, 7, 13, dtype=BF16)
    check(lambda x: fn(x) + 1, x)


@pytest.mark.parametrize("name", ["view_split", "view_merge", "permute", "slice", "select_negative",
                                  "expand_minus1", "slice_negative", "unsqueeze", "flip", "split"])
def test_view_dynamic(name):
    fn = dict(VIEWS)[name]
    wrap = (lambda x: tuple(t + 1 for t in fn(x))) if name == "split" else (lambda x: fn(x) + 1)
    if name == "view_split":
        fn2 = lambda x: x.view(x.shape[0], x.shape[1], 13, 1).view(-1, 13) + 1  # noqa: E731
        check(fn2, rand(5, 7, 13), dynamic=True)
        return
    check(wrap, rand(5, 7, 13), dynamic=True)
    check(wrap, rand(6, 9, 13), dynamic=True)


def test_view_outputs_are_materialised():
    x = rand(5, 7, 13)
    check(lambda x: (x[0].t(), x[1:3], x.reshape(35, 13), x.permute(2, 0, 1)), x)


def _index_in_div(e) -> bool:
    """An index symbol (i*, r*) appears inside a floor or Mod."""
    return any(str(s)[0] in "ir" for f in e.atoms(sympy.floor, sympy.Mod) for s in f.free_symbols)


def _load_indices(graph):
    out = []
    for n in graph.nodes.values():
        if isinstance(n, Pointwise):
            for e in walk(n.body):
                if isinstance(e, Load):
                    out.append(tuple(i.expr for i in e.index if isinstance(i, Index)))
    return out


def test_split_is_affine_and_merge_composes():
    # splitting dims gives affine indices; merging then splitting back cancels out
    rec = check(lambda x: x.view(5, 7, 13).permute(1, 0, 2) * 2, rand(35, 13))
    for idx in _load_indices(rec.graphs[0]):
        assert not any(_index_in_div(e) for e in idx), idx
    rec = check(lambda x: x.reshape(35, 13).reshape(5, 7, 13) + 1, rand(5, 7, 13))
    for idx in _load_indices(rec.graphs[0]):
        assert not any(_index_in_div(e) for e in idx), idx


def test_dynamic_split_is_affine():
    rec = check(lambda x: x.view(x.shape[0] // 4, 4, x.shape[1]) + 1, rand(12, 13), dynamic=True)
    for idx in _load_indices(rec.graphs[0]):
        assert not any(_index_in_div(e) for e in idx), idx


# ---------------------------------------------------------------- cat / pad / scatter


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_cat(dtype):
    a, b, c = rand(5, 7, dtype=dtype), rand(5, 3, dtype=dtype), rand(2, 7, dtype=dtype)
    e = torch.empty(0)
    check(lambda a, b, c, e: (torch.cat([a, b], 1), torch.cat([a, c, a], 0), torch.cat([a, e, c], -2),
                              torch.cat([b, a[:, :0], b], 1), torch.cat([e, a]), torch.cat([a.t(), b.t()])),
          a, b, c, e)


def test_cat_promotes_and_rope():
    q = rand(2, 3, 5, 8)
    i = torch.randint(-5, 5, (2, 3, 5, 4))
    check(lambda q, i: (torch.cat([-q[..., 4:], q[..., :4]], -1) * q, torch.cat([q[..., :4], i], -1)), q, i)


def test_cat_dynamic():
    check(lambda a, b: torch.cat([a, b * 2], 0) + 1, rand(5, 7), rand(3, 7), dynamic=True)


@pytest.mark.parametrize("pad", [(1, 2), (0, 0, 3, 1), (2, -1), (-2, -3, 1, 0), (-1, -1, -2, 0), (1, 1, 1, 1, 1, 1)])
def test_constant_pad(pad):
    x = rand(4, 5, 7)
    check(lambda x: (torch.nn.functional.pad(x, pad), torch.nn.functional.pad(x, pad, value=-2.5)), x)


def test_constant_pad_dynamic():
    check(lambda x: torch.nn.functional.pad(x, (1, 2, -1, 0), value=1.5), rand(4, 5, 7), dynamic=True)


def test_slice_and_select_scatter():
    x, s = rand(7, 13), rand(7, 4)
    r = rand(13)
    ops = torch.ops.aten
    check(lambda x, s, r: (ops.slice_scatter(x, s, 1, 2, 6), ops.slice_scatter(x, s, 1, 1, 13, 3),
                           ops.slice_scatter(x, s, -1, -4, None), ops.select_scatter(x, r, 0, -2),
                           ops.slice_scatter(x, x[2:5], 0, 2, 5)), x, s, r)


def test_scatter_one_index_per_row():
    x = rand(7, 13)
    idx = torch.randint(0, 13, (7, 1))
    src = rand(7, 1)
    check(lambda x, idx, src: (x.scatter(1, idx, -1.0), x.scatter(1, idx, src), x.scatter(0, idx.view(1, 7) % 7, 2.0)),
          x, idx, src)
    check(lambda x, idx: torch.zeros_like(x).scatter(1, idx[:4], 1.0), x, idx)


# ---------------------------------------------------------------- gathers


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_index_select_embedding_gather(dtype):
    w = rand(11, 6, dtype=dtype)
    idx = torch.randint(0, 11, (3, 5))
    i1 = torch.randint(0, 6, (9,))
    g = torch.randint(0, 6, (11, 4))
    check(lambda w, idx, i1, g: (torch.nn.functional.embedding(idx, w), w.index_select(1, i1),
                                 w.index_select(0, idx.view(-1)), torch.gather(w, 1, g),
                                 torch.gather(w.t(), 0, g.t()[:, :5] % 6) * 2, w[idx.view(-1)].sum(0)),
          w, idx, i1, g)


def test_advanced_indexing():
    x = rand(6, 7, 8)
    i = torch.randint(-6, 6, (4,))
    j = torch.randint(-7, 7, (3, 1))
    k = torch.randint(0, 8, (4,))
    check(lambda x, i, j, k: (x[i], x[:, j], x[i, :, k], x[:, j, k], x[i, j], x[..., k] + 1, x[j.view(-1)]),
          x, i, j, k)


def test_index_int32_and_dynamic():
    x = rand(6, 7)
    i = torch.randint(0, 6, (5,), dtype=torch.int32)
    check(lambda x, i: (x[i], torch.embedding(x, i.long())), x, i)
    check(lambda x, i: x.index_select(0, i) * 2, x, torch.randint(0, 6, (5,)), dynamic=True)


def test_as_strided_is_extern():
    x = rand(4, 6)
    check(lambda x: torch.as_strided(x + 1, (3, 3), (2, 1)), x, allow_extern=("as_strided",))


def test_symbolic_view_arguments():
    def f(x):
        n, m = x.shape
        return (x[:, m // 2:] * 2, x[n - 1] + 1, x.narrow(1, 1, m - 2) * 3, torch.cat([x, x[:, : m // 2]], 1) + 1,
                torch.nn.functional.pad(x, (0, n)) * 2, x.reshape(n * m)[m:] + 1, x.expand(3, n, m) * 1,
                x[:, :, None].expand(n, m, 4).reshape(n, m * 4) + 1)

    check(f, rand(7, 13), dynamic=True)
    check(f, rand(8, 6), dynamic=True)


def test_extern_with_view_argument():
    # a view argument of an extern is materialised first (this once produced duplicate names)
    x = rand(4, 6)
    check(lambda x: torch.sort(x.t() * 2, dim=-1).values + 1, x, allow_extern=("sort",))


@pytest.mark.parametrize("view,offset", [("reads-outside", None), ("strided-slice", None), ("below-the-view", 1),
                                         ("explicit-offset", 8)])
def test_storage_dependent_op_on_a_view_is_refused(view, offset):
    """as_strided reads the view's storage: computing it on a materialised copy would be wrong
    where the view has gaps or the op reads storage outside the view, so the graph is refused
    (and runs eagerly under the default fallback)."""
    from tilefuse.frontend.context import StorageAliasError

    def f(x):
        v = {"reads-outside": x[1:3] * 1, "strided-slice": x[:, ::2].t(), "below-the-view": x[1:].t(),
             "explicit-offset": x[1:].t()}[view]  # (an input's offset differs call by call)
        if view == "reads-outside":
            v = x[1:3]
        return torch.as_strided(v, (3, 3), (6, 1) if view == "reads-outside" else (2, 1), offset) + 1

    x = rand(4, 6)
    with pytest.raises(Exception) as info:
        compile_run(f, x)
    assert "StorageAliasError" in repr(info.value) or isinstance(info.value, StorageAliasError)


def test_storage_dependent_op_on_a_dense_view():
    """A view whose elements fill its span of storage (a transpose, a row slice) is realised in
    its traced strides and `as_strided` reads the copy as it would read the view's storage,
    its offset taken from the view's start (Longformer's overlapping chunks)."""
    x = rand(4, 6)
    check(lambda x: torch.as_strided(x.t(), (3, 3), (2, 1)) + 1, x, allow_extern=("as_strided",))
    check(lambda x: torch.as_strided(x[1:].t(), (3, 3), (2, 1)) * 2, x, allow_extern=("as_strided",))

    def chunks(q):  # (L, B, H, D) → (B·H, L, D) without a copy → overlapping chunks of 2w rows
        length, batch, heads, dim = q.shape
        h = (q * 1).transpose(0, 1).transpose(1, 2).reshape(batch * heads, length, dim)
        h = h.view(batch * heads, length // 4, 4, dim)
        size, stride = list(h.size()), list(h.stride())
        size[1], stride[1] = size[1] * 2 - 1, stride[1] // 2
        return h.as_strided(size=size, stride=stride) * 3

    check(chunks, rand(12, 2, 3, 5), allow_extern=("as_strided",))