"""A linear layer's rounded result read by a reduction — BERT's `LayerNorm(dense(h) + h)` — is
stored by the product's kernel as eager's `addmm` stores it (bf16, bias added), not left as an
fp32 product that the norm's kernel adds the bias to (`fusion.inline`,
`_store_rounded_products_before_reductions`): half the bytes between the two kernels, and a
product the library can run on a GPU. Checked against an fp64 reference on both CPU backends,
and for the residual stream, where the rounded value feeds a sum the product's kernel stores."""
import os

import pytest
import torch

import tilefuse
from backends_on_cpu import CPU_BACKENDS
from tilefuse.fusion.library import MEASURED, choose_product

DEVICE = os.environ.get("TILEFUSE_TEST_DEVICE", "cpu")
TARGETS = CPU_BACKENDS if DEVICE == "cpu" else ["auto"]
REASON = "rounded result of a product read by a reduction"


class PostNorm(torch.nn.Module):
    """BERT's output block: `LayerNorm(dense(h) + h)`, twice."""

    def __init__(self, d, layers=2):
        super().__init__()
        self.dense = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(d) for _ in range(layers))

    def forward(self, h):
        for dense, norm in zip(self.dense, self.norms):
            h = norm(dense(h) + h)
        return h


class PreNorm(torch.nn.Module):
    """nanoGPT's residual stream: `h = h + dense(norm(h))`, read by the next norm and sum."""

    def __init__(self, d, layers=3):
        super().__init__()
        self.dense = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(d) for _ in range(layers))

    def forward(self, h):
        for dense, norm in zip(self.dense, self.norms):
            h = h + dense(norm(h))
        return h


def _decisions(model, x, target):
    torch._dynamo.reset()
    with torch.no_grad(), tilefuse.config.patch(target=target, fallback="error"):
        ex = tilefuse.explain(model, x)
    return ex, [d for r in ex.reports for d in r.decisions]


def _check(model, x, target):
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="tilefuse", options={"target": target})(x)
        ref = model.double()(x.double())
        eager = model.to(x.dtype)(x)
    eager_err = (eager.double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * eager_err + 1e-5


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_post_norm_block_stores_the_rounded_linear_result(target, dtype):
    torch.manual_seed(0)
    model = PostNorm(48).to(dtype).eval()
    x = torch.randn(3, 37, 48, device=DEVICE).to(dtype)
    _, decisions = _decisions(model, x, target)
    stored = [d for d in decisions if REASON in d]
    assert len(stored) == (2 if dtype == torch.bfloat16 else 0), decisions  # fp32 addmm rounds nothing
    _check(model, x, target)


def test_the_product_with_its_rounded_result_is_a_library_candidate_on_a_gpu():
    """Planned for a GPU, the dense layer is a plain `addmm` the tuner may give to cuBLAS; its
    fp32 product alone was not (bf16 operands, an fp32 result: no ATen call computes that)."""
    from tilefuse import compiler

    seen = []
    real = compiler.plan_graph

    def record(graph, *args, **kwargs):
        schedule = real(graph, *args, **kwargs)
        seen.extend((graph, p) for p in schedule.kernels if p.kind.value == "contraction")
        return schedule

    compiler.plan_graph = record
    try:
        model = PostNorm(64).to(torch.bfloat16).eval()
        x = torch.randn(2, 40, 64).to(torch.bfloat16)
        _decisions(model, x, "cpu")
    finally:
        compiler.plan_graph = real
    assert len(seen) == 2
    for graph, plan in seen:
        assert choose_product(graph, plan, "auto", cpu=False, users=graph.users()).how == MEASURED, plan.members


@pytest.mark.parametrize("target", TARGETS)
def test_a_residual_stream_keeps_its_sums_as_product_epilogues(target):
    torch.manual_seed(0)
    model = PreNorm(48).to(torch.bfloat16).eval()
    x = torch.randn(2, 29, 48, device=DEVICE).to(torch.bfloat16)
    ex, decisions = _decisions(model, x, target)
    # the last sum is read by nothing but the output; the earlier ones feed the next norm *and*
    # the next sum: only a rounded value whose chain ends in a norm alone is stored separately
    assert len([d for d in decisions if REASON in d]) <= 1, decisions
    _check(model, x, target)
