"""Reductions that read across their outputs (a bias gradient: Σ over rows of [rows, features])
get a column tile (`tile.reduction.reads_columns`): many outputs wide, a few rows deep, walked
down the reduced axis, so each step reads whole lines of memory.
Which plans are columns is read off the loads' addresses; the column kernels compute what
eager does (fp64 reference) at odd sizes, short and long axes, strided inputs and symbolic
sizes, on the Triton interpreter (or a GPU) and the C++ backend."""
import os

import pytest
import torch

import tilefuse
from frontend.lowering_harness import assert_close_fp64
from irgraphs import GraphBuilder
from tilefuse.fusion import plan_graph
from tilefuse.ir import dtypes as dt
from tilefuse.tile.ir import For
from tilefuse.tile.lower import LoweringOptions, lower_plan_kernels
from tilefuse.backends import cpu
from tilefuse.tile.reduction import (COLUMN_HELD, COLUMN_MIN_OUTPUTS, COLUMN_TILE, CPU_COLUMN_CHAIN, CPU_COLUMN_ROWS,
                                     CPU_COLUMN_WIDTH, reads_columns, reduction_space)
from tilefuse.tile.target import Target

DEVICE = os.environ.get("TILEFUSE_TEST_DEVICE", "cpu")
TARGET = "triton" if DEVICE == "cuda" else "interpret"


def _sum_over(rows, cols, axis, strides="contiguous"):
    g = GraphBuilder("sums")
    x = g.input("x", (rows, cols), dt.float32, strides=strides)
    if axis == 0:
        out = g.ctx.reduce((cols,), (rows,), "sum", lambda i, r: x.load((r[0], i[0])), dt.float32)
    else:
        out = g.ctx.reduce((rows,), (cols,), "sum", lambda i, r: x.load((i[0], r[0])), dt.float32)
    return g.output(out)


def _norm_weight_grad(rows, cols):
    """Σ_r dy[r, x] · (x[r, x] − mean[r]): a row statistic read beside the columns."""
    g = GraphBuilder("wgrad")
    dy = g.input("dy", (rows, cols), dt.float32, strides="contiguous")
    x = g.input("x", (rows, cols), dt.float32, strides="contiguous")
    mean = g.input("mean", (rows,), dt.float32, strides="contiguous")
    out = g.ctx.reduce((cols,), (rows,), "sum",
                       lambda i, r: dy.load((r[0], i[0])) * (x.load((r[0], i[0])) - mean.load((r[0],))), dt.float32)
    return g.output(out)


def _plan(graph):
    (plan,) = plan_graph(graph).kernels
    return plan


def _columns(graph) -> bool:
    return reads_columns(graph, _plan(graph))


def test_few_outputs_are_no_columns_and_every_column_space_enumerates():
    graph = _sum_over(3000, COLUMN_MIN_OUTPUTS - 1, 0)  # a tile that narrow would crawl down the rows
    for target in (Target.cpu(), Target.interpreter()):
        (tk,) = lower_plan_kernels(graph, _plan(graph), LoweringOptions(target=target))
        assert tk.constexprs["XBLOCK"] < COLUMN_MIN_OUTPUTS and tk.constexprs["RBLOCK"] > 64
    gpu = LoweringOptions(target=Target.gpu(sm_count=132))
    for rows in (40, 300):  # held whole, walked
        graph = _sum_over(rows, 768, 0)
        space = reduction_space(graph, _plan(graph), gpu)
        assert len(list(space.schedules())) > 4


def test_columns_are_read_off_the_addresses():
    assert _columns(_sum_over(300, 77, 0))
    assert not _columns(_sum_over(300, 77, 1))  # along each row
    # the same sum over rows of a column-major tensor reads each column contiguously: a row sum
    assert not _columns(_sum_over(300, 77, 0, strides=(1, 300)))
    assert _columns(_norm_weight_grad(300, 77))  # (mean[r] says nothing)


def test_a_column_tile_is_wide_and_walks_rows_a_few_at_a_time():
    graph = _sum_over(300, 77, 0)
    (tk,) = lower_plan_kernels(graph, _plan(graph), LoweringOptions(target=Target.interpreter()))
    assert tk.constexprs == {"XBLOCK": COLUMN_TILE["XBLOCK"], "RBLOCK": COLUMN_TILE["RBLOCK"]}
    assert any(isinstance(s, For) for s in tk.body)
    graph = _sum_over(COLUMN_HELD - 5, 77, 0)  # short: held whole, still many outputs wide
    (tk,) = lower_plan_kernels(graph, _plan(graph), LoweringOptions(target=Target.interpreter()))
    assert tk.constexprs["XBLOCK"] >= 64 and not any(isinstance(s, For) for s in tk.body)
    graph = _sum_over(300, 77, 0)  # a CPU walks a few rows per step, vector loops over 64 outputs
    (tk,) = lower_plan_kernels(graph, _plan(graph), LoweringOptions(target=Target.cpu()))
    width = tk.constexprs["XBLOCK"]  # (77 outputs: 4 programs of 32, CPU_COLUMN_PROGRAMS)
    assert tk.constexprs == {"XBLOCK": 32, "RBLOCK": CPU_COLUMN_ROWS} and 32 <= CPU_COLUMN_WIDTH
    assert any(isinstance(s, For) for s in tk.body)
    # its lanes are stored by columns: the walk updates them contiguously, as it reads memory
    assert f"[tf_j * {width} + tf_i]" in cpu.generate(tk)
    # a long axis gets more lanes: no lane adds more than CPU_COLUMN_CHAIN rows in one chain
    graph = _sum_over(65536, 77, 0)
    (tk,) = lower_plan_kernels(graph, _plan(graph), LoweringOptions(target=Target.cpu()))
    assert tk.constexprs["RBLOCK"] * CPU_COLUMN_CHAIN >= 65536
    # a row statistic read beside the columns keeps the contiguous walk and lanes
    graph = _norm_weight_grad(300, 77)
    (tk,) = lower_plan_kernels(graph, _plan(graph), LoweringOptions(target=Target.cpu()))
    assert f"[tf_j * {width} + tf_i]" in cpu.generate(tk)
    # knob `column_tiles` off: the row tile of other reductions
    (tk,) = lower_plan_kernels(graph, _plan(graph), LoweringOptions(target=Target.interpreter(), column_tiles=False))
    assert tk.constexprs["RBLOCK"] == 512  # (the 300 rows held whole)


CASES = {
    "bias grad": lambda g: g.sum(0),
    "max": lambda g: g.amax(0),
    "mean over two dims": lambda g: g.mean((0, 1)) if g.dim() == 3 else g.mean(0),
    "softmax over rows": lambda g: g.softmax(0),
    "norm weight grad": lambda g: (g * (g - g.mean(-1, keepdim=True))).sum(0),
}


@pytest.mark.parametrize("target", [TARGET, "cpu"])
@pytest.mark.parametrize("rows", [1, 37, 300])
@pytest.mark.parametrize("case", list(CASES))
def test_column_kernels_match_eager(case, rows, target):
    fn = CASES[case]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="tilefuse")
    torch.manual_seed(rows)
    device = "cpu" if target == "cpu" else DEVICE
    with tilefuse.config.patch(target=target, fallback="error"):
        for x in (torch.randn(rows, 77, device=device),  # 77 outputs: the last block partial
                  torch.randn(rows, 160, device=device)[:, 3:80],  # rows strided by 160
                  torch.randn(3, rows, 70, device=device)):
            assert_close_fp64(compiled(x).cpu(), fn(x).cpu(), fn(x.double()).cpu(), name=f"{case} {tuple(x.shape)}")


@pytest.mark.parametrize("target", [TARGET, "cpu"])
def test_a_symbolic_column_sum_matches_at_every_length(target):
    fn = lambda g: g.sum(0)  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="tilefuse", dynamic=True)
    device = "cpu" if target == "cpu" else DEVICE
    with tilefuse.config.patch(target=target, fallback="error"):
        for rows, cols in ((2, 5), (70, 3), (300, 131)):
            x = torch.randn(rows, cols, device=device)
            assert_close_fp64(compiled(x).cpu(), fn(x).cpu(), fn(x.double()).cpu(), name=f"sum over {rows}")
