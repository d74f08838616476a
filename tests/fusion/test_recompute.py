"""Products whose weights are a function of small products are computed with those products
recomputed tile by tile in registers (`fusion.recompute`): FlashAttention-2's backward from
its math, a fused two-layer MLP; checked against an fp64 reference on both backends."""
import math
import os

import pytest
import torch

import tilefuse

DEVICE = os.environ.get("TILEFUSE_TEST_DEVICE", "cpu")


def attention_backward(q, k, v, o, do, lse, keep):
    """The backward of softmax(q·kᵀ/√d masked) @ v from the forward's logsumexp, as
    `frontend.attention_chains` derives it; `keep` may be None (no mask)."""
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.exp(s.float() - lse)
    dv = p.to(q.dtype).transpose(-1, -2) @ do
    dp = do @ v.transpose(-1, -2)
    row = (do.float() * o.float()).sum(-1, keepdim=True)
    ds = (p * (dp.float() - row)).to(q.dtype)
    if keep is not None:
        ds = ds.masked_fill(~keep, 0)
    ds = ds * (1.0 / math.sqrt(q.shape[-1]))
    return ds @ k, ds.transpose(-1, -2) @ q, dv


def _attention_inputs(dtype, t=75, d=16, masked=True):
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, t, d, dtype=dtype, device=DEVICE) for _ in range(4))
    keep = torch.tril(torch.ones(t, t, dtype=torch.bool, device=DEVICE)) if masked else None
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(d)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1, keepdim=True).float()
    o = (torch.softmax(s, -1) @ v.double()).to(dtype)
    return q, k, v, o, do, lse, keep


def _close_to_fp64(fn, inputs, dtype):
    got = tilefuse.compile(fn)(*inputs)
    ref = fn(*(x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs))
    eager = fn(*inputs)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for g, r, e in zip(got, ref, eager):
        eager_err = (e.double() - r).abs().max().item()
        assert (g.double() - r).abs().max().item() <= 2 * eager_err + tol * max(1.0, r.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("masked", [True, False], ids=["tril-buffer", "no-mask"])
def test_attention_backward_is_products_over_recomputed_scores(dtype, masked):
    """dV = Pᵀ·dO, dQ = dS·K and dKᵀ = Qᵀ·dS become flash plans — dK and dV one kernel, which
    computes each score tile once for both; the kernels that would write S, dO·Vᵀ, P and dS
    (T×T each) are gone; a mask read from data is summarised per tile and its dead tiles
    skipped."""
    inputs = _attention_inputs(dtype, masked=masked)
    torch._dynamo.reset()
    report = tilefuse.explain(attention_backward, *inputs)
    kinds = [k.kind for k in report.kernels if k.kind != "block-summary"]
    assert sorted(kinds) == ["flash", "flash", "reduction"], str(report)  # (the reduction: rowsum(dO∘O))
    flash = [k for k in report.kernels if k.kind == "flash"]
    assert all(any("weights recomputed per tile" in n for n in k.notes) for k in flash)
    assert "one kernel with" in "\n".join(report.reports[0].decisions)
    both = [k for k in flash if sum("weights recomputed per tile" in n for n in k.notes) == 2]
    assert len(both) == 1, str(report)
    first_loop = both[0].tile_ir.split("for joffset")[1]
    assert first_loop.count("dot(") == 4, both[0].tile_ir  # Q·Kᵀ, dO·Vᵀ, Pᵀ·dO, dSᵀ·Q
    if masked:
        assert all(any("the rest are skipped" in n for n in k.notes) for k in flash), str(report)
    assert "dropped" in "\n".join(report.reports[0].decisions)
    torch._dynamo.reset()
    _close_to_fp64(attention_backward, inputs, dtype)


@pytest.mark.parametrize("d", [16, 20], ids=["d16", "d20-padded"])
def test_a_backward_product_reads_the_score_tile_transposed(d):
    """On Triton each operand is loaded once per key tile: the dK/dV kernel's `dSᵀ·Q` and
    `Pᵀ·dO` take the tiles its scores `K·Qᵀ` and `V·dOᵀ` loaded, transposed, and the dQ
    kernel's `dS·K` the Kᵀ of its scores (FlashAttention's `tl.trans`); the C++ backend
    loads them as before. Values against fp64, a padded head dim included."""
    inputs = _attention_inputs(torch.float32, t=37, d=d, masked=False)
    for target, transposes in (("interpret", {2, 1}), ("cpu", {0})):
        torch._dynamo.reset()
        report = tilefuse.explain(attention_backward, *inputs, options={"target": target, "fallback": "error"})
        flash = [k for k in report.kernels if k.kind == "flash"]
        assert {k.tile_ir.count("transpose(") for k in flash} == transposes, str(report)
        torch._dynamo.reset()
        got = tilefuse.compile(attention_backward, target=target, fallback="error")(*inputs)
        ref = attention_backward(*(x.double() if x is not None and x.is_floating_point() else x for x in inputs))
        for g, r in zip(got, ref):
            assert (g.double() - r).abs().max().item() <= 1e-5 * max(1.0, r.abs().max().item())


def test_an_index_mask_bounds_the_loops():
    """A causal mask written with positions skips by the loop bounds, with no pre-kernel:
    dQ's rows visit the keys up to the diagonal, dK's and dV's rows the queries from it."""
    def fn(q, k, v, o, do, lse):
        t = q.shape[-2]
        keep = torch.arange(t, device=q.device)[:, None] >= torch.arange(t, device=q.device)[None, :]
        return attention_backward(q, k, v, o, do, lse, keep)

    q, k, v, o, do, lse, _ = _attention_inputs(torch.float32, t=130)
    torch._dynamo.reset()
    report = tilefuse.explain(fn, q, k, v, o, do, lse)
    flash = [kern for kern in report.kernels if kern.kind == "flash"]
    assert len(flash) == 2 and not [kern for kern in report.kernels if kern.kind == "block-summary"]
    loops = [next(line for line in kern.tile_ir.splitlines() if "for joffset" in line) for kern in flash]
    assert sorted("range(0, 130," not in line for line in loops) == [True] * 2, loops
    assert all(any("skipped" in n for n in kern.notes) for kern in flash)
    torch._dynamo.reset()
    _close_to_fp64(fn, (q, k, v, o, do, lse), torch.float32)


def test_a_two_layer_mlp_with_a_small_input_is_one_kernel():
    """Not only attention: `gelu(x·W1)·W2` with a narrow x holds no hidden activation."""
    def mlp(x, w1, w2):
        return torch.nn.functional.gelu(x @ w1) @ w2

    torch.manual_seed(0)
    x, w1, w2 = torch.randn(300, 24, device=DEVICE), torch.randn(24, 200, device=DEVICE), torch.randn(200, 40, device=DEVICE)
    torch._dynamo.reset()
    report = tilefuse.explain(mlp, x, w1, w2)
    assert [k.kind for k in report.kernels] == ["flash"], str(report)
    torch._dynamo.reset()
    got = tilefuse.compile(mlp)(x, w1, w2)
    torch.testing.assert_close(got, mlp(x, w1, w2), atol=1e-4, rtol=1e-4)


def test_scores_needed_elsewhere_are_not_recomputed():
    """When the small product is stored anyway (also returned), recomputing it would only
    add work: the plans stay as they were."""
    def fn(x, w1, w2):
        h = x @ w1
        return torch.relu(h) @ w2, h

    torch.manual_seed(0)
    x, w1, w2 = torch.randn(64, 16, device=DEVICE), torch.randn(16, 80, device=DEVICE), torch.randn(80, 8, device=DEVICE)
    torch._dynamo.reset()
    report = tilefuse.explain(fn, x, w1, w2)
    assert "flash" not in [k.kind for k in report.kernels], str(report)
    torch._dynamo.reset()
    for g, w in zip(tilefuse.compile(fn)(x, w1, w2), fn(x, w1, w2)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_plans_are_not_merged_when_one_reads_the_other_through_its_score_factors():
    """Two products over the same score tiles, where the second's other score product reads
    the first's output through an elementwise chain inlined into its factor: one kernel would
    load that output before storing it, so they stay two kernels (and match fp64)."""
    def fn(x, y, v1, z, v2):
        p1 = torch.exp(x @ y.T - 2.0)
        out1 = p1 @ v1
        s2 = (torch.relu(out1 + 1.0) * 2.0) @ z.T
        return out1, (p1 * s2) @ v2

    torch.manual_seed(0)
    args = (torch.randn(64, 16, device=DEVICE) * 0.3, torch.randn(300, 16, device=DEVICE) * 0.3,
            torch.randn(300, 16, device=DEVICE), torch.randn(300, 16, device=DEVICE) * 0.3,
            torch.randn(300, 16, device=DEVICE))
    torch._dynamo.reset()
    report = tilefuse.explain(fn, *args)
    assert "one kernel with" not in "\n".join(report.reports[0].decisions), str(report)
    torch._dynamo.reset()
    _close_to_fp64(fn, args, torch.float32)


def test_deep_chains_read_twice_are_counted_without_walking_them_as_trees():
    """A chain of pointwise nodes each reading the one before twice (a residual stream's
    gradient) is a tree of 2^60 nodes once its producers are substituted, and a DAG of a few
    hundred: the recompute pass expands it as the DAG, and every walk over it that needs a set
    or a bound visits shared nodes once or stops early (a ResMLP training step spent minutes
    counting such a tree)."""
    from irgraphs import GraphBuilder

    from tilefuse.fusion.recompute import _expand, _scores_in
    from tilefuse.ir import dtypes as dt
    from tilefuse.ir.expr import count_ops, free_symbols, walk_unique

    g = GraphBuilder()
    v = g.input("x", (5,))
    for k in range(60):
        prev = v
        v = g.ctx.pointwise((5,), dt.float32, lambda i, p=prev, k=k: p.load(i) * p.load(i) + float(k))
    whole = _expand(g.graph[v.name].body, g.graph)
    assert count_ops(whole, limit=1000) == 1001
    nodes = list(walk_unique(whole))
    assert len(nodes) < 60 * 8
    assert sum(1 for n in nodes if type(n).__name__ == "Binary") == 120  # each link's mul and add, once
    assert free_symbols(whole) and _scores_in(whole, g.graph) == set()
    second = _expand(g.graph.nodes[list(g.graph.nodes)[2]].body, g.graph)  # (x*x+0)*(x*x+0)+1
    assert count_ops(second) == 6 and count_ops(second, limit=3) == 4


@pytest.mark.parametrize("rows, threads, fused", [(8, 2, False), (8, 1, True), (40, 2, True), (40, 4, False)])
def test_a_cpu_product_too_few_rows_for_the_threads_stays_unfused(rows, threads, fused):
    """On a CPU a flash kernel's programs are its blocks of rows (16 at least): with fewer
    blocks than threads, the three products of a SwiGLU unfused spread over their columns too
    (8 rows on 2 threads: 1.7× faster), and the plan says why."""
    import torch.nn.functional as F

    def swiglu(x, a, b, c):
        return F.linear(F.silu(F.linear(x, a)) * F.linear(x, b), c)

    torch.manual_seed(0)
    x, a, b, c = (torch.randn(*s) / 8 for s in ((rows, 48), (72, 48), (72, 48), (40, 72)))
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch._dynamo.reset()
        report = tilefuse.explain(swiglu, x, a, b, c, options={"target": "cpu"})
        torch._dynamo.reset()
        got = tilefuse.compile(swiglu, target="cpu")(x, a, b, c)
    finally:
        torch.set_num_threads(saved)
        torch._dynamo.reset()
    assert ("flash" in [k.kind for k in report.kernels]) == fused, str(report)
    said = [d for d in report.reports[0].decisions if "block(s) of rows" in d]
    assert bool(said) == (not fused), said
    if fused and threads > 1:  # (and its rows split so that each thread has a block)
        (kernel,) = report.kernels
        assert "BLOCK_M=32" in str(kernel.tile), kernel.tile
    ref = swiglu(*(t.double() for t in (x, a, b, c)))
    assert (got.double() - ref).abs().max().item() < 1e-4
