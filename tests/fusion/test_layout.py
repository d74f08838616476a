"""Storage order of intermediate buffers: multi-head attention's output is stored (s, h, d) per
sequence so that the output projection reads a plain matrix; results match eager under the
fp64 rule on the C++ backend and the Triton interpreter; buffers that ATen calls read stay
row-major."""
import pytest
import sympy
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.config import config
from tilefuse.fusion.layout import strides_for
from backends_on_cpu import CPU_BACKENDS


def test_strides_for_orders():
    assert strides_for((2, 3, 5, 7), (0, 1, 2, 3)) == (105, 35, 7, 1)
    assert strides_for((2, 3, 5, 7), (0, 2, 1, 3)) == (105, 7, 21, 1)
    s = sympy.Symbol("s0", positive=True, integer=True)
    assert strides_for((2, 3, s, 7), (0, 2, 1, 3)) == (21 * s, 7, 21, 1)


def mha_projection(q, k, v, w):
    b, h, s, d = q.shape
    a = torch.softmax(q @ k.transpose(-1, -2) / d ** 0.5, -1) @ v
    return F.linear(a.transpose(1, 2).reshape(b, s, h * d), w)


def mha_projection_and_extern(q, k, v, w):
    b, h, s, d = q.shape
    a = torch.softmax(q @ k.transpose(-1, -2) / d ** 0.5, -1) @ v
    flat = a.transpose(1, 2).reshape(b, s, h * d)
    return F.linear(flat, w), torch.cumsum(a, -1)  # cumsum is an ATen call reading `a` itself


def _inputs(dtype, b=2, h=3, s=11, d=6):
    q, k, v = (torch.randn(b, h, s, d).to(dtype) for _ in range(3))
    w = (torch.randn(5, h * d) / (h * d) ** 0.5).to(dtype)
    return q, k, v, w


def _check(fn, args, dtype):
    torch._dynamo.reset()
    out = torch.compile(fn, backend="tilefuse")(*args)
    ref = fn(*(a.double() for a in args))
    eager = fn(*args)
    outs, refs, eagers = ((x,) if isinstance(x, torch.Tensor) else x for x in (out, ref, eager))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for o, r, e in zip(outs, refs, eagers):
        assert o.shape == e.shape and o.dtype == e.dtype
        err, eager_err = ((x.double() - r).abs().max().item() for x in (o, e))
        assert err <= 2 * eager_err + tol * (1 + r.abs().max().item()), (err, eager_err)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_output_is_stored_for_its_projection(backend, dtype, batch):
    """With one sequence the projection reads the attention output without any index
    division; with several, the division of its row index into (batch, position) remains
    (a per-row cost), the columns are affine."""
    args = _inputs(dtype, b=batch)
    with config.patch(target=backend):
        torch._dynamo.reset()
        report = tilefuse.explain(mha_projection, *args)
        decisions = [d for r in report.reports for d in r.decisions if "order" in d]
        assert len(decisions) == 1, str(report)
        assert ("with 0 index divisions" in decisions[0]) == (batch == 1), decisions
        _check(mha_projection, args, dtype)


def _divided_reads(with_extern: bool):
    """y[3, 5, 4] = Σ_r x[r, ...], read by a contraction as y[⌊k/4⌋, m, k mod 4] (and by an ATen
    call when `with_extern`)."""
    from irgraphs import GraphBuilder
    from tilefuse.ir import dtypes as dt
    from tilefuse.ir.expr import Index
    from tilefuse.ir.graph import Extern, TensorArg

    g = GraphBuilder("g")
    x = g.input("x", (2, 3, 5, 4), strides="contiguous")
    w = g.input("w", (7, 12), strides="contiguous")
    y = g.ctx.reduce((3, 5, 4), (2,), "sum", lambda i, r: x.load((r[0], i[0], i[1], i[2])), dt.float32)
    def body(i, r):
        k = r[0].expr
        return y.load((Index(sympy.floor(k / 4)), i[0], Index(sympy.Mod(k, 4)))) * w.load((i[1], r[0]))

    z = g.ctx.reduce((5, 7), (12,), "sum", body, dt.float32)
    outs = [z]
    if with_extern:
        ext = Extern("ext", dt.float32, (3, 5, 4), target=torch.ops.aten.cumsum.default,
                     target_name="aten.cumsum.default", args=(TensorArg(y.name), -1))
        g.graph.add(ext)
        outs.append(ext)
    graph = g.graph
    graph.outputs = [v.name for v in outs]
    return graph, y.name


@pytest.mark.parametrize("with_extern", [False, True])
def test_buffers_read_by_aten_calls_stay_row_major(with_extern):
    from tilefuse.fusion import plan_graph
    from tilefuse.fusion.layout import assign_layouts

    graph, y = _divided_reads(with_extern)
    schedule = plan_graph(graph)
    assign_layouts(graph, schedule)
    assert (y in graph.output_strides) == (not with_extern)
    if not with_extern:
        assert graph.output_strides[y] == strides_for((3, 5, 4), (1, 0, 2))


def test_attention_output_also_read_by_an_aten_call():
    args = _inputs(torch.float32, s=9, d=4)
    with config.patch(target="cpu"):
        _check(mha_projection_and_extern, args, torch.float32)


def test_layout_with_symbolic_sequence_length():
    with config.patch(target="cpu"):
        torch._dynamo.reset()
        fn = torch.compile(mha_projection, backend="tilefuse", dynamic=True)
        for s in (7, 12):
            args = _inputs(torch.float32, s=s)
            out = fn(*args)
            ref = mha_projection(*(a.double() for a in args))
            assert (out.double() - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_flash_product_read_along_its_columns_is_stored_that_way(backend):
    """The attention backward's dKᵀ = Qᵀ·dS is [batch, d, keys] but computed as [keys, d]
    tiles; the qkv gradient's `cat` reads it along d. It is stored with d innermost — the
    flash kernel's tile columns — so the cat reads it at unit stride instead of a stride of
    the key count."""
    import math

    def grads(q, k, v, do, lse, row, keep):  # (as `frontend.attention_chains` writes the backward)
        s = (q @ k.transpose(-1, -2)).masked_fill(~keep, float("-inf")) * (1.0 / math.sqrt(q.shape[-1]))
        p = torch.exp(s - lse)
        ds = p * (do @ v.transpose(-1, -2) - row)
        dkt = q.transpose(-1, -2) @ ds  # [b, h, d, t]
        dq = ds @ k
        return torch.cat([dq, dkt.transpose(-1, -2)], dim=-1).transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)

    torch.manual_seed(0)
    b, h, t, d = 2, 3, 45, 16
    q, k, v, do = (torch.randn(b, h, t, d) for _ in range(4))
    lse, row = torch.randn(b, h, t, 1) + 3.0, torch.randn(b, h, t, 1)
    keep = torch.rand(t, t) > 0.3
    keep |= torch.eye(t, dtype=torch.bool)
    args = (q, k, v, do, lse, row, keep)
    with config.patch(target=backend):
        torch._dynamo.reset()
        report = tilefuse.explain(grads, *args)
        decisions = [dec for r in report.reports for dec in r.decisions if "strided reads instead of" in dec]
        assert decisions, "\n".join(d for r in report.reports for d in r.decisions)
        torch._dynamo.reset()
        out = torch.compile(grads, backend="tilefuse")(*args)
    ref = grads(*(a.double() if a.is_floating_point() else a for a in args))
    eager_err = (grads(*args).double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * eager_err + 1e-5 * (1 + ref.abs().max().item())
