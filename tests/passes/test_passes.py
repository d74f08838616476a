"""Constant folding, CSE and DCE keep results and shrink graphs."""
import pytest
import torch

import tilefuse

from irgraphs import GraphBuilder
from tilefuse.ir import Const, Pointwise, dtypes as dt, unary
from tilefuse.ir.interpret import interpret
from tilefuse.passes import eliminate_common_subexpressions, eliminate_dead_code, fold_constants, run_passes


def test_cse_merges_identical_nodes_and_dce_drops_dead_ones():
    g = GraphBuilder("g")
    x = g.input("x", (6,))
    a = g.ctx.pointwise((6,), dt.float32, lambda i: unary("exp", x.load(i)))
    b = g.ctx.pointwise((6,), dt.float32, lambda i: unary("exp", x.load(i)))
    g.ctx.pointwise((6,), dt.float32, lambda i: x.load(i) * 3.0)  # dead
    s = g.ctx.pointwise((6,), dt.float32, lambda i: a.load(i) + b.load(i))
    graph = g.output(s)
    xv = torch.randn(6)
    before = interpret(graph, [xv])[0]
    eliminate_common_subexpressions(graph)
    eliminate_dead_code(graph)
    computed = [n for n in graph.nodes.values() if isinstance(n, Pointwise)]
    assert len(computed) == 2
    torch.testing.assert_close(interpret(graph, [xv])[0], before)


def test_fold_constants():
    g = GraphBuilder("g")
    x = g.input("x", (3,))
    y = g.ctx.pointwise((3,), dt.float32, lambda i: x.load(i) * (Const(2.0, dt.float32) + Const(3.0, dt.float32)) * 1.0)
    graph = g.output(y)
    fold_constants(graph)
    text = str(graph)
    assert "5.0" in text and "2.0" not in text and "* 1.0" not in text
    xv = torch.randn(3)
    torch.testing.assert_close(interpret(run_passes(graph), [xv])[0], xv * 5)


def _write_at_a_position_computed_twice(cache, pos, x):
    first = (pos + 1) * 2  # the position, computed once for the output
    cache.index_copy_(1, pos + 1, x)  # and again for the write: CSE merges the two
    return cache.sum(-1) + first.sum()


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_cse_renames_what_a_scatter_reads(target):
    """A scatter whose index (or value) reads a node CSE removed reads the survivor (found on
    a Hugging Face Llama's decode step with a static KV cache: its position was computed twice,
    and the graph failed to compile)."""
    cache, pos, x = torch.randn(2, 9, 4), torch.tensor([3, 0, 6]), torch.randn(2, 3, 4)
    expected_cache = cache.clone()
    torch._dynamo.reset()
    out = tilefuse.compile(_write_at_a_position_computed_twice, fallback="error", target=target)(cache, pos, x)
    torch.testing.assert_close(out, _write_at_a_position_computed_twice(expected_cache, pos, x))
    torch.testing.assert_close(cache, expected_cache)
