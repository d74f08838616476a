"""How each reduction monoid reads in tile IR, Triton and C++: the identities, tile combiners
and helpers the lowering and both printers take from `ir.monoid`. Kernel sources key the disk
caches (and dedupe kernels), so these spellings are fixed: a change here is a change to every
cached kernel."""
import pytest

from irgraphs import GraphBuilder
from tilefuse.backends.cpu.codegen import generate as cpp_source
from tilefuse.backends.triton.codegen import generate as triton_source
from tilefuse.fusion import plan_graph
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import binary, cast, const
from tilefuse.ir.monoid import monoid
from tilefuse.tile.lower import LoweringOptions, lower_plan
from tilefuse.tile.target import Target
from tilefuse.tile.printer import format_tile_kernel


def _sources(name: str, dtype, cols: int) -> dict:
    g = GraphBuilder("g")
    x = g.input("x", (3, cols), dtype)
    if monoid(name).logical:
        body = lambda i, r: binary("gt", cast(x.load((i[0], r[0])), dt.float32), const(0.5, dt.float32))
        out = dt.bool_
    else:
        body = lambda i, r: cast(x.load((i[0], r[0])), dt.compute_dtype(dtype))
        out = dt.int64 if monoid(name).arg else dtype
    graph = g.output(g.ctx.reduce((3,), (cols,), monoid(name), body, out))
    (plan,) = plan_graph(graph).kernels
    gpu = lower_plan(graph, plan, LoweringOptions())
    interp = lower_plan(graph, plan, LoweringOptions(target=Target.interpreter()))
    cpu = lower_plan(graph, plan, LoweringOptions(target=Target.cpu()))
    return {"ir": str(graph), "tile": format_tile_kernel(gpu), "triton": triton_source(gpu),
            "interpret": triton_source(interp, True), "cpp": cpp_source(cpu)}


LOOPED = 20000  # walked in tiles with a carried accumulator (persistent rows end at 8192)
CASES = [
    ("sum", dt.float32, 29, {"ir": ["= sum[r0<29](x[i0, r0])"], "tile": ["reduce_sum("], "triton": ["tl.sum("],
                             "cpp": ["tf_hsum16f("]}),
    ("sum", dt.float32, LOOPED, {"tile": ["full(['XBLOCK', 'RBLOCK'], 0, float32)"],
                                 "triton": ['tl.full([XBLOCK, RBLOCK], 0.0, tl.float32)']}),
    ("prod", dt.float32, 29, {"tile": ["reduce_prod("], "triton": ["_prod_combine)", "return a * b"]}),
    ("max", dt.float32, LOOPED, {
        "ir": ["= max[r0<20000](x[i0, r0])"], "tile": ["full(['XBLOCK', 'RBLOCK'], -inf, float32)", "reduce_max("],
        "triton": ['tl.full([XBLOCK, RBLOCK], float("-inf"), tl.float32)', "_fmax_combine)"],
        "interpret": ["float('nan'), tl.max("], "cpp": ["= (-INFINITY);", "tf_max<float>(", "tf_hmax16f("]}),
    ("min", dt.int32, 29, {"tile": ["reduce_min("], "triton": ["_min_combine)"],
                           "cpp": ["= 2147483647;", "tf_min<int32_t>("]}),
    ("min", dt.float64, LOOPED, {"triton": ['float("inf"), tl.float64)', "_fmin_combine)"]}),
    ("argmax", dt.float32, LOOPED, {
        "ir": ["= argmax[r0<20000](x[i0, r0])"], "tile": ["full(['XBLOCK', 'RBLOCK'], 0, int64)", "= argmax(acc"],
        "triton": ['float("-inf"), tl.float32)', "_argmax_combine)"], "cpp": ["= INT64_MAX;", "(v2 > v1)"]}),
    ("argmin", dt.int8, 29, {"tile": ["= argmin("], "triton": ["_argmin_combine)", "127"],
                             "cpp": ["((v2 < v1) && !n1)"]}),
    ("any", dt.float32, 29, {"ir": ["= any[r0<29]"], "tile": ["reduce_max("], "triton": ["_max_combine)"],
                             "cpp": ["= -2147483648;", "tf_max<int32_t>("]}),
    ("all", dt.float32, LOOPED, {"ir": ["= all[r0<20000]"], "tile": ["full(['XBLOCK', 'RBLOCK'], 1, int32)",
                                                                     "reduce_min("],
                                 "triton": ["tl.full([XBLOCK, RBLOCK], 1, tl.int32)", "_min_combine)"],
                                 "cpp": ["tf_min<int32_t>("]}),
]


@pytest.mark.parametrize("name,dtype,cols,expected", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_monoid_spellings(name, dtype, cols, expected):
    texts = _sources(name, dtype, cols)
    for where, pieces in expected.items():
        for piece in pieces:
            assert piece in texts[where], f"{where} of {name} over {dtype}[3, {cols}] lacks {piece!r}"
