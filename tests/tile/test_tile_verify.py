"""The tile-IR verifier accepts what the lowering produces and rejects broken kernels."""
import pytest

from irgraphs import GraphBuilder
from tilefuse.fusion import plan_graph
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import Var
from tilefuse.tile.ir import Assign, Let, StoreTile
from tilefuse.tile.lower import LoweringOptions, lower_plan
from tilefuse.tile.target import Target
from tilefuse.tile.printer import format_tile_kernel
from tilefuse.tile.verify import TileVerificationError, verify_tile_kernel


def _kernel():
    g = GraphBuilder("g")
    x = g.input("x", (6, 10))
    s = g.ctx.reduce((6,), (10,), "sum", lambda i, r: x.load((i[0], r[0])), dt.float32)
    graph = g.output(s)
    (plan,) = plan_graph(graph).kernels
    return lower_plan(graph, plan, LoweringOptions(target=Target.interpreter(), persistent_reduction_limit=4))


def test_lowered_kernels_verify_and_print():
    k = verify_tile_kernel(_kernel())
    text = format_tile_kernel(k)
    assert "for roffset in range" in text and "reduce_sum" in text


def test_use_before_definition_is_rejected():
    k = _kernel()
    k.body.insert(0, Let("early", Var("acc_does_not_exist", dt.float32)))
    with pytest.raises(TileVerificationError, match="undefined"):
        verify_tile_kernel(k)


def test_store_to_unknown_buffer_and_bad_update_are_rejected():
    k = _kernel()
    k.body.append(StoreTile("nope", Var("pid", dt.int32), Var("pid", dt.int32), None, dt.float32))
    with pytest.raises(TileVerificationError, match="not a parameter"):
        verify_tile_kernel(k)
    k = _kernel()
    k.body.append(Assign("never_defined", Var("pid", dt.int32)))
    with pytest.raises(TileVerificationError, match="not defined before"):
        verify_tile_kernel(k)
