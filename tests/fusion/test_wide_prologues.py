"""A product's operand that reads two operand-sized buffers — a dropout's backward,
`g * mask / (1 - p)`, before a linear layer's two gradient products — is stored once by the
kernel that computes it (`fusion.inline`, `_wide_prologue`), whatever the size of its body,
where inlined it would be re-read from both buffers by every tile of output columns. Before
this rule, a layer of BERT's backward whose gradient was stored (its body over the shared-ops
limit) recomputed the dropout in both of its FFN products, at up to six times their time on
the GPU, while its neighbours stored it. A product with one tile's worth of output columns
keeps the prologue. Checked against an fp64 reference on both CPU backends."""
import os

import pytest
import torch

import tilefuse
from backends_on_cpu import CPU_BACKENDS
from tilefuse.fusion import inline

DEVICE = os.environ.get("TILEFUSE_TEST_DEVICE", "cpu")
TARGETS = CPU_BACKENDS if DEVICE == "cpu" else ["auto"]
REASON = "prologue of a contraction reading several operand-sized buffers"


def dropout_backward_then_products(x, g, mask, w, a):
    """`grad` is stored (a graph output); the dropout's backward of it feeds the gradient
    products of the layer's input and of its weight."""
    grad = x * 0.5 + g
    dropped = grad * mask * (1 / 0.9)
    return grad, dropped @ w, dropped.t() @ a


def _inputs(rows, width, columns, dtype):
    g = torch.Generator(device="cpu").manual_seed(rows * 131 + columns)
    x = torch.randn(rows, width, generator=g).to(DEVICE, dtype)
    grad = torch.randn(rows, width, generator=g).to(DEVICE, dtype)
    mask = (torch.rand(rows, width, generator=g) > 0.1).to(DEVICE)
    w = (torch.randn(width, columns, generator=g) / width ** 0.5).to(DEVICE, dtype)
    a = torch.randn(rows, columns, generator=g).to(DEVICE, dtype)
    return x, grad, mask, w, a


def _decisions(fn, inputs, target):
    torch._dynamo.reset()
    with tilefuse.config.patch(target=target, fallback="error", autotune="0"):
        ex = tilefuse.explain(fn, *inputs)
    return [d for r in ex.reports for d in r.decisions]


def _check(fn, inputs, target):
    torch._dynamo.reset()
    outs = torch.compile(fn, backend="tilefuse", options={"target": target})(*inputs)
    refs = fn(*(t.double() if t.is_floating_point() else t for t in inputs))
    eager = fn(*inputs)
    for out, ref, e in zip(outs, refs, eager):
        eager_err = (e.double() - ref).abs().max().item()
        assert (out.double() - ref).abs().max().item() <= 2 * eager_err + 1e-5


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_dropout_backward_before_wide_products_is_stored_once(target, dtype):
    inputs = _inputs(67, 40, inline.MAX_WIDE_PROLOGUE_COLUMNS + 29, dtype)
    decisions = _decisions(dropout_backward_then_products, inputs, target)
    assert any(REASON in d for d in decisions), decisions
    _check(dropout_backward_then_products, inputs, target)


@pytest.mark.parametrize("target", TARGETS)
def test_a_product_with_one_tile_of_columns_keeps_the_prologue(target):
    """`dropped @ w` with 24 output columns and `droppedᵀ @ a` with 24: each reads the
    operand about once, so recomputing the dropout there costs less than storing it."""
    inputs = _inputs(67, 40, 24, torch.bfloat16)
    decisions = _decisions(dropout_backward_then_products, inputs, target)
    assert not any(REASON in d for d in decisions), decisions
    _check(dropout_backward_then_products, inputs, target)


@pytest.mark.parametrize("target", TARGETS)
def test_symbolic_sizes_keep_the_prologue(target):
    """With symbolic rows neither the operand's size nor the product's columns are known: the
    rule stays out (`(x * s) @ w` reads one operand-sized buffer and a vector)."""
    def scaled_product(x, s, w):
        return (x * s) @ w

    w = torch.randn(40, 160, device=DEVICE) / 7
    torch._dynamo.reset()
    with tilefuse.config.patch(target=target, fallback="error", autotune="0"):
        ex = tilefuse.explain(scaled_product, torch.randn(37, 40, device=DEVICE), torch.randn(40, device=DEVICE), w,
                              dynamic=True)
        assert not any(REASON in d for r in ex.reports for d in r.decisions), ex
        compiled = torch.compile(scaled_product, backend="tilefuse", dynamic=True)
        for rows in (37, 53):
            x, s = torch.randn(rows, 40, device=DEVICE), torch.randn(40, device=DEVICE)
            torch.testing.assert_close(compiled(x, s, w), scaled_product(x, s, w), atol=1e-4, rtol=1e-4)
