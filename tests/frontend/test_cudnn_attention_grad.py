"""ATen's cuDNN attention backward is called with the output's gradient in the output's
strides (`frontend.cudnn_attention_grad`): PyTorch 2.11's gives wrong gradients otherwise.
On a CPU the layout logic is checked with a stand-in for the ATen op; on a GPU the op itself
against the math backend's fp32 gradients."""
import pytest
import torch
import torch.nn.functional as F

from tilefuse.frontend import cudnn_attention_grad as grad_module

pytestmark = pytest.mark.skipif(grad_module.cudnn_attention_backward is None,
                                reason="this PyTorch has no cuDNN attention op")


def test_the_graph_calls_the_op_in_place_of_atens():
    from torch.fx.experimental.proxy_tensor import make_fx

    from tilefuse.frontend.to_ir import lower_fx
    from tilefuse.ir.graph import Extern

    aten = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
    op = grad_module.cudnn_attention_backward
    assert str(op._schema).split("(", 1)[1] == str(aten._schema).split("(", 1)[1]  # ATen's schema

    def backward(go, q, k, v, o, lse, seed, offset):
        return aten(go, q, k, v, o, lse, seed, offset, None, None, None, 16, 16, 0.0, True)

    seed = torch.zeros((), dtype=torch.int64)
    args = [torch.randn(1, 2, 16, 8) for _ in range(5)] + [torch.randn(1, 2, 16), seed, seed]
    graph = lower_fx(make_fx(backward, tracing_mode="fake")(*args), "g")  # (a meta kernel: no GPU)
    calls = [n.target for n in graph.nodes.values() if isinstance(n, Extern)]
    assert calls == [op]


def test_grad_out_reaches_aten_in_the_outputs_strides(monkeypatch):
    seen = []
    monkeypatch.setattr(grad_module, "_ATEN", type("Op", (), {"default": staticmethod(
        lambda g, q, k, v, o, *rest, **kw: seen.append((g, o)) or (q, k, v))}))
    out = torch.randn(2, 5, 7, 3)  # [B, H, S, D] contiguous
    grad = torch.randn(2, 7, 5, 3).transpose(1, 2)  # the same shape, stored [B, S, H, D]
    grad_module._backward(grad, out, out, out, out)
    g, o = seen[-1]
    assert g.stride() == o.stride() and torch.equal(g, grad)
    same = torch.randn(2, 5, 7, 3)
    grad_module._backward(same, out, out, out, out)
    assert seen[-1][0] is same  # already laid out as the output: no copy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("grad_layout", [(0, 1, 2, 3), (0, 2, 1, 3), (2, 0, 1, 3)])
def test_the_gradients_are_right_in_any_layout(grad_layout):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    q, k, v, do = (torch.randn(2, 4, 256, 64, device="cuda") for _ in range(4))
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qb, kb, vb, None, True, 0.0, True)
    inverse = [grad_layout.index(i) for i in range(4)]
    laid = do.bfloat16().permute(grad_layout).contiguous().permute(inverse)
    got = grad_module.cudnn_attention_backward(laid, qb, kb, vb, out, lse, seed, offset, None, cq, ck, mq, mk,
                                               0.0, True)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(q64, k64, v64, is_causal=True).backward(do.double())
    for g, want in zip(got, (q64.grad, k64.grad, v64.grad)):
        assert float((g.double() - want).abs().max() / want.abs().max()) < 3e-2
