"""Index arithmetic converted to float per axis (`tile.index_casts`): exact where it applies,
refused where it would not be, and an ALiBi-style attention whose distance bias is converted
once per row and once per key trains like fp64."""
import itertools
import math

import pytest
import sympy
import torch

import tilefuse
from lowered_plans import recorded_lowerings
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import Binary, Cast, Const, Index, Load, Var, walk
from tilefuse.tile.builder import tile_symbol
from tilefuse.tile.index_casts import as_affine, per_axis_cast
from tilefuse.tile.ir import Let, TileKernel, statements, stmt_exprs

RM, RJ, PID = (tile_symbol(n) for n in ("rm", "rj", "pid_b"))
AXES = {RM: 0, RJ: 1}


def _distance(scale_i=-1, shift=0):
    """float32(rj + scale_i·rm + shift) as the graph spells it: integer ops, then one conversion."""
    x = Binary("add", Binary("mul", Index(RM), Const(scale_i, dt.int64), dt.int64), Index(RJ), dt.int64)
    if shift:
        x = Binary("add", x, Index(PID * shift), dt.int64)
    return Cast(x, dt.float32)


def _evaluate(e, env):
    """A float or integer expression of indices, evaluated at one coordinate (fp32 rounding
    applied at every float conversion and addition)."""
    if isinstance(e, Index):
        return int(sympy.sympify(e.expr).subs(env))
    if isinstance(e, Const):
        return e.value
    if isinstance(e, Cast):
        return float(torch.tensor(_evaluate(e.x, env), dtype=torch.float32))
    a, b = _evaluate(e.a, env), _evaluate(e.b, env)
    r = {"add": a + b, "sub": a - b, "mul": a * b}[e.op]
    return float(torch.tensor(r, dtype=torch.float32)) if e.dtype.is_float else r


@pytest.mark.parametrize("scale_i,shift", [(-1, 0), (3, 0), (-2, 5)])
def test_split_conversion_is_exact_at_every_coordinate(scale_i, shift):
    e = _distance(scale_i, shift)
    extents = {RM: 37, RJ: 53, PID: 6}
    split = per_axis_cast(e, AXES, extents)
    assert split is not None
    casts = [n for n in walk(split) if isinstance(n, Cast)]
    assert len(casts) == 2  # one per axis; the grid's term joins one of them
    for c in casts:
        syms = sympy.sympify(c.x.expr).free_symbols & set(AXES)
        assert len(syms) == 1
    rng = torch.Generator().manual_seed(0)
    points = [(int(torch.randint(0, 37, (), generator=rng)), int(torch.randint(0, 53, (), generator=rng)),
               int(torch.randint(0, 6, (), generator=rng))) for _ in range(40)]
    for i, j, p in points + list(itertools.product((0, 36), (0, 52), (0, 5))):
        env = {RM: i, RJ: j, PID: p}
        assert _evaluate(split, env) == float(j + scale_i * i + shift * p)


def test_refused_where_it_would_not_be_exact_or_useful():
    e = _distance()
    assert per_axis_cast(e, AXES, {RM: 2 ** 22, RJ: 2 ** 22}) is not None  # |j| + |i| < 2^23
    assert per_axis_cast(e, AXES, {RM: 2 ** 23, RJ: 2 ** 22}) is None  # |j| + |i| may reach 2^23
    assert per_axis_cast(e, AXES, {RM: sympy.Symbol("s0", positive=True), RJ: 64}) is None  # symbolic
    assert per_axis_cast(e, AXES, {RM: 64}) is None  # rj's extent unknown
    assert per_axis_cast(Cast(e.x, dt.float16), AXES, {RM: 64, RJ: 64}) is None  # 11 bits: not exact
    one_axis = Cast(Binary("add", Index(RM), Const(3, dt.int64), dt.int64), dt.float32)
    assert per_axis_cast(one_axis, AXES, {RM: 64}) is None
    crossed = Cast(Binary("add", Binary("mul", Index(RM), Index(RJ), dt.int64), Index(RJ), dt.int64), dt.float32)
    assert per_axis_cast(crossed, AXES, {RM: 8, RJ: 8}) is None  # a part spans both axes
    loaded = Cast(Binary("add", Load("t", (Index(RM),), dt.int64), Index(RJ), dt.int64), dt.float32)
    assert as_affine(loaded.x) is None and per_axis_cast(loaded, AXES, {RM: 8, RJ: 8}) is None


def _alibi(slopes, distance):
    def fn(q, k, v):
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        return torch.softmax(s + slopes * distance, dim=-1) @ v
    return fn


def _int_to_float_tiles(kern: TileKernel) -> list:
    """The int→float conversions of a kernel whose operand varies along both tile axes (the
    operand followed through the kernel's `Let`s to indices)."""
    defs = {s.name: s.value for s in statements(kern.body) if isinstance(s, Let)}

    def symbols(e) -> set:
        out = set()
        for n in walk(e):
            if isinstance(n, Var) and n.name in defs:
                out |= symbols(defs[n.name])
            elif isinstance(n, Index):
                out |= {str(x) for x in sympy.sympify(n.expr).free_symbols}
        return out

    found = []
    for s in statements(kern.body):
        for e in stmt_exprs(s):
            for n in walk(e):
                if isinstance(n, Cast) and n.dtype.is_float and not n.x.dtype.is_float and {"rm", "rj"} <= symbols(n.x):
                    found.append(n)
    return found


def test_alibi_bias_converted_per_axis_trains_like_fp64():
    torch.manual_seed(0)
    b, h, t, d = 2, 3, 77, 16
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    distance = (j - i).float()  # captured: an index formula once compiled
    slopes = torch.tensor([2.0 ** (-8.0 * (x + 1) / h) for x in range(h)]).view(h, 1, 1)
    fn = _alibi(slopes, distance)
    q, k, v = (torch.randn(b, h, t, d, requires_grad=True) for _ in range(3))
    d_out = torch.randn(b, h, t, d)
    torch._dynamo.reset()
    lowered: list = []
    with recorded_lowerings(lowered), tilefuse.config.patch(flash_config="16,16,4,1", graph_cache=False):
        out = torch.compile(fn, backend="tilefuse")(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), d_out)
    flash = [kn for kn in lowered if isinstance(kn, TileKernel) and "flash" in kn.name]
    assert len(flash) >= 3  # the forward, dK/dV and dQ
    for kern in flash:
        assert not _int_to_float_tiles(kern), kern.name
    ref_args = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out = _alibi(slopes.double(), distance.double())(*ref_args)
    refs = torch.autograd.grad(ref_out, ref_args, d_out.double())
    torch.testing.assert_close(out.double(), ref_out, atol=1e-4, rtol=1e-4)
    for g, r in zip(grads, refs):
        torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-4)
