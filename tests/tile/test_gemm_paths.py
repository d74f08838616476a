"""Hopper GEMM paths of the contraction lowering: operands read through tensor descriptors
(TMA) and persistent programs walking the output tiles. The descriptor rules are checked on
graphs; the kernels run under the Triton interpreter at odd sizes against PyTorch (on the GPU
the same kernels are measured by the tuner, `impl`-free knobs `tma` and `persistent`)."""
import math
import os

import pytest
import torch

from irgraphs import GraphBuilder
from tilefuse.backends.triton import generate, load_kernel
from tilefuse.fusion import plan_graph
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import cast, unary
from tilefuse.tile.descriptors import describe_operands
from tilefuse.tile.ir import DescriptorLoad, For, MakeDescriptor
from tilefuse.tile.common import dot_operand
from tilefuse.tile.lower import LoweringOptions, lower_plan_kernels, schedule_space
from tilefuse.tile.target import Target
from tilefuse.tile.verify import verify_tile_kernel

HOPPER = LoweringOptions(target=Target.gpu(sm_count=132, tma=True))
DEVICE = os.environ.get("TILEFUSE_TEST_DEVICE", "cpu")
ON_GPU = DEVICE == "cuda"


def _gelu_linear(m, n, k, dtype=dt.float16, weight_nk=False):
    """gelu(a @ w + bias), w stored (k, n) or, as nn.Linear stores it, (n, k)."""
    g = GraphBuilder("gemm")
    a = g.input("a", (m, k), dtype, strides="contiguous")
    w = g.input("w", (n, k) if weight_nk else (k, n), dtype, strides="contiguous")
    bias = g.input("bias", (n,), dtype, strides="contiguous")

    def w_at(kk, nn):
        return w.load((nn, kk)) if weight_nk else w.load((kk, nn))

    mm = g.ctx.reduce((m, n), (k,), "sum",
                      lambda i, r: cast(a.load((i[0], r[0])), dt.float32) * cast(w_at(r[0], i[1]), dt.float32),
                      dt.float32)
    y = g.ctx.pointwise((m, n), dt.float32, lambda i: mm.load(i) + cast(bias.load((i[1],)), dt.float32))
    out = g.ctx.pointwise((m, n), dtype,
                          lambda i: cast(y.load(i) * 0.5 * (1.0 + unary("erf", y.load(i) * (1 / math.sqrt(2)))), dtype))
    graph = g.output(out)
    (plan,) = plan_graph(graph).kernels
    assert plan.kind == "contraction"
    return graph, plan


def _described(graph, plan):
    c = plan.contraction
    return describe_operands(graph, plan, dot_operand(c.a)[0], dot_operand(c.b)[0])


def test_row_major_operands_are_described_and_nn_linear_weights_transposed():
    graph, plan = _gelu_linear(37, 40, 48)
    a, b = _described(graph, plan)
    assert (a.buffer, a.transpose, a.block) == ("a", False, ("BLOCK_M", "BLOCK_K"))
    assert (b.buffer, b.transpose, b.block) == ("w", False, ("BLOCK_K", "BLOCK_N"))
    assert a.row_stride == 48 and b.row_stride == 40
    graph, plan = _gelu_linear(37, 40, 48, weight_nk=True)
    _, b = _described(graph, plan)
    assert (b.transpose, b.block, tuple(b.shape)) == (True, ("BLOCK_N", "BLOCK_K"), (40, 48))


@pytest.mark.parametrize("m,n,k,dtype", [
    (37, 40, 20, dt.float16),   # A's rows are 40 bytes apart: not a multiple of 16
    (37, 45, 48, dt.float16),   # B's rows are 90 bytes apart
    (37, 40, 48, dt.float32),   # fp32 operands keep pointer loads
])
def test_views_that_break_the_hardware_rules_keep_pointer_loads(m, n, k, dtype):
    graph, plan = _gelu_linear(m, n, k, dtype)
    assert _described(graph, plan) is None
    g = GraphBuilder("runtime_strides")
    a, b = g.input("a", (64, 64), dt.float16), g.input("b", (64, 64), dt.float16)  # strides unknown until run time
    graph = g.output(g.ctx.reduce((64, 64), (64,), "sum", lambda i, r: cast(a.load((i[0], r[0])), dt.float32)
                                  * cast(b.load((r[0], i[1])), dt.float32), dt.float32))
    (plan,) = plan_graph(graph).kernels
    assert _described(graph, plan) is None
    assert "tma" not in schedule_space(graph, plan, HOPPER).knobs


def test_space_offers_tma_and_persistence_only_with_descriptors():
    graph, plan = _gelu_linear(4096, 4096, 4096, dt.bfloat16)
    space = schedule_space(graph, plan, HOPPER)
    assert space.knobs["tma"] == (0, 1) and space.knobs["persistent"] == (0, 1)
    assert space.default["tma"] == 0 and space.default["persistent"] == 0
    configs = space.schedules()
    assert any(c["persistent"] for c in configs)
    assert all(c["tma"] for c in configs if c["persistent"])
    assert "tma" not in schedule_space(graph, plan, LoweringOptions(target=Target.gpu(sm_count=132))).knobs  # not Hopper


def _run(graph, plan, schedule, args):
    options = LoweringOptions(target=Target(interpret=not ON_GPU, sm_count=3, tma=True), schedule=schedule)
    (tk,) = lower_plan_kernels(graph, plan, options)
    verify_tile_kernel(tk)
    source = generate(tk, interpret=not ON_GPU)
    buffers = {name: t.to(DEVICE) for name, t in zip(("a", "w", "bias"), args)}
    out_name = graph.outputs[0]
    buffers[out_name] = torch.empty(args[0].shape[0], args[2].shape[0], dtype=args[0].dtype, device=DEVICE)
    load_kernel(tk, source, not ON_GPU)(buffers, {})
    return tk, source, buffers[out_name].cpu()


def _walk(stmts):
    for s in stmts:
        yield s
        if isinstance(s, For):
            yield from _walk(s.body)


@pytest.mark.parametrize("persistent", [0, 1])
@pytest.mark.parametrize("weight_nk", [False, True])
def test_descriptor_kernels_match_pytorch_at_ragged_sizes(persistent, weight_nk):
    torch.manual_seed(persistent * 2 + weight_nk)
    m, n, k = 37, 40, 48  # none a multiple of the 32-blocks: descriptors zero-fill the edges
    if ON_GPU and not torch.cuda.get_device_capability()[0] >= 9:
        pytest.skip("tensor descriptors need a Hopper GPU")
    graph, plan = _gelu_linear(m, n, k, weight_nk=weight_nk)
    a = torch.randn(m, k, dtype=torch.float16)
    w = torch.randn(n, k, dtype=torch.float16) if weight_nk else torch.randn(k, n, dtype=torch.float16)
    bias = torch.randn(n, dtype=torch.float16)
    schedule = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "warps": 4, "stages": 1,
                "tma": 1, "persistent": persistent}
    tk, source, out = _run(graph, plan, schedule, (a, w, bias))
    stmts = list(_walk(tk.body))
    assert sum(isinstance(s, MakeDescriptor) for s in stmts) == 2
    assert sum(isinstance(s, DescriptorLoad) for s in stmts) == 2
    assert any(isinstance(s, DescriptorLoad) and s.transpose for s in stmts) == weight_nk
    assert "make_tensor_descriptor" in source
    if persistent:
        assert "flatten=True" in source and tk.constexprs["NUM_SMS"] == 3
        assert tk.grid_size({}) == (3, 1)  # fewer programs than the 2×2 tiles... capped by the SMs
    wk = w.double().T if weight_nk else w.double()
    ref = torch.nn.functional.gelu(a.double() @ wk + bias.double())
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_cost_model_ranks_a_descriptor_path_among_the_measured():
    from tilefuse.tune.cost import rank

    graph, plan = _gelu_linear(8192, 4096, 4096, dt.bfloat16)
    space = schedule_space(graph, plan, HOPPER)
    head = [cfg for _, cfg in rank(space, keep=8)]
    assert space.default in head
    assert any(cfg["tma"] and cfg["persistent"] for cfg in head)
