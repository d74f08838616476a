"""PyTorch's fused attention ops (the ones `F.scaled_dot_product_attention` dispatches to on
CUDA) lower through the math definition of attention and become one flash kernel; results
match an fp64 reference; ops whose other results the graph uses stay ATen externs.

There is no GPU here: the graphs are traced with fake tensors (the ops have meta kernels) and
compiled by tilefuse, whose kernels run on CPU through the Triton interpreter.
"""
import operator

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import tilefuse
from tilefuse.compiler import compile_fx
from tilefuse.frontend.context import LoweringContext
from tilefuse.frontend.lowerings.attention import fused_attention
from tilefuse.frontend.registry import Unsupported
from tilefuse.ir.graph import Graph

aten = torch.ops.aten
B, L, S, E = 1, 13, 21, 24


def math_attention(q, k, v, mask=None, causal=None, scale=None, dtype=torch.float64):
    """softmax(q·kᵀ·scale + mask) @ v in `dtype`, rows masked throughout giving 0; `causal` is
    None, "top_left" or "bottom_right"; a boolean mask keeps where True."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    n_q, n_k = s.shape[-2:]
    if causal:
        i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
        s = s.masked_fill(j > i + (n_k - n_q if causal == "bottom_right" else 0), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(dtype)
    p = torch.where((s == float("-inf")).all(-1, keepdim=True), 0.0, torch.softmax(s, -1))
    return p @ v


def compile_graph(fn, *inputs):
    """Trace `fn` with fake tensors and compile the graph; returns (compiled graph, report)."""
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    return compile_fx(gm, torch.device("cpu"), "sdpa")


def masks(dtype):
    keep = torch.rand(L, S) > 0.3
    keep[3] = False  # a row masked throughout
    return {"bias": torch.randn(L, S, dtype=dtype), "bias4": torch.randn(B, 1, L, S, dtype=dtype), "keep": keep}


def cuda_style_bias(keep, q):
    """What F.scaled_dot_product_attention hands the efficient kernel for a boolean mask: 0 /
    -inf in the query's dtype, padded to an aligned row length, sliced back, expanded."""
    bias = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(keep.logical_not(), float("-inf"))
    n = keep.shape[-1]
    bias = F.pad(bias, (0, 16 - n % 16))[..., :n]
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], n)


# (id, call(q, k, v, mask) -> op result, dtype, (query heads, key/value heads), value head dim,
#  mask name, reference keywords)
CASES = [
    ("flash", lambda q, k, v, m: aten._scaled_dot_product_flash_attention(q, k, v)[0],
     torch.float32, (1, 1), E, None, {}),
    ("flash-causal-scale-bf16", lambda q, k, v, m: aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True, scale=0.3)[0], torch.bfloat16, (1, 1), E, None,
     {"causal": "bottom_right", "scale": 0.3}),
    ("flash-gqa-causal", lambda q, k, v, m: aten._scaled_dot_product_flash_attention(q, k, v, is_causal=True)[0],
     torch.float32, (4, 2), E, None, {"causal": "bottom_right"}),
    ("efficient-bias", lambda q, k, v, m: aten._scaled_dot_product_efficient_attention(q, k, v, m, False)[0],
     torch.float32, (1, 1), E, "bias", {}),
    ("efficient-keep-cuda-style-bf16", lambda q, k, v, m: aten._scaled_dot_product_efficient_attention(
        q, k, v, cuda_style_bias(m, q), False)[0], torch.bfloat16, (1, 1), 16, "keep", {}),
    ("efficient-causal-bias-scale", lambda q, k, v, m: aten._scaled_dot_product_efficient_attention(
        q, k, v, m, True, 0.0, True, scale=0.15)[0], torch.float32, (1, 1), 16, "bias4",
     {"causal": "top_left", "scale": 0.15}),
    ("efficient-bool-mask", lambda q, k, v, m: aten._scaled_dot_product_efficient_attention(q, k, v, m, False)[0],
     torch.float32, (1, 1), E, "keep", {}),
    ("cudnn-gqa-causal-bf16", lambda q, k, v, m: aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, False, is_causal=True)[0], torch.bfloat16, (2, 1), E, None, {"causal": "top_left"}),
    ("cudnn-bias", lambda q, k, v, m: aten._scaled_dot_product_cudnn_attention(q, k, v, m, True, scale=0.2)[0],
     torch.float32, (1, 1), E, "bias", {"scale": 0.2}),
    ("cpu-gqa-mask", lambda q, k, v, m: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=m)[0],
     torch.float32, (2, 1), E, "bias", {}),
    ("cpu-causal-bf16", lambda q, k, v, m: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0],
     torch.bfloat16, (1, 1), E, None, {"causal": "top_left"}),
    ("overrideable-negative-scale", lambda q, k, v, m: aten._scaled_dot_product_fused_attention_overrideable(
        q, k, v, scale=-0.2)[0], torch.float32, (1, 1), E, None, {"scale": -0.2}),
    ("efficient-gqa-bias-fp16", lambda q, k, v, m: aten._scaled_dot_product_efficient_attention(
        q, k, v, m.expand(B, 4, L, S), False)[0], torch.float16, (4, 2), 16, "bias4", {}),
    ("cudnn-causal-fp64", lambda q, k, v, m: aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, False, is_causal=True)[0], torch.float64, (1, 1), E, None, {"causal": "top_left"}),
    ("overrideable-bias-causal-bf16", lambda q, k, v, m: aten._scaled_dot_product_fused_attention_overrideable(
        q, k, v, m, is_causal=True)[0], torch.bfloat16, (1, 1), E, "bias", {"causal": "top_left"}),
]


@pytest.mark.parametrize("name,call,dtype,heads,ev,mask,ref_kwargs", CASES, ids=[c[0] for c in CASES])
def test_fused_attention_op_is_one_flash_kernel(name, call, dtype, heads, ev, mask, ref_kwargs):
    q = torch.randn(B, heads[0], L, E, dtype=dtype)
    k = torch.randn(B, heads[1], S, E, dtype=dtype)
    v = torch.randn(B, heads[1], S, ev, dtype=dtype)
    m = masks(dtype)[mask] if mask else None
    compiled, report = compile_graph(call, q, k, v, m)
    # (a mask tensor adds its block summary's kernels before the flash kernel)
    kinds = [kr.kind for kr in report.kernels if kr.kind != "block-summary"]
    assert kinds == ["flash"] and not report.externs, report.graph_ir
    if dtype in (torch.bfloat16, torch.float16):  # both products on the inputs' dtype, as the fused kernels
        dots = [ln for ln in report.kernels[-1].tile_ir.splitlines() if "dot(" in ln]
        assert dots and all(f"in {str(dtype).split('.')[1]}" in ln for ln in dots), dots
    out = compiled(q, k, v, m)[0]
    assert out.dtype == dtype and out.shape == (B, heads[0], L, ev)
    ref = math_attention(q, k, v, m, **ref_kwargs)
    eager = math_attention(q, k, v, m, dtype=torch.float32, **ref_kwargs).to(dtype)  # the math path
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}.get(dtype, 1e-2)
    err, eager_err = ((x.double() - ref).abs().max().item() for x in (out, eager))
    assert err <= 2 * eager_err + tol, (err, eager_err)
    if mask == "keep":  # PyTorch's math path: a row masked throughout gives 0
        assert out[:, :, 3].eq(0).all()


def test_cpu_flash_op_matches_its_own_kernel():
    q, k, v = torch.randn(B, 2, L, E), torch.randn(B, 2, S, E), torch.randn(B, 2, S, E)
    bias = torch.randn(L, S)

    def fn(q, k, v, bias):
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias, scale=0.3)[0]

    compiled, report = compile_graph(fn, q, k, v, bias)
    assert [kr.kind for kr in report.kernels] == ["flash"]
    torch.testing.assert_close(compiled(q, k, v, bias)[0], fn(q, k, v, bias), atol=1e-5, rtol=1e-5)


def test_torch_compile_of_the_cuda_op_reports_one_flash_kernel():
    """The public path: Dynamo and AOTAutograd hand tilefuse the op itself (no decomposition
    exists for it); `explain` shows one flash kernel and no extern."""
    q, k, v = torch.randn(B, 2, L, E), torch.randn(B, 2, S, E), torch.randn(B, 2, S, E)

    def fn(q, k, v):
        return aten._scaled_dot_product_efficient_attention(q, k, v, None, False, is_causal=True)[0]

    torch._dynamo.reset()
    report = tilefuse.explain(fn, q, k, v)
    assert [kr.kind for kr in report.kernels] == ["flash"] and not report.externs, str(report)
    assert any("skipped" in n for n in report.kernels[0].notes)  # block skipping from the causal mask
    torch._dynamo.reset()
    out = torch.compile(fn, backend="tilefuse")(q, k, v)
    torch.testing.assert_close(out, math_attention(q, k, v, causal="top_left").float(), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- what stays an extern


def test_training_forward_that_saves_logsumexp_keeps_the_extern():
    """AOTAutograd's forward graph returns the logsumexp for the backward op: the lowering
    declines and the op stays an ATen extern."""
    from functorch.compile import aot_function, make_boxed_func
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def fn(q, k, v):
        return aten._scaled_dot_product_efficient_attention(q, k, v, None, True)[0]

    with FakeTensorMode() as mode:
        q, k, v = (mode.from_tensor(torch.randn(B, 2, n, E, requires_grad=True)) for n in (L, S, S))
        aot_function(fn, fw_compiler=keep_graph, bw_compiler=keep_graph)(q, k, v)
    _, report = compile_fx(graphs[0], torch.device("cpu"), "forward")
    assert "flash" not in [kr.kind for kr in report.kernels]
    [(_, target, reason)] = report.externs
    assert "efficient_attention" in target and "result 1 (log_sumexp)" in reason, reason


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "keep-mask"])
def test_cpu_logsumexp_is_lowered_as_aten_computes_it(masked):
    """The CPU op's logsumexp (what its backward op reads in a training step) is generated:
    max + log Σ exp of the scaled, masked scores, 0 for a row masked throughout."""
    q, k, v = torch.randn(B, 2, L, E), torch.randn(B, 2, S, E), torch.randn(B, 2, S, E)
    keep = masks(torch.float32)["keep"]  # row 3 masked throughout
    keep = torch.zeros(L, S).masked_fill(~keep, float("-inf"))  # the op takes a mask of q's dtype

    def fn(q, k, v, keep):
        if masked:
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=keep, scale=0.3)
        else:
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        return out * lse.unsqueeze(-1).exp(), lse

    compiled, report = compile_graph(fn, q, k, v, keep)
    assert report.externs == []
    got, want = compiled(q, k, v, keep), fn(q, k, v, keep)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    if masked:
        assert (got[1][:, :, 3] == 0).all()


def test_dropout_keeps_the_extern():
    q, k, v = torch.randn(B, 2, L, E), torch.randn(B, 2, S, E), torch.randn(B, 2, S, E)
    _, report = compile_graph(
        lambda q, k, v: aten._scaled_dot_product_efficient_attention(q, k, v, None, False, 0.1)[0], q, k, v)
    [(_, _, reason)] = report.externs
    assert "dropout_p=0.1" in reason


def _decline_reason(fn, *inputs, **extra):
    """Call the lowering on the traced op node directly; return why it declined."""
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem)
    ctx = LoweringContext(Graph("t"))
    ctx.current_node, ctx.current_target, ctx.current_meta = node, node.target, node.meta["val"]
    with pytest.raises(Unsupported) as why:
        fused_attention(ctx, *node.args, **{**node.kwargs, **extra})
    return str(why.value)


def test_flash_lowering_declines_when_logsumexp_is_returned():
    q, k, v = torch.randn(B, 2, L, E), torch.randn(B, 2, S, E), torch.randn(B, 2, S, E)
    reason = _decline_reason(lambda q, k, v: aten._scaled_dot_product_flash_attention(q, k, v)[:2], q, k, v)
    assert "result 1 (logsumexp)" in reason
    reason = _decline_reason(lambda q, k, v: aten._scaled_dot_product_flash_attention(q, k, v)[0], q, k, v,
                             window=3)
    assert "unexpected argument 'window'" in reason
