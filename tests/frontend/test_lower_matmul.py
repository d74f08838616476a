"""Matmul family: mm, bmm, addmm, baddbmm, and the Reduce(sum of Binary mul) shape the tile
layer recognises."""
import pytest
import torch
import torch.nn.functional as F
from lowering_harness import check, noncontig, rand

from tilefuse.ir import Binary, Cast, Load, Pointwise, Reduce
from tilefuse.ir.monoid import SUM

F32, BF16 = torch.float32, torch.bfloat16


def _matmul_nodes(rec):
    return [n for g in rec.graphs for n in g.nodes.values()
            if isinstance(n, Reduce) and isinstance(n.body, Binary) and n.body.op == "mul"]


def _side(e):
    return e.x if isinstance(e, Cast) else e


def assert_contraction(node, low_precision: bool):
    body = node.body
    assert node.combiner == SUM and len(node.ranges) == 1
    a, b = body.a, body.b
    for side in (a, b):
        assert isinstance(_side(side), Load), side
        if _side(side).dtype.name in ("bfloat16", "float16"):  # accumulate in fp32
            assert isinstance(side, Cast) and side.dtype.name == "float32", side
        if low_precision:
            assert side.dtype.name == "float32"
    ai = {str(s) for i in _side(a).index for s in getattr(i, "expr", i).free_symbols} \
        if all(hasattr(i, "expr") for i in _side(a).index) else set()
    bi = {str(s) for i in _side(b).index for s in getattr(i, "expr", i).free_symbols} \
        if all(hasattr(i, "expr") for i in _side(b).index) else set()
    rank = len(node.shape)
    m, n = f"i{rank - 2}", f"i{rank - 1}"
    assert "r0" in ai and m in ai and n not in ai, ai
    assert "r0" in bi and n in bi and m not in bi, bi


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_mm_bmm(dtype):
    a, b = rand(7, 13, dtype=dtype), rand(13, 33, dtype=dtype)
    x, y = rand(3, 5, 13, dtype=dtype), rand(3, 13, 7, dtype=dtype)
    rec = check(lambda a, b, x, y: (a @ b, torch.bmm(x, y), a.t() @ a, x @ y[0]), a, b, x, y)
    nodes = _matmul_nodes(rec)
    assert len(nodes) == 4
    for n in nodes:
        assert_contraction(n, dtype == BF16)
        assert n.dtype.name == str(dtype).replace("torch.", "")


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_addmm_baddbmm(dtype):
    bias, a, b = rand(33, dtype=dtype), rand(7, 13, dtype=dtype), rand(13, 33, dtype=dtype)
    bb, x, y = rand(3, 5, 1, dtype=dtype), rand(3, 5, 13, dtype=dtype), rand(3, 13, 7, dtype=dtype)
    rec = check(lambda bias, a, b, bb, x, y: (
        torch.addmm(bias, a, b), torch.addmm(bias, a, b, beta=0.5, alpha=2.0),
        torch.addmm(bias[:7, None], a, b, beta=0),
        torch.baddbmm(bb, x, y), torch.baddbmm(bb, x, y, beta=-1.5, alpha=0.25), F.linear(a, b.t(), bias)),
        bias, a, b, bb, x, y)
    nodes = _matmul_nodes(rec)
    assert len(nodes) == 6
    for n in nodes:
        assert_contraction(n, dtype == BF16)
        assert n.dtype.name == "float32"  # the epilogue rounds once
    g = rec.graphs[0]
    users = g.users()
    for n in nodes:
        assert all(isinstance(g.nodes[u], Pointwise) for u in users[n.name])


def test_addmm_beta0_ignores_nan():
    bias = torch.full((5,), float("nan"))
    a, b = rand(3, 4), rand(4, 5)
    check(lambda bias, a, b: torch.addmm(bias, a, b, beta=0), bias, a, b)


def test_noncontiguous_and_views():
    a = noncontig(13, 7)
    b = noncontig(7, 33, kind="s")
    w = rand(2, 7, 9)
    rec = check(lambda a, b, w: (a @ b, (a[::2] @ b[:, 1:]).relu(), torch.matmul(a, w),
                                 a.unsqueeze(0).expand(4, 13, 7) @ b),
                a, b, w)
    for n in _matmul_nodes(rec):
        assert_contraction(n, False)


def test_matmul_with_gathered_operand():
    emb = rand(11, 8)
    w = rand(8, 5)
    idx = torch.randint(0, 11, (2, 6))
    rec = check(lambda emb, w, idx: F.embedding(idx, emb) @ w, emb, w, idx)
    assert len(_matmul_nodes(rec)) == 1


def test_integer_mm():
    a = torch.randint(-5, 5, (7, 13))
    b = torch.randint(-5, 5, (13, 6))
    check(lambda a, b: a @ b, a, b)


def test_linear_dynamic():
    lin = torch.nn.Linear(13, 7)
    x = rand(5, 3, 13)
    with torch.no_grad():
        check(lin, x, dynamic=True)
        check(lin, rand(6, 9, 13), dynamic=True)
    check(lambda x, y: torch.bmm(x, y) * 2, rand(3, 5, 13), rand(3, 13, 4), dynamic=True)


def test_vector_products():
    a, v = rand(7, 13), rand(13)
    check(lambda a, v: (a @ v, v @ v, torch.outer(v, v[:5]), torch.mv(a, v)), a, v)


def test_addmv():
    b, a, v = rand(7), rand(7, 13), rand(13)
    check(lambda b, a, v: (torch.addmv(b, a, v), torch.addmv(b, a, v, beta=0.5, alpha=-2)), b, a, v)
