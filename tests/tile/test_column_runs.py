"""`cat` and `stack` along the last dim on the C++ backend walk runs of columns
(`tile.column_runs`): each run computes only its own branch, with contiguous or strided loads
instead of masked gathers of every branch. Checked against eager with an fp64 reference, on
odd row counts, symbolic sizes, non-contiguous inputs and low precision; the Triton
interpreter keeps the flat walk and must agree too."""
import pytest
import sympy
import torch

import tilefuse
from tilefuse.bench.zoo.gptfast import apply_rotary_emb
from tilefuse.fusion.plan import KernelPlan, PlanKind, Stage, StageKind
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import Binary, Const, Index, Load, Where, out_index
from tilefuse.ir.graph import Graph, Input, Pointwise
from tilefuse.tile.column_runs import MAX_RUNS, column_runs
from tilefuse.tile.common import LoweringOptions
from tilefuse.tile.target import Target


def _compile(fn, *args, target="cpu", dynamic=False):
    torch._dynamo.reset()
    report = tilefuse.explain(fn, *args, options={"target": target})
    torch._dynamo.reset()
    out = torch.compile(fn, backend="tilefuse", dynamic=dynamic, options={"target": target})(*args)
    return report, out


def _sources(report) -> str:
    return "\n".join(k.source for k in report.kernels if k.kind == "pointwise")


def _close(out, fn, args, tol_factor=2.0):
    ref = fn(*[a.double() if a.is_floating_point() else a for a in args])
    eager = fn(*args)
    eager_err = (eager.double() - ref).abs().max().item()
    err = (out.double() - ref).abs().max().item()
    assert out.dtype == eager.dtype and out.shape == eager.shape
    assert err <= tol_factor * eager_err + 1e-6, (err, eager_err)


#: gpt-fast's `apply_rotary_emb`: pairs rotated, then stacked along a new last dim
rope_gpt_fast = apply_rotary_emb


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq", [13, 32])
def test_a_stack_of_rotated_pairs_stores_both_halves_in_one_loop(dtype, seq):
    x, freqs = torch.randn(3, seq, 5, 16, dtype=dtype), torch.randn(seq, 8, 2)
    report, out = _compile(rope_gpt_fast, x, freqs)
    src = _sources(report)
    assert "CBLOCK" in src and "% 2" not in src, src  # the pair's element is a constant, not a lane's parity
    _close(out, rope_gpt_fast, (x, freqs))


def test_a_cat_of_two_branches_computes_each_on_its_own_columns():
    a, b = torch.randn(37, 24), torch.randn(37, 40)

    def fn(a, b):
        return torch.cat([a.exp(), torch.tanh(b) * 3], -1)

    report, out = _compile(fn, a, b)
    src = _sources(report)
    assert "C0BLOCK = 24" in src and "C1BLOCK = 40" in src, src
    _close(out, fn, (a, b))


def test_nested_cats_of_three_pieces_and_a_transposed_input():
    a, b, c = torch.randn(6, 5, 3), torch.randn(5, 6, 7).transpose(0, 1), torch.randn(6, 5, 1)

    def fn(a, b, c):
        return torch.cat([torch.cat([a * 2, b], -1), c - 1], -1)

    report, out = _compile(fn, a, b, c)
    assert "C2BLOCK = 1" in _sources(report)
    _close(out, fn, (a, b, c))


def test_a_selection_on_the_column_parity():
    """Any selection on the column alone splits it: `i % 2` gives runs of one column each."""
    x = torch.randn(9, 6)

    def fn(x):
        col = torch.arange(6)
        return torch.where(col % 2 == 0, x.sin(), x * 3)

    report, out = _compile(fn, x)
    assert "C5BLOCK = 1" in _sources(report) or "CBLOCK" in _sources(report)
    _close(out, fn, (x,))


def test_rows_of_a_symbolic_count():
    def fn(a, b):
        return torch.stack([a + b, a - b], -1)

    for rows in (11, 29):
        a, b = torch.randn(rows, 8), torch.randn(rows, 8)
        _, out = _compile(fn, a, b, dynamic=True)
        _close(out, fn, (a, b))


def test_a_stack_of_long_vectors_walks_them_in_blocks():
    """A `stack` of two long 1-D vectors: its pairs walk the vector a block of rows per
    program (no tile as long as the vector)."""
    a, b = torch.randn(50001), torch.randn(50001)

    def fn(a, b):
        return torch.stack([a.exp(), b * 2], -1)

    report, out = _compile(fn, a, b)
    assert "CBLOCK = 50001" not in _sources(report)
    _close(out, fn, (a, b))


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_both_backends_agree_on_a_stack_of_three(target):
    a, b, c = torch.randn(7, 10), torch.randn(7, 10), torch.randn(10)

    def fn(a, b, c):
        return torch.stack([a * 2, b + c, a - c], -1)

    _, out = _compile(fn, a, b, c, target=target)
    _close(out, fn, (a, b, c))


def _plan_of(body, shape) -> tuple:
    g = Graph()
    g.inputs.append(g.add(Input("x", dt.float32, shape)))
    g.add(Pointwise("y", dt.float32, shape, body))
    g.outputs = ["y"]
    plan = KernelPlan("k", PlanKind.POINTWISE, shape[0] * shape[1],
                      stages=[Stage("y", StageKind.POINTWISE, body, store=True)])
    return g, plan


def test_runs_are_found_only_on_a_cpu_and_within_bounds():
    i0, i1 = out_index(2)
    x = Load("x", (Index(i0), Index(i1)), dt.float32)
    split = Where(Binary("lt", Index(i1), Index(sympy.Integer(3)), dt.bool_), x, Const(0.0, dt.float32), dt.float32)
    g, plan = _plan_of(split, (5, 8))
    order, runs, _ = column_runs(g, plan, LoweringOptions(target=Target.cpu()))
    assert order == (0, 1) and [(a, b) for a, b, _ in runs] == [(0, 3), (3, 8)]
    assert column_runs(g, plan, LoweringOptions(target=Target.interpreter())) is None
    by_row = Where(Binary("lt", Index(i0), Index(sympy.Integer(3)), dt.bool_), x, Const(0.0, dt.float32), dt.float32)
    assert column_runs(*_plan_of(by_row, (5, 8)), LoweringOptions(target=Target.cpu())) is None
    by_data = Where(Binary("lt", x, Const(0.0, dt.float32), dt.bool_), x, Const(0.0, dt.float32), dt.float32)
    assert column_runs(*_plan_of(by_data, (5, 8)), LoweringOptions(target=Target.cpu())) is None
    parity = Where(Binary("eq", Index(i1 % 2), Index(sympy.Integer(0)), dt.bool_), x, Const(0.0, dt.float32), dt.float32)
    assert column_runs(*_plan_of(parity, (5, MAX_RUNS + 2)), LoweringOptions(target=Target.cpu())) is None
