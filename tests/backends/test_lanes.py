"""`backends/cpu/lanes.py`: which tile values are the same in every lane, and the strides of
an offset affine in the lanes. Every proof is checked by enumerating the lanes and program ids;
values carried through a loop are never uniform."""
import itertools
import random
from types import SimpleNamespace

import pytest
import sympy

from tilefuse.backends.cpu.lanes import Lanes
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import Binary, Const, Index, Var
from tilefuse.tile.ir import Arange, Assign, For, Full, Let, ProgramId

PID = sympy.Symbol("pid", integer=True, nonnegative=True)
RN = sympy.Symbol("rn", integer=True, nonnegative=True)


def lanes_of(block: int, body=(), shapes=None, aligned=True):
    sh = SimpleNamespace(aranges={"rn": 1}, shape={"rn": (1, block), "pid": (1, 1), **(shapes or {})},
                         dtype={}, block=lambda b: block, constexprs={})
    return Lanes(SimpleNamespace(body=list(body)), sh, {"rn": (block, 1)} if aligned else {})


def _values(e, block, pid):
    return [int(e.subs({PID: pid, RN: block * pid + t})) for t in range(block)]


def _random_index(rng, depth=0):
    if depth > 2 or rng.random() < 0.3:
        return rng.choice([RN, RN, PID, sympy.Integer(rng.randint(0, 5))])
    op = rng.choice(["add", "mul", "floor", "mod"])
    a = _random_index(rng, depth + 1)
    if op == "add":
        return a + _random_index(rng, depth + 1)
    if op == "mul":
        return a * rng.choice([1, 2, 3, 4, 8, 16])
    c = rng.choice([2, 3, 4, 8, 16, 32, 48, 64, 96])
    return sympy.floor(a / c) if op == "floor" else sympy.Mod(a, c)


@pytest.mark.parametrize("seed", range(4))
def test_strides_hold_for_every_lane(seed):
    """Random index expressions over an aligned arange: where a column stride is proven, every
    program's lanes step by it exactly (a proof never wrong; unproven is allowed)."""
    rng = random.Random(seed)
    proven = 0
    for _ in range(400):
        e = _random_index(rng)
        if RN not in e.free_symbols:
            continue
        block = rng.choice([2, 4, 8, 16, 32])
        st = lanes_of(block).index_strides(e)
        if st is None or not st[1].is_Integer:
            continue
        proven += 1
        for pid in range(7):
            v = _values(e, block, pid)
            assert all(v[t] - v[0] == int(st[1]) * t for t in range(block)), (e, block, pid, st)
    assert proven > 50


def test_floor_and_mod_of_an_aligned_arange():
    lanes = lanes_of(32)
    assert lanes.index_strides(sympy.floor(RN / 256)) == (0, 0)  # the same expert per tile
    assert lanes.index_strides(sympy.Mod(RN, 256) * 128 + 7) == (0, 128)
    assert lanes.index_strides(sympy.floor(RN / 100)) is None  # 32 does not divide 100
    assert lanes_of(32, aligned=False).index_strides(sympy.floor(RN / 256)) is None  # start unknown


def test_a_carried_value_is_never_uniform():
    """`c` starts equal in every lane and is updated from the lanes in a loop: neither it nor a
    value read from it before the update is uniform."""
    body = [
        ProgramId("pid", 0),
        Arange("rn", Index(PID * 16), "B", 1, 2),
        Full("c", (1, 16), 0, dt.int64),
        For("k", Index(sympy.Integer(0)), Index(sympy.Integer(4)), "S", body=[
            Let("x", Binary("mul", Var("c", dt.int64), Const(64, dt.int64), dt.int64)),
            Assign("c", Binary("add", Var("c", dt.int64), Index(RN), dt.int64)),
        ]),
        Let("y", Binary("add", Index(PID), Const(1, dt.int64), dt.int64)),
    ]
    lanes = lanes_of(16, body, {"c": (1, 16), "x": (1, 16), "y": (1, 1)})
    assert "c" not in lanes.uniform and "x" not in lanes.uniform
    assert {"pid", "y"} <= lanes.uniform
    assert lanes.strides(Binary("mul", Var("x", dt.int64), Const(2, dt.int64), dt.int64)) is None
    # a tile value named inside an index is not known to be the same in every lane
    assert lanes.index_strides(sympy.Symbol("c", integer=True) + RN) is None


def test_sums_and_products_of_uniform_values():
    body = [ProgramId("pid", 0), Arange("rn", Index(PID * 32), "B", 1, 2),
            Let("e", Binary("add", Index(sympy.floor(RN / 64)), Const(3, dt.int64), dt.int64))]
    lanes = lanes_of(32, body, {"e": (1, 32)})
    assert "e" in lanes.uniform
    offset = Binary("add", Binary("mul", Var("e", dt.int64), Const(4096, dt.int64), dt.int64),
                    Index(sympy.Mod(RN, 64) * 64), dt.int64)
    assert lanes.strides(offset) == (0, 64)
    for pid, block in itertools.product(range(5), [32]):
        v = [(int(sympy.floor((block * pid + t) / 64)) + 3) * 4096 + ((block * pid + t) % 64) * 64
             for t in range(block)]
        assert all(v[t] - v[0] == 64 * t for t in range(block))
