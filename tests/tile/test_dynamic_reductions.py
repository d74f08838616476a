"""Reductions over symbolic extents (dynamic=True): one compile serves every size, row and
column, on the C++ backend and the Triton interpreter; and the kernel that runs for a size
walks a tile that follows the actual extent (`tile.variants`), not one sized for the worst
case (a sum over 3 rows used to walk a 4096-wide tile per output element)."""
import math
import os
import warnings

import pytest
import sympy
import torch
import torch.fx.experimental._config as fx_config
from torch._dynamo.testing import CompileCounterWithBackend

import tilefuse
from frontend.lowering_harness import assert_close_fp64
from irgraphs import GraphBuilder
from tilefuse.backends import cpu
from tilefuse.backends.triton import generate as triton_source
from tilefuse.compiler import compile_ir
from tilefuse.fusion import plan_graph
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import unary
from tilefuse.runtime.dispatch import SizeDispatch
from tilefuse.tile.ir import For
from tilefuse.tile.lower import LoweringOptions, lower_plan_kernels
from tilefuse.tile.target import Target
from tilefuse.tile.reduction import COLUMN_HELD, CPU_COLUMN_ROWS, SIZE_LADDER
from tilefuse.tile.variants import SizeVariants

HAS_CXX = cpu.find_compiler() is not None
DEVICE = os.environ.get("TILEFUSE_TEST_DEVICE", "cpu")

OPS = {
    "sum": lambda x, d: x.sum(d),
    "amax": lambda x, d: x.amax(d),
    "mean": lambda x, d: x.mean(d),
    "var": lambda x, d: x.var(d),
    "softmax": lambda x, d: x.softmax(d),
    "log_softmax": lambda x, d: torch.log_softmax(x, d),
}
#: (reduced extent, kept extent) per call of one compiled function
CPU_SIZES = ((1, 4), (3, 5), (17, 1), (1000, 3), (8001, 2))
#: the interpreter: small sizes, with a persistent limit of 16 so that 17 and 40 take the
#: looped kernel and 1 and 3 its alternatives
INTERPRET_SIZES = ((1, 4), (3, 5), (17, 1), (40, 3))


def _check_sizes(op: str, axis: int, target: str, sizes, device="cpu", **options) -> None:
    fn = OPS[op]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("tilefuse")
    compiled = torch.compile(lambda x: fn(x, axis), backend=counter, dynamic=True)
    # sizes 0 and 1 would be specialised (a recompile): one graph must serve them all
    with tilefuse.config.patch(target=target, fallback="error", **options), \
            fx_config.patch(backed_size_oblivious=True), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # var over one element: eager warns (and gives nan)
        for r, kept in sizes:
            x = torch.randn((r, kept) if axis == 0 else (kept, r), device=device)
            assert_close_fp64(compiled(x).cpu(), fn(x, axis).cpu(), fn(x.double(), axis).cpu(), name=f"{op} over {r}")
    assert counter.frame_count == 1


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")
@pytest.mark.parametrize("axis", [0, -1], ids=["column", "row"])
@pytest.mark.parametrize("op", list(OPS))
def test_one_compile_serves_every_size_cpp(op, axis):
    _check_sizes(op, axis, "cpu", CPU_SIZES)


@pytest.mark.parametrize("axis", [0, -1], ids=["column", "row"])
@pytest.mark.parametrize("op", list(OPS))
def test_one_compile_serves_every_size_triton(op, axis):
    """Triton kernels: on a GPU (TILEFUSE_TEST_DEVICE=cuda) at every size, else interpreted."""
    if DEVICE == "cuda":
        _check_sizes(op, axis, "triton", CPU_SIZES, device="cuda")
    else:
        _check_sizes(op, axis, "interpret", INTERPRET_SIZES, persistent_reduction_limit=16)


# ------------------------------------------------------------------ the schedule chosen per size
S0, S1 = sympy.symbols("s0 s1", integer=True, positive=True)


def _column_sum(rows, cols):
    g = GraphBuilder("colsum")
    x = g.input("x", (rows, cols), strides="contiguous")
    return g.output(g.ctx.reduce((cols,), (rows,), "sum", lambda i, r: x.load((r[0], i[0])), dt.float32))


def _row_softmax(rows, cols):
    g = GraphBuilder("softmax")
    x = g.input("x", (rows, cols), strides="contiguous")
    m = g.ctx.reduce((rows,), (cols,), "max", lambda i, r: x.load((i[0], r[0])), dt.float32)
    e = g.ctx.pointwise((rows, cols), dt.float32, lambda i: unary("exp", x.load(i) - m.load((i[0],))))
    s = g.ctx.reduce((rows,), (cols,), "sum", lambda i, r: e.load((i[0], r[0])), dt.float32)
    return g.output(g.ctx.pointwise((rows, cols), dt.float32, lambda i: e.load(i) / s.load((i[0],))))


_TARGETS = {"cpu": Target.cpu(), "interpret": Target.interpreter()}


def _kernel(graph, target: str, **options):
    (plan,) = plan_graph(graph).kernels
    (tk,) = lower_plan_kernels(graph, plan, LoweringOptions(target=_TARGETS[target], **options))
    return tk


def _lanes_per_pass(tk, r: int) -> int:
    """Tile elements one program walks along the reduction axis in one pass over a row of r."""
    rblock = tk.constexprs["RBLOCK"]
    looped = any(isinstance(s, For) for s in tk.body)
    return rblock * math.ceil(r / rblock) if looped else rblock


@pytest.mark.parametrize("options", [{"target": "cpu"}, {"target": "interpret"}], ids=["cpu", "interpret"])
@pytest.mark.parametrize("build", [_column_sum, _row_softmax], ids=["column sum", "row softmax"])
def test_the_kernel_chosen_walks_the_actual_extent(build, options):
    """The work per output follows the reduced extent: never fewer lanes than the row (the
    alternatives hold it whole), never more than 4x (2x the static rule's from 3 on)."""
    reduced = S0 if build is _column_sum else S1
    tk = _kernel(build(S0, S1), **options)
    cpu_columns = build is _column_sum and options["target"] == "cpu"
    if cpu_columns:  # a CPU's column tile walks a few rows per step: every length alike, no variants
        assert tk.variants is None and tk.constexprs["RBLOCK"] >= CPU_COLUMN_ROWS
        assert any(isinstance(s, For) for s in tk.body)
        return
    assert tk.variants is not None and tk.variants.extent == reduced
    for r in (1, 3, 4, 5, 17, 1000, 4096, 4097, 8001, 100_000):
        env = {"s0": r, "s1": 7} if reduced == S0 else {"s0": 7, "s1": r}
        chosen = tk.variants.chosen(tk, env)
        lanes = _lanes_per_pass(chosen, r)
        assert r <= lanes <= 4 * r, (r, chosen.name, lanes)
        static = _kernel(build(*((r, 7) if reduced == S0 else (7, r))), **options)
        if 3 <= r <= 4096:
            assert lanes <= 2 * _lanes_per_pass(static, r), (r, chosen.name, lanes)
        # held whole (one pass) up to the ladder's top; a GPU column tile (`reads_columns`: 64
        # outputs wide) holds up to COLUMN_HELD rows and walks longer ones 8 rows at a time
        held = COLUMN_HELD if build is _column_sum else SIZE_LADDER[-1]
        if r <= held:
            assert not any(isinstance(s, For) for s in chosen.body)


def test_one_source_holds_every_variant():
    tk = _kernel(_row_softmax(S0, S1), target="cpu")
    names = [tk.name] + [k.name for k in tk.variants.kernels]
    assert len(set(names)) == len(SIZE_LADDER) + 1
    if HAS_CXX:
        source = cpu.generate(tk)
        assert source.count("#include <stdint.h>") == 1  # the prelude once
        assert all(f'extern "C" void {n}(' in source for n in names)
    source = triton_source(_kernel(_row_softmax(S0, S1), target="interpret"), interpret=True)
    assert source.count("@triton.jit") == len(names) and source.count("import triton\n") == 1


def test_no_variants_for_a_static_extent_or_a_schedule_that_decides():
    assert _kernel(_column_sum(3, S1), target="cpu").variants is None
    assert _kernel(_column_sum(9000, S1), target="cpu").variants is None
    # (the row tiles of a column sum, column tiles off: a CPU's column tile has no variants)
    rows = {"target": "cpu", "column_tiles": False}
    looped = {"persistent": False, "RBLOCK": 64, "XBLOCK": 1, "warps": 4}
    assert _kernel(_column_sum(S0, S1), schedule=looped, **rows).variants is None
    # a tuned tile for the looped kernel keeps its alternatives
    tuned = _kernel(_column_sum(S0, S1), schedule={"RBLOCK": 1024, "warps": 8}, **rows)
    assert tuned.constexprs["RBLOCK"] == 1024 and tuned.variants is not None
    # a persistent limit below the ladder: the looped kernel alone
    assert _kernel(_column_sum(S0, S1), persistent_reduction_limit=2, **rows).variants is None


@pytest.mark.parametrize("extent, env, value", [
    (S0, {"s0": 5}, 5),
    (2 * S0 * S1, {"s0": 3, "s1": 700}, 4200),
    (S0 - 1, {"s0": 5}, 4),  # (not a product: through sympy)
])
def test_the_dispatch_runs_the_variant_the_sizes_choose(extent, env, value):
    ran = []
    launcher = lambda name: lambda buffers, env: ran.append(name)  # noqa: E731
    variants = SizeVariants(extent, (4, 16, 4096), ("r4", "r16", "r4096"))
    dispatch = SizeDispatch(variants, launcher("looped"), [launcher(n) for n in variants.kernels])
    dispatch({}, env)
    assert ran == [next((n for b, n in zip(variants.bounds, variants.kernels) if value <= b), "looped")]
    for v, expected in ((0, 0), (1, 0), (4, 0), (5, 1), (16, 1), (17, 2), (4096, 2), (4097, None)):
        assert variants.index(v) == expected


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")
def test_a_graph_serves_empty_and_long_rows():
    """Through the driver, below Dynamo (which specialises 0): R = 0 and R past every tile —
    with the row tiles and their variants chosen at launch, and with a column tile."""
    for column_tiles in (False, True):
        with tilefuse.config.patch(target="cpu", column_tiles=column_tiles):
            compiled, report = compile_ir(_column_sum(S0, S1), torch.device("cpu"))
        if not column_tiles:
            assert any("known at launch" in n for k in report.kernels for n in k.notes)
            assert isinstance(compiled.steps[0].launch, SizeDispatch)
        for rows in (0, 1, 4, 5, 4097, 9000):
            x = torch.randn(rows, 3)
            (out,) = compiled(x)
            torch.testing.assert_close(out.double(), x.double().sum(0), atol=1e-4, rtol=1e-5)
