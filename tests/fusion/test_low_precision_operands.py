"""A bf16 transformer's attention keeps its products in bf16: RoPE'd q and k are stored in
bf16 (not as fp32 upcasts), PyTorch's √scale factors leave the product, both dots run on bf16
operands with fp32 accumulation, and the output's conversion to bf16 is stored by the flash
kernel itself. Results follow eager under the fp64 rule."""
import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.config import config
from backends_on_cpu import CPU_BACKENDS


def rotate(x, cos, sin):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rope_attention(q, k, v, cos, sin):
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _inputs(s=19, d=16):
    q, k, v = (torch.randn(1, 3, s, d).bfloat16() for _ in range(3))
    ang = torch.rand(s, d) * 6.28
    return q, k, v, ang.cos().bfloat16(), ang.sin().bfloat16()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_rope_attention_products_read_bf16(backend):
    args = _inputs()
    with config.patch(target=backend):
        torch._dynamo.reset()
        report = tilefuse.explain(rope_attention, *args)
        kinds = [k.kind for k in report.kernels]
        assert kinds == ["pointwise", "flash"], str(report)  # RoPE of q and of k: one kernel
        rope, flash = report.kernels
        graph = report.reports[0].graph_ir
        assert len(rope.nodes) == 2
        for name in rope.nodes:  # the rotated q and k are stored as the bf16 tensors eager has
            stored = [ln for ln in graph.splitlines() if ln.strip().startswith(f"{name}:")]
            assert stored and "bfloat16[" in stored[0], stored
        dots = [ln for ln in flash.tile_ir.splitlines() if "dot(" in ln]
        expected = "float32" if backend == "interpret" else "bfloat16"  # the interpreter's bf16 dot is broken
        # Q·Kᵀ and P·V, in each loop over key tiles (the causal mask's fully live tiles get their
        # own loop without the mask)
        assert dots and len(dots) % 2 == 0 and all(f"in {expected}" in ln for ln in dots), dots
        stores = {ln.split()[1].split("[")[0] for ln in flash.tile_ir.splitlines() if ln.strip().startswith("store ")}
        out_name = graph.strip().splitlines()[-1].split("(")[-1].rstrip(")")
        assert stores == {out_name}, (stores, out_name)  # the bf16 result only, not the fp32 sum

        torch._dynamo.reset()
        out = torch.compile(rope_attention, backend="tilefuse")(*args)
    ref = rope_attention(*(a.double() for a in args))
    eager = rope_attention(*args)
    assert out.dtype == torch.bfloat16
    err, eager_err = ((x.double() - ref).abs().max().item() for x in (out, eager))
    assert err <= 2 * eager_err + 1e-2 * (1 + ref.abs().max().item()), (err, eager_err)


def attention_projection(q, k, v, w):
    b, h, s, d = q.shape
    a = F.scaled_dot_product_attention(q, k, v)
    return F.linear(a.transpose(1, 2).reshape(b, s, h * d), w)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_attention_output_is_stored_in_bf16_by_the_flash_kernel(backend):
    q, k, v = (torch.randn(2, 3, 13, 8).bfloat16() for _ in range(3))
    w = (torch.randn(10, 24) / 5).bfloat16()
    with config.patch(target=backend):
        torch._dynamo.reset()
        report = tilefuse.explain(attention_projection, q, k, v, w)
        decisions = report.reports[0].decisions
        assert any("narrowing conversion of a kernel result" in d for d in decisions), str(report)
        (flash,) = [kr for kr in report.kernels if kr.kind == "flash"]
        stored = {ln.split()[1].split("[")[0] for ln in flash.tile_ir.splitlines() if ln.strip().startswith("store ")}
        graph = report.reports[0].graph_ir
        for name in stored:
            line = next(ln for ln in graph.splitlines() if ln.strip().startswith(f"{name}:"))
            assert "bfloat16[" in line, line
        torch._dynamo.reset()
        out = torch.compile(attention_projection, backend="tilefuse")(q, k, v, w)
    ref = attention_projection(q.double(), k.double(), v.double(), w.double())
    eager = attention_projection(q, k, v, w)
    err, eager_err = ((x.double() - ref).abs().max().item() for x in (out, eager))
    assert err <= 2 * eager_err + 1e-2 * (1 + ref.abs().max().item()), (err, eager_err)


@pytest.mark.parametrize("transposed", [False, True])
def test_a_narrowing_conversion_is_stored_by_its_producer_only_when_read_in_order(transposed):
    """bf16(r) of a reduction's fp32 result is realised (the reduction kernel's epilogue) when
    it reads r in r's own order; a transposing conversion stays inlined into its consumers
    (realising it would be a kernel of its own)."""
    from irgraphs import GraphBuilder
    from tilefuse.fusion.inline import Inliner
    from tilefuse.ir import dtypes as dt
    from tilefuse.ir.expr import cast

    g = GraphBuilder("g")
    x = g.input("x", (6, 5, 7), dt.bfloat16, strides="contiguous")
    w = g.input("w", (4, 6), dt.bfloat16, strides="contiguous")
    r = g.ctx.reduce((6, 5), (7,), "sum", lambda i, red: cast(x.load((i[0], i[1], red[0])), dt.float32), dt.float32)
    shape = (5, 6) if transposed else (6, 5)
    narrow = g.ctx.pointwise(shape, dt.bfloat16, lambda i: cast(r.load((i[1], i[0]) if transposed else i), dt.bfloat16))

    def matmul(i, red):  # out[a, b] = Σ_k narrow[k, b] w[a, k] (or narrow[b, k] transposed)
        idx = (i[1], red[0]) if transposed else (red[0], i[1])
        return cast(narrow.load(idx), dt.float32) * cast(w.load((i[0], red[0])), dt.float32)

    out = g.ctx.reduce((4, 5), (6,), "sum", matmul, dt.float32)
    graph = g.output(out)
    reasons = Inliner(graph).reasons
    assert (reasons.get(narrow.name, "").startswith("narrowing conversion")) == (not transposed), reasons


@pytest.mark.parametrize("source", ["row", "input", "extern", "pointwise"])
def test_a_rounded_operand_of_a_realised_tensor_is_stored_by_its_source(source):
    """bf16(x) of a realised fp32 `x` that two products read (autocast's rounding of a residual
    gradient before a layer's products) is stored by x's own kernel — here a norm's full-row
    output, joining the norm's row pass — and read by both products as it is; the rounding of
    an input, of an extern's result or of a pointwise kernel's output (which a stored
    conversion would not join: a kernel of its own) stays inlined into each product."""
    from irgraphs import GraphBuilder
    from tilefuse.fusion import plan_graph
    from tilefuse.fusion.inline import Inliner
    from tilefuse.ir import dtypes as dt
    from tilefuse.ir.expr import cast, unary

    g = GraphBuilder("g")
    a = g.input("a", (9, 13), dt.float32, strides="contiguous")
    w1 = g.input("w1", (13, 5), dt.bfloat16, strides="contiguous")
    w2 = g.input("w2", (13, 4), dt.bfloat16, strides="contiguous")
    if source == "row":
        ss = g.ctx.reduce((9,), (13,), "sum", lambda i, r: a.load((i[0], r[0])) * a.load((i[0], r[0])), dt.float32)
        x = g.ctx.pointwise((9, 13), dt.float32, lambda i: a.load(i) * unary("rsqrt", ss.load((i[0],)) + 1.0))
    elif source == "input":
        x = a
    elif source == "pointwise":
        x = g.ctx.pointwise((9, 13), dt.float32, lambda i: unary("tanh", a.load(i)) * 2.0 + a.load(i))
    else:
        from tilefuse.frontend.context import BufferValue
        from tilefuse.ir.graph import Extern, TensorArg

        g.graph.add(Extern("ext", dt.float32, (9, 13), target=torch.ops.aten.cumsum.default,
                           target_name="aten.cumsum.default", args=(TensorArg(a.name), 1)))
        x = BufferValue("ext", dt.float32, (9, 13))
    narrow = g.ctx.pointwise((9, 13), dt.bfloat16, lambda i: cast(x.load(i), dt.bfloat16))
    products = [g.ctx.reduce((9, n), (13,), "sum", lambda i, r, w=w: cast(narrow.load((i[0], r[0])), dt.float32)
                             * cast(w.load((r[0], i[1])), dt.float32), dt.float32) for w, n in ((w1, 5), (w2, 4))]
    graph = g.output(*products, *([x] if source in ("row", "pointwise") else []))
    inliner = Inliner(graph)
    stored = narrow.name not in inliner.inlined
    assert stored == (source == "row"), inliner.reasons
    if stored:
        assert inliner.reasons[narrow.name].startswith("rounded operand of a product"), inliner.reasons
        schedule = plan_graph(graph)
        norm = next(k for k in schedule.kernels if narrow.name in k.stores)
        assert x.name in norm.stores and ss.name in {s.node for s in norm.stages}, schedule.decisions


def rounded_residual_products(x, g, w1, w2, low=torch.bfloat16):
    """A norm's fp32 output (returned: realised) rounded to bf16 for two products (`low`: the
    dtype the products run in; the fp64 reference rounds and widens again)."""
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) + g
    hb = h.to(torch.bfloat16).to(low)
    return hb @ w1, hb @ w2, h


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("width,row_limit,dynamic", [(48, 8192, False), (300, 64, False), (45, 8192, True)])
def test_a_norms_rounded_output_is_stored_by_the_norm_for_its_products(backend, width, row_limit, dynamic):
    """End to end: the bf16 copy is a second store of the norm's kernel (no kernel of its own,
    no conversion per product), and every result follows eager under the fp64 rule — with the
    row held whole, looped over in tiles (the stores in the pass after the sum), and with
    symbolic sizes."""
    torch.manual_seed(0)
    args = (torch.randn(37, width), torch.randn(37, width), torch.randn(width, 20).bfloat16(),
            torch.randn(width, 11).bfloat16())
    with config.patch(target=backend, persistent_reduction_limit=row_limit):
        torch._dynamo.reset()
        report = tilefuse.explain(rounded_residual_products, *args, dynamic=dynamic)
        kinds = sorted(k.kind for k in report.kernels)  # (a product may run in the library)
        assert len(kinds) == 3 and kinds[-1] == "reduction", str(report)
        assert all(k in ("aten-matmul", "contraction") for k in kinds[:2]), str(report)
        norm = next(k for k in report.kernels if k.kind == "reduction")
        assert "to_copy" in norm.ops, str(report)
        torch._dynamo.reset()
        outs = torch.compile(rounded_residual_products, backend="tilefuse", dynamic=dynamic)(*args)
    refs = rounded_residual_products(*(a.double() for a in args), low=torch.float64)
    eagers = rounded_residual_products(*args)
    for out, ref, eager in zip(outs, refs, eagers):
        err, eager_err = ((t.double() - ref).abs().max().item() for t in (out, eager))
        assert out.dtype == eager.dtype
        assert err <= 2 * eager_err + 1e-4 * (1 + ref.abs().max().item()), (err, eager_err)


@pytest.mark.parametrize("saved", [False, True])
def test_a_costly_prologue_read_rounded_is_stored_rounded(saved):
    """A costly fp32 value (exp) whose one reader rounds it to bf16 for two products (autocast's
    gradient of the logits): the rounded value is what the producer's kernel stores — half the
    bytes — and the wide one is inlined into it; also when the rounded value is a graph output
    (the probabilities a training forward saves). Values follow the reference interpreter."""
    from irgraphs import GraphBuilder, run_compiled
    from tilefuse.fusion.inline import Inliner
    from tilefuse.ir import dtypes as dt
    from tilefuse.ir.expr import cast, unary
    from tilefuse.ir.interpret import interpret

    g = GraphBuilder("g")
    x = g.input("x", (9, 13), dt.bfloat16, strides="contiguous")
    w = g.input("w", (13, 5), dt.bfloat16, strides="contiguous")
    v = g.input("v", (9, 4), dt.bfloat16, strides="contiguous")
    wide = g.ctx.pointwise((9, 13), dt.float32, lambda i: unary("exp", cast(x.load(i), dt.float32)) * 0.5)
    narrow = g.ctx.pointwise((9, 13), dt.bfloat16, lambda i: cast(wide.load(i), dt.bfloat16))
    first = g.ctx.reduce((9, 5), (13,), "sum", lambda i, r: cast(narrow.load((i[0], r[0])), dt.float32)
                         * cast(w.load((r[0], i[1])), dt.float32), dt.float32)
    second = g.ctx.reduce((13, 4), (9,), "sum", lambda i, r: cast(narrow.load((r[0], i[0])), dt.float32)
                          * cast(v.load((r[0], i[1])), dt.float32), dt.float32)
    graph = g.output(first, second, *([narrow] if saved else []))
    inliner = Inliner(graph)
    assert wide.name in inliner.inlined and narrow.name not in inliner.inlined, inliner.reasons
    assert inliner.reasons[narrow.name].startswith("graph output" if saved else "narrowing conversion of a costly")
    args = [torch.randn(9, 13).bfloat16(), torch.randn(13, 5).bfloat16(), torch.randn(9, 4).bfloat16()]
    rounded = ((args[0].float().exp() * 0.5).bfloat16().float())
    want = [rounded @ args[1].float(), rounded.t() @ args[2].float()] + ([rounded] if saved else [])
    for got, ref in zip(interpret(graph, args), want):
        torch.testing.assert_close(got.float(), ref, rtol=1e-5, atol=1e-5)
    compiled, _ = run_compiled(graph, args)  # the kernels (Triton's interpreter) agree
    for got, ref in zip(compiled, want):
        torch.testing.assert_close(got.float(), ref, rtol=1e-4, atol=1e-4)


def nanogpt_attention(x, w, b, mask):
    """nanoGPT's attention: c_attn's bias add feeds both products; the tril buffer masks."""
    B, T, C = x.shape
    q, k, v = F.linear(x, w, b).split(C, dim=2)
    q, k, v = (t.view(B, T, 2, C // 2).transpose(1, 2) for t in (q, k, v))
    att = (q @ k.transpose(-2, -1)) * (1.0 / (k.size(-1) ** 0.5))
    att = att.masked_fill(mask[:, :, :T, :T] == 0, float("-inf"))
    y = torch.softmax(att, dim=-1) @ v
    return y.transpose(1, 2).contiguous().view(B, T, C)


def scaled_query_attention(q, k, v, s):
    """A cheap bf16 prologue (`q * s`) inlined into the score product."""
    return torch.softmax((q * s) @ k.transpose(-1, -2), -1) @ v


def gptfast_rope_attention(x, cos, sin, k, v, mask):
    """gpt-fast: RoPE computed in fp32 on (re, im) pairs, `type_as` back to bf16, then
    transposed into SDPA with a boolean mask (whose decomposition upcasts q, k and v)."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    out = torch.stack([xs[..., 0] * cos - xs[..., 1] * sin, xs[..., 1] * cos + xs[..., 0] * sin], -1)
    q = out.flatten(3).type_as(x).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def hf_gqa_attention(x, wq, wk, wv, mask):
    """Hugging Face Llama: q, k, v projected and transposed to heads, key and value repeated to
    the query heads (`repeat_kv`: expand and reshape), then SDPA with the model's boolean mask;
    the fused op's P·V reads V as it is."""
    b, s, _ = x.shape
    d = 16
    q, k, v = (F.linear(x, w).view(b, s, -1, d).transpose(1, 2) for w in (wq, wk, wv))
    kvh = k.shape[1]
    rep = q.shape[1] // kvh
    k = k[:, :, None].expand(b, kvh, rep, s, d).reshape(b, kvh * rep, s, d)
    v = v[:, :, None].expand(b, kvh, rep, s, d).reshape(b, kvh * rep, s, d)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _dots(report):
    return [(k.kind, ln.strip()) for k in report.kernels for ln in k.tile_ir.splitlines() if "dot(" in ln]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["nanogpt", "scaled_query", "gptfast", "hf_gqa"])
def test_prologue_keeps_the_operands_precision(case, dtype):
    """Whatever a product's prologue computes, the product reads the low-precision values eager
    gives it: every dot of the graph runs on bf16/fp16 operands, never fp32 (which on a GPU is
    an fp32 `ieee` dot without tensor cores)."""
    torch.manual_seed(0)
    if case == "nanogpt":
        fn = nanogpt_attention
        args = (torch.randn(2, 37, 32).to(dtype), (torch.randn(96, 32) * 0.2).to(dtype),
                torch.randn(96).to(dtype), torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64))
    elif case == "gptfast":
        fn = gptfast_rope_attention
        b, s, h, d = 2, 37, 2, 16
        ang = torch.rand(1, s, 1, d // 2) * 6
        args = (torch.randn(b, s, h, d).to(dtype), ang.cos(), ang.sin(), torch.randn(b, h, s, d).to(dtype),
                torch.randn(b, h, s, d).to(dtype), torch.ones(s, s, dtype=torch.bool).tril()[None, None])
    elif case == "hf_gqa":
        fn = hf_gqa_attention
        b, s, d = 2, 37, 16
        keep = torch.ones(s, s, dtype=torch.bool).tril()[None, None].expand(b, 1, s, s).clone()
        keep[1, :, :, :5] = False  # padding on the left of the second sequence
        args = (torch.randn(b, s, 32).to(dtype), (torch.randn(4 * d, 32) * 0.2).to(dtype),
                (torch.randn(2 * d, 32) * 0.2).to(dtype), (torch.randn(2 * d, 32) * 0.2).to(dtype), keep)
    else:
        fn = scaled_query_attention
        args = tuple(torch.randn(2, 3, 37, 16).to(dtype) for _ in range(3)) + \
            (torch.rand(1, 1, 1, 16).to(dtype) + 0.5,)
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    with config.patch(target="cpu"):
        torch._dynamo.reset()
        report = tilefuse.explain(fn, *args)
        dots = _dots(report)
        assert dots and all(f"in {name}" in ln for _, ln in dots), dots
        torch._dynamo.reset()
        out = torch.compile(fn, backend="tilefuse")(*args)
    if case == "nanogpt":  # the bias add is stored narrow by the first product (addmm), not recomputed per tile
        kinds = [k.kind for k in report.kernels if k.kind != "block-summary"]  # (the tril buffer's summary)
        assert kinds[:2] in (["contraction", "flash"], ["aten-matmul", "flash"]), str(report)
    ref = fn(*(a.double() if a.is_floating_point() else a for a in args))
    eager = fn(*args)
    err, eager_err = ((t.double() - ref).abs().max().item() for t in (out, eager))
    assert err <= 2 * eager_err + 1e-2 * (1 + ref.abs().max().item()), (err, eager_err)


def full_row_chain(a, links: int):
    """A norm's output, then `links` realised sums each reading the last at its own position
    and flipped (returned, so each is stored)."""
    x = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6)
    outs = [x]
    for _ in range(links):
        x = x + x.flip(-1) * 0.5
        outs.append(x)
    return outs


def test_a_chain_of_full_rows_is_not_recomputed_link_by_link():
    """A pointwise node joins a reduction's kernel through its full-row outputs only while that
    adds few operations: each link of this chain reads the last twice, and recomputed it would
    double the body per link (39 s to compile at 18 links, over five minutes at 22). Results
    follow eager."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from tilefuse.frontend.to_ir import lower_fx
    from tilefuse.fusion.inline import MAX_SHARED_OPS
    from tilefuse.fusion.planner import plan_graph
    from tilefuse.ir.expr import count_ops
    from tilefuse.passes import run_passes

    torch.manual_seed(0)
    a = torch.randn(13, 64)
    graph = run_passes(lower_fx(make_fx(lambda t: full_row_chain(t, 8))(a), "g"))
    limit = 4 * MAX_SHARED_OPS
    for plan in plan_graph(graph).kernels:
        for stage in plan.stages:
            assert count_ops(stage.body, limit) <= limit, (plan.name, stage.node)
    with config.patch(target="cpu"):
        torch._dynamo.reset()
        outs = torch.compile(full_row_chain, backend="tilefuse")(a, 8)
    for out, ref in zip(outs, full_row_chain(a.double(), 8)):
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
