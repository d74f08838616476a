"""Loads under a `where` on positions: guarded by the branch's condition only where the index
may leave its buffer (`KernelBuilder._needs_guard`). A guard on a per-key value makes a
[1, keys] load a [rows, keys] one: the attention backward under a causal mask read its row
statistics once per score, and its kernels then needed more shared memory than the device has
(docs/benchmarks.md, twenty-eighth section)."""
import sympy

from irgraphs import GraphBuilder
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import Binary, Const, Index, Load, Where
from tilefuse.tile.builder import KernelBuilder, tile_symbol

RM, RJ, PID = tile_symbol("rm"), tile_symbol("rj"), tile_symbol("pid_b")


def _builder():
    g = GraphBuilder()
    g.input("stats", (6, 64), dt.float32)
    g.input("short", (48,), dt.float32)
    b = KernelBuilder(g.graph, "k")
    b.coordinate_extents.update({RM: 64, RJ: 64, PID: 6})
    return b


def _causal(rows=RM, keys=RJ):
    return Binary("gt", Index(keys), Index(rows), dt.bool_)


def test_a_per_key_value_in_range_is_loaded_unguarded():
    b = _builder()
    stats = Load("stats", (Index(PID), Index(RJ)), dt.float32)
    assert not b._needs_guard(stats, _causal())
    assert not b._needs_guard(Where(_causal(), Const(0.0, dt.float32), stats, dt.float32).b, _causal())


def test_an_index_that_may_leave_its_buffer_keeps_the_guard():
    b = _builder()
    # `cat`: where(j < 48, short[j], other[j - 48]): short's index passes its 48 elements
    assert b._needs_guard(Load("short", (Index(RJ),), dt.float32), Binary("lt", Index(RJ), Index(sympy.Integer(48)), dt.bool_))
    # an offset index (one past the last element, one before the first), and a coordinate of
    # unknown extent
    assert b._needs_guard(Load("stats", (Index(PID), Index(RJ + 1)), dt.float32), _causal())
    assert b._needs_guard(Load("stats", (Index(PID), Index(RJ - 3)), dt.float32), _causal())
    assert b._needs_guard(Load("stats", (Index(tile_symbol("other")), Index(RJ)), dt.float32), _causal())
    # a condition on data never guards an affine load
    data = Binary("gt", Load("stats", (Index(PID), Index(RJ)), dt.float32), Const(0.0, dt.float32), dt.bool_)
    assert not b._needs_guard(Load("short", (Index(RJ),), dt.float32), data)


def test_a_load_under_an_inner_selection_on_positions_keeps_the_outer_guard():
    """`cat([pad(short), other])` along keys: the pad's selection keeps `short`'s index at or
    above 0, only the `cat`'s keeps it below 48 — the outer guard is still needed (dropping
    it read past a buffer on a GPU: an illegal address in a training step)."""
    b = _builder()
    j = Index(RJ)
    padded = Where(Binary("ge", Index(RJ - 1), Index(sympy.Integer(0)), dt.bool_),
                   Load("short", (Index(RJ - 1),), dt.float32), Const(0.0, dt.float32), dt.float32)
    assert b._needs_guard(padded, Binary("lt", j, Index(sympy.Integer(49)), dt.bool_))


def test_a_gather_at_a_position_in_range_is_no_gather():
    """`slopes[h]` (ALiBi's per-head slope, a gather at the head coordinate): in range for
    every head, so it neither needs a guard nor makes the branch's row statistics [rows, keys]
    loads (the ALiBi backward's kernels then needed more shared memory than an H100 has)."""
    from tilefuse.ir.expr import CheckedIndex

    b = _builder()
    head = CheckedIndex(Index(sympy.Mod(PID, 6)), 6, "index", wrap=True)
    slope = Load("stats", (head, Index(RJ)), dt.float32)
    assert b._position_of(head) == sympy.Mod(PID, 6)
    assert not b._needs_guard(slope, _causal())
    data_index = CheckedIndex(Load("short", (Index(RJ),), dt.int64), 6, "index")
    assert b._position_of(data_index) is None
    assert b._needs_guard(Load("stats", (data_index, Index(RJ)), dt.float32), _causal())
    beyond = CheckedIndex(Index(PID + 1), 6, "index")  # (the last head reads one past)
    assert b._position_of(beyond) is None
