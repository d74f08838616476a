"""Index bounds in the graph IR: the range analysis that drops provable checks, and the
reference interpreter raising for an index out of range (only where the index is live)."""
import pytest
import sympy
import torch

from irgraphs import GraphBuilder
from tilefuse.ir import dtypes as dt
from tilefuse.ir.bounds import IndexCheckError, prune_checks, value_range
from tilefuse.ir.expr import Binary, Cast, CheckedIndex, Index, Load, Where, binary, const, out_index, walk
from tilefuse.ir.interpret import interpret

i0, i1 = out_index(2)
S = sympy.Symbol("s0", integer=True, positive=True)


def _checks(e):
    return [n for n in walk(e) if isinstance(n, CheckedIndex)]


def test_value_range_of_iota_clamp_mod_and_narrow_loads():
    ranges = {i0: 7, i1: S}
    assert value_range(Index(i0), ranges) == (0, 6)
    assert value_range(Index(2 * i0 + 1), ranges) == (1, 13)
    lo, hi = value_range(Index(i1), ranges)
    assert lo == 0 and sympy.simplify(hi - (S - 1)) == 0
    loaded = Load("t", (Index(i0),), dt.int64)
    assert value_range(loaded, ranges) == (-sympy.oo, sympy.oo)
    clamped = binary("minimum", binary("maximum", loaded, const(0)), const(4))
    assert value_range(clamped, ranges) == (0, 4)
    assert value_range(binary("mod", loaded, const(5)), ranges) == (0, 4)
    assert value_range(Cast(Load("u", (Index(i0),), dt.uint8), dt.int64), ranges) == (0, 255)
    # a narrowing cast can wrap: unknown
    assert value_range(Cast(Index(i0 * 2**40), dt.int32), ranges)[0] == -sympy.oo


def test_prune_keeps_unproven_checks_and_drops_proven_ones():
    ranges = {i0: 7}
    loaded = Cast(Load("t", (Index(i0),), dt.int64), dt.int64)
    kept = CheckedIndex(loaded, sympy.Integer(7), "gather")
    assert _checks(prune_checks(kept, ranges)) == [kept]
    iota = CheckedIndex(Index(i0), sympy.Integer(7), "gather")
    assert _checks(prune_checks(iota, ranges)) == []
    too_far = CheckedIndex(Index(i0 + 1), sympy.Integer(7), "gather")  # reaches 7: stays checked
    assert _checks(prune_checks(too_far, ranges)) == [too_far]
    # symbolic: arange(s0) into a dim of s0, but not into a dim of s0 - 1
    sym = CheckedIndex(Index(i0), S, "index", wrap=True)
    assert _checks(prune_checks(sym, {i0: S})) == []
    assert _checks(prune_checks(CheckedIndex(Index(i0), S - 1, "index"), {i0: S})) != []
    # negative but wrapped into range: the wrap stays, the check goes
    neg = CheckedIndex(Index(i0 - 7), sympy.Integer(7), "index", wrap=True)
    pruned = prune_checks(neg, ranges)
    assert _checks(pruned) == [] and isinstance(pruned, Where)
    assert _checks(prune_checks(CheckedIndex(Index(i0 - 7), sympy.Integer(7), "gather"), ranges)) != []


def test_float_index_arithmetic_is_bounded_with_its_rounding():
    # interpolation's source index: int64(max((float(i) + 0.5) * 0.5 - 0.5, 0)) for i < 14
    ranges = {i0: 14}
    f = Cast(Index(i0), dt.float32)
    src = binary("maximum", binary("sub", binary("mul", binary("add", f, const(0.5)), const(0.5)), const(0.5)),
                 const(0.0))
    assert value_range(Cast(src, dt.int64), ranges) == (0, 6)
    assert _checks(prune_checks(CheckedIndex(Cast(src, dt.int64), sympy.Integer(7), "index", wrap=True), ranges)) == []
    # one step further reaches 7: stays checked
    over = Cast(binary("add", binary("mul", f, const(0.5)), const(1.0)), dt.int64)
    assert value_range(over, ranges)[1] == 7
    assert _checks(prune_checks(CheckedIndex(over, sympy.Integer(7), "index"), ranges)) != []
    # a float read from memory is unknown (NaN, anything)
    loaded = Cast(Load("x", (Index(i0),), dt.float32), dt.int64)
    assert value_range(loaded, ranges) == (-sympy.oo, sympy.oo)


def _gather_graph(wrap: bool, error: str = "IndexError", guard: bool = False):
    g = GraphBuilder("g")
    x = g.input("x", (5, 3))
    t = g.input("t", (4,), dt.int64)

    def body(i):
        j = CheckedIndex(t.load((i[0],)), sympy.Integer(5), "index", 0, wrap, error)
        v = x.load((j, i[1]))
        if guard:  # checked only where i0 < 2
            return Where(Binary("lt", i[0], const(2), dt.bool_), v, const(0.0), dt.float32)
        return v

    y = g.ctx.pointwise((4, 3), dt.float32, body)
    return g.output(y)


def test_interpreter_wraps_checks_and_raises_like_eager():
    x = torch.randn(5, 3, dtype=torch.float32)
    t = torch.tensor([4, -5, 0, -1])
    (out,) = interpret(_gather_graph(wrap=True), [x, t])
    torch.testing.assert_close(out, x[t])
    for bad in ([5, 0, 0, 0], [0, -6, 0, 0]):
        with pytest.raises(IndexError, match="index: index out of range for dimension 0 with size 5"):
            interpret(_gather_graph(wrap=True), [x, torch.tensor(bad)])
    with pytest.raises(IndexCheckError):
        interpret(_gather_graph(wrap=False, error="RuntimeError"), [x, t])  # -5 is not allowed without wrap


def test_interpreter_checks_only_live_elements():
    x = torch.randn(5, 3)
    t = torch.tensor([1, 4, 99, -42])  # rows 2 and 3 are out of range but not selected
    (out,) = interpret(_gather_graph(wrap=False, guard=True), [x, t])
    expected = torch.zeros(4, 3)
    expected[:2] = x[t[:2]]
    torch.testing.assert_close(out, expected)
    with pytest.raises(IndexError):
        interpret(_gather_graph(wrap=False, guard=False), [x, t])


def test_an_arg_reduction_claims_its_range_only_over_a_nonempty_extent():
    """`stored_values`: an arg-reduction's index lies in [0, n) only where n is at least 1 (over
    nothing, a compiled one gives 0); a sort's indices along dim 1 lie in [0, size 1)."""
    from tilefuse.ir.bounds import stored_values
    from tilefuse.ir.graph import Extern, ExternResult, Graph, Input, Reduce, TensorArg

    n = sympy.Symbol("s0", integer=True, positive=True)
    u = sympy.Symbol("u0", integer=True, nonnegative=True)
    g = Graph()
    g.nodes["x"] = Input("x", dt.float32, (4, 7), position=0)
    g.nodes["full"] = Reduce("full", dt.int64, (3,), ranges=(n,), combiner="argmax")
    g.nodes["maybe_empty"] = Reduce("maybe_empty", dt.int64, (3,), ranges=(u,), combiner="argmax")
    g.nodes["total"] = Reduce("total", dt.int64, (3,), ranges=(n,), combiner="sum")
    g.nodes["srt"] = Extern("srt", dt.float32, (4, 7), target_name="aten.sort.default", args=(TensorArg("x"), 1),
                            multi_output=True)
    g.nodes["srt_1"] = ExternResult("srt_1", dt.int64, (4, 7), extern="srt", item=1)
    g.nodes["srt_0"] = ExternResult("srt_0", dt.float32, (4, 7), extern="srt", item=0)
    assert stored_values(g, "full") == (0, n - 1)
    assert stored_values(g, "maybe_empty") is None
    assert stored_values(g, "total") is None
    assert stored_values(g, "srt_1") == (0, 6)
    assert stored_values(g, "srt_0") is None
