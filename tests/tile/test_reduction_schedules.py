"""A row that fits a tile may still be walked in tiles (the tuner measures both): the looped
schedule gives the same results, and its loads carry cache hints (keep what a later pass
re-reads, let go on the last read, keep weights every row reads)."""
import os

import torch

from irgraphs import GraphBuilder
from tilefuse.backends.triton import generate, load_kernel
from tilefuse.fusion import plan_graph
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import cast, unary
from tilefuse.tile.ir import For, LoadTile
from tilefuse.tile.lower import LoweringOptions, lower_plan_kernels
from tilefuse.tile.target import Target


DEVICE = os.environ.get("TILEFUSE_TEST_DEVICE", "cpu")
ON_GPU = DEVICE == "cuda"


def _rmsnorm(m, n, dtype=dt.float32):
    g = GraphBuilder("rms")
    x = g.input("x", (m, n), dtype, strides="contiguous")
    w = g.input("w", (n,), dtype, strides="contiguous")
    ss = g.ctx.reduce((m,), (n,), "sum",
                      lambda i, r: cast(x.load((i[0], r[0])), dt.float32) * cast(x.load((i[0], r[0])), dt.float32),
                      dt.float32)
    out = g.ctx.pointwise((m, n), dtype, lambda i: cast(
        cast(x.load(i), dt.float32) * unary("rsqrt", ss.load((i[0],)) / float(n) + 1e-6)
        * cast(w.load((i[1],)), dt.float32), dtype))
    graph = g.output(out)
    (plan,) = plan_graph(graph).kernels
    return graph, plan


def _loads(stmts):
    for s in stmts:
        if isinstance(s, LoadTile):
            yield s
        elif isinstance(s, For):
            yield from _loads(s.body)


def test_looped_schedule_of_a_fitting_row_matches_and_hints_the_cache():
    m, n = 37, 300  # a 512-lane row held whole by the rules; looped here in 64-wide tiles
    graph, plan = _rmsnorm(m, n)
    looped = {"persistent": False, "XBLOCK": 1, "RBLOCK": 64, "warps": 4}
    (tk,) = lower_plan_kernels(graph, plan, LoweringOptions(target=Target.gpu() if ON_GPU else Target.interpreter(), schedule=looped))
    assert sum(isinstance(s, For) for s in tk.body) == 2  # the sum, then the output pass
    hints = {(t.buffer, t.eviction) for t in _loads(tk.body)}
    assert hints == {("x", "last"), ("x", "first"), ("w", "last")}
    assert "evict_" in generate(tk, interpret=False) and "evict_" not in generate(tk, interpret=True)
    torch.manual_seed(0)
    x, w = torch.randn(m, n), torch.randn(n)
    buffers = {"x": x.to(DEVICE), "w": w.to(DEVICE), graph.outputs[0]: torch.empty(m, n, device=DEVICE)}
    load_kernel(tk, generate(tk, interpret=not ON_GPU), not ON_GPU)(buffers, {})
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(buffers[graph.outputs[0]].cpu().double(), ref, atol=1e-5, rtol=1e-5)


def test_the_rules_keep_the_row_whole():
    graph, plan = _rmsnorm(37, 300)
    (tk,) = lower_plan_kernels(graph, plan, LoweringOptions(target=Target.interpreter()))
    assert not any(isinstance(s, For) for s in tk.body)
    assert all(t.eviction == "" for t in _loads(tk.body))
