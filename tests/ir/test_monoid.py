"""The reduction vocabulary (`ir.monoid`): each monoid's identity is neutral under its combine in
every dtype it is used with; folding its combine over random rows of odd lengths (in order, and
in halving steps as vector lanes do) gives what the PyTorch reduction gives, NaN and ties
included; and the IR prints, compares and copies monoids as it did the names they replace."""
import copy
import os
import pickle
import re

import pytest
import torch

from irgraphs import GraphBuilder
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import binary, cast, const
from tilefuse.ir.graph import Reduce
from tilefuse.ir.interpret import interpret, torch_dtype
from tilefuse.ir.monoid import ALL, ANY, ARGMAX, ARGMIN, MAX, MIN, MONOIDS, PROD, SUM, Monoid, monoid

NUMERIC = [dt.float16, dt.bfloat16, dt.float32, dt.float64, dt.int8, dt.int16, dt.int32, dt.int64, dt.uint8]
CASES = ([(m, d) for m in (SUM, PROD) for d in NUMERIC]
         + [(m, d) for m in (MAX, MIN) for d in NUMERIC + [dt.bool_]]
         + [(m, d) for m in (ARGMAX, ARGMIN) for d in NUMERIC]
         + [(m, dt.bool_) for m in (ANY, ALL)])
TORCH = {SUM: torch.sum, PROD: torch.prod, MAX: torch.amax, MIN: torch.amin, ARGMAX: torch.argmax,
         ARGMIN: torch.argmin, ANY: torch.any, ALL: torch.all}
NO_INDEX = 2**63 - 1  # the index an arg-reduction's identity carries: any real index is lower
SHAPES = [(3, 37), (5, 1), (1, 129), (7, 13)]


def _case_id(case):
    m, d = case
    return f"{m}-{d}"


def _sample(m: Monoid, d, shape, seed=0) -> torch.Tensor:
    """Random values of `d`: floats with NaN, ±inf and repeated values (ties) where the monoid
    compares, near 1 for products; integers over the whole range where nothing can overflow,
    small ones otherwise (wrapping is checked modulo the width)."""
    g = torch.Generator().manual_seed(seed)
    td = torch_dtype(d)
    if d.is_bool:
        return torch.rand(shape, generator=g) > 0.5
    if d.is_float:
        if m == PROD:
            return (1 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)).to(td)
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        if m.better:
            x = x.round()  # ties
            special = torch.rand(shape, generator=g)
            x[special < 0.05] = float("nan")
            x[(special >= 0.05) & (special < 0.08)] = float("inf")
            x[(special >= 0.08) & (special < 0.11)] = float("-inf")
        return x.to(td)
    lo, hi = dt.value_range(d)
    if m.better:
        lo, hi = max(lo, -5), min(hi, 5)  # small: many ties
        x = torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int64)
        x.view(-1)[:2] = torch.tensor(dt.value_range(d)).clamp(-(2**63), 2**63 - 1)[: x.numel()]
        return x.to(td)
    return torch.randint(max(lo, -3), min(hi, 3) + 1, shape, generator=g, dtype=torch.int64).to(td)


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------- the algebra
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_identity_is_neutral(case):
    m, d = case
    x = _sample(m, d, (37,)).view(-1)
    e = torch.full_like(x, m.identity(d))
    if m.arg:
        i = torch.arange(x.numel())
        none = torch.full_like(i, NO_INDEX)
        for v, k in (m.combine((e, none), (x, i)), m.combine((x, i), (e, none))):
            _same(v, x)
            _same(k, i)
    else:
        _same(m.combine(e, x), x)
        _same(m.combine(x, e), x)


def _fold(m: Monoid, x: torch.Tensor, halving: bool):
    """The monoid's combine over the last axis from its identity: left to right, or (halving)
    in a power-of-two array of lanes padded with the identity and halved, as vector lanes are."""
    n = x.shape[-1]
    e = torch.full(x.shape[:-1], m.identity(dtype_of(x)), dtype=x.dtype)
    cols = [(x[..., j], torch.full(x.shape[:-1], j)) for j in range(n)]
    pad = (e, torch.full(x.shape[:-1], NO_INDEX))
    if not m.arg:
        cols, pad = [c for c, _ in cols], e
    if not halving:
        acc = pad
        for c in cols:
            acc = m.combine(acc, c)
        return acc
    lanes = cols + [pad] * ((1 << (n - 1).bit_length()) - n)
    while len(lanes) > 1:
        half = len(lanes) // 2
        lanes = [m.combine(lanes[k], lanes[k + half]) for k in range(half)]
    return lanes[0]


def dtype_of(t: torch.Tensor):
    return dt.by_name(str(t.dtype).removeprefix("torch."))


@pytest.mark.parametrize("halving", [False, True], ids=["in-order", "halving"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fold_matches_torch(case, shape, halving):
    m, d = case
    x = _sample(m, d, shape, seed=hash(shape) % 1000)
    ref = TORCH[m](x, -1)
    _same(m.reduce(x), ref)  # the interpreter's vectorised reduction is PyTorch's
    got = _fold(m, x, halving)
    if m.arg:
        _same(got[1], ref)
    elif m.numeric and not m.idempotent and d.is_float:  # rounding of the order of the additions
        eps = torch.finfo(x.dtype).eps
        scale = x.double().abs().sum(-1) if m == SUM else x.double().abs().log().sum(-1).exp()
        assert ((got.double() - ref.double()).abs() <= shape[-1] * eps * scale + 1e-30).all()
    else:  # exact (integer sums wrap modulo the width, as PyTorch's int64 result does cast back)
        _same(got, ref.to(x.dtype))


@pytest.mark.parametrize("m", list(MONOIDS.values()), ids=str)
def test_idempotence(m):
    d = dt.bool_ if m.logical else dt.float32
    x = _sample(m, d, (41,))
    if m.arg:
        i = torch.arange(41)
        v, k = m.combine((x, i), (x, i))
        _same(v, x)
        _same(k, i)
        assert m.idempotent
        return
    twice = m.combine(x, x)
    assert m.idempotent == bool(torch.equal(twice, x) or torch.allclose(twice, x, equal_nan=True)), m
    if not m.idempotent:
        assert not torch.equal(m.combine(torch.tensor(2.0), torch.tensor(2.0)), torch.tensor(2.0))


@pytest.mark.parametrize("m", list(MONOIDS.values()), ids=str)
def test_empty_ranges_follow_pytorch(m):
    d = dt.bool_ if m.logical else dt.float32
    x = torch.empty(3, 0, dtype=torch_dtype(d))
    if m.empty_ok:
        _same(m.reduce(x), torch.full((3,), m.identity(d), dtype=TORCH[m](x, -1).dtype))
    else:
        with pytest.raises((RuntimeError, IndexError)):
            TORCH[m](x, -1)
        with pytest.raises((RuntimeError, IndexError)):
            m.reduce(x)


@pytest.mark.parametrize("m", [ANY, ALL], ids=str)
def test_truth_values_carried_as_int32_extrema(m):
    """A tile carries any/all as max/min over int32 0/1 from the monoid's own identity."""
    assert m.tile == (MAX if m == ANY else MIN) and m.acc_dtype(dt.bool_) == dt.int32
    x = torch.rand(7, 13, generator=torch.Generator().manual_seed(1)) > (0.9 if m == ANY else 0.1)
    acc = torch.full((7,), m.identity(dt.int32), dtype=torch.int32)
    for j in range(13):
        acc = m.tile.combine(acc, x[:, j].to(torch.int32))
    _same(acc != 0, TORCH[m](x, -1))


def test_tile_facts():
    for m in (SUM, PROD, MAX, MIN, ARGMAX, ARGMIN):
        assert m.tile is m and m.acc_dtype(dt.float16) == dt.float16
    assert [m.name for m in MONOIDS.values() if m.extremum] == ["max", "min"]
    assert [m.name for m in MONOIDS.values() if m.numeric] == ["sum", "prod", "max", "min"]
    assert [m.name for m in MONOIDS.values() if m.arg] == ["argmax", "argmin"]
    assert MAX.identity(dt.float32) == float("-inf") and MIN.identity(dt.int8) == 127
    assert ARGMIN.identity(dt.uint8) == 255 and ARGMAX.identity(dt.int64) == -(2**63)
    assert SUM.identity(dt.float32) == 0 and type(SUM.identity(dt.float32)) is int  # as kernels print it


# ---------------------------------------------------------------------------- naming
def test_lookup_interning_and_copies():
    assert list(MONOIDS) == ["sum", "prod", "max", "min", "argmax", "argmin", "any", "all"]
    for name, m in MONOIDS.items():
        assert monoid(name) is m and monoid(m) is m and str(m) == name and f"{m}" == name
        assert copy.copy(m) is m and copy.deepcopy(m) is m and pickle.loads(pickle.dumps(m)) is m
        assert m != name  # typed: a comparison with a name is never true
    with pytest.raises(ValueError, match="unknown combiner 'welford'"):
        monoid("welford")


def test_reduce_nodes_hold_monoids_and_print_their_names():
    g = GraphBuilder("g")
    x = g.input("x", (4, 9))
    outs = []
    for name in MONOIDS:
        if name in ("any", "all"):
            body = lambda i, r: binary("gt", x.load((i[0], r[0])), const(0.0, dt.float32))
            out = dt.bool_
        else:
            body = lambda i, r: x.load((i[0], r[0]))
            out = dt.int64 if name.startswith("arg") else dt.float32
        outs.append(g.ctx.reduce((4,), (9,), monoid(name), body, out))
    graph = g.output(*outs)
    lines = [line for line in str(graph).splitlines() if "[r0<9]" in line]
    assert [re.search(r"= (\w+)\[r0<9\]", line).group(1) for line in lines] == list(MONOIDS)
    assert lines[0] == "  buf1: float32[4] = sum[r0<9](x[i0, r0])"
    assert lines[6] == "  buf7: bool[4] = any[r0<9]((x[i0, r0] > 0.0))"
    assert all(isinstance(n.combiner, Monoid) for n in graph.nodes.values() if isinstance(n, Reduce))
    x0 = torch.randn(4, 9)
    got = interpret(graph, [x0])
    for m, value in zip(MONOIDS.values(), got):
        _same(value, TORCH[m](x0 > 0 if m.logical else x0, -1))
    # a name given to the node is looked up; an unknown one is refused
    assert Reduce("r", dt.float32, (), combiner="max", body=cast(const(1.0, dt.float32), dt.float32)).combiner is MAX
    with pytest.raises(ValueError):
        Reduce("r", dt.float32, (), combiner="mean", body=const(1.0, dt.float32))


def test_no_combiner_is_compared_with_a_name():
    """Every comparison of a combiner goes through the typed vocabulary: a monoid never equals
    a string, so a comparison left over from the names would silently be false."""
    root = os.path.join(os.path.dirname(__file__), "..", "..", "src", "tilefuse")
    names = "|".join(MONOIDS)
    leftover = re.compile(rf"combiner\S*\s*(==|!=|in|not in)\s*\(?\"({names})\"|\"({names})\"\s*(==|!=)\s*\S*combiner")
    found = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                with open(path) as fh:
                    found += [f"{path}:{k}" for k, line in enumerate(fh, 1) if leftover.search(line)]
    assert not found, found
