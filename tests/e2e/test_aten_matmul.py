"""Plain matrix products (nothing fused into them) can run through ATen's matmul on views of
their buffers: chosen by measurement when tuning on a GPU, or forced with TILEFUSE_MATMUL=aten.
Products with something fused keep the generated kernel."""
import os

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from irgraphs import GraphBuilder
from tilefuse.fusion import plan_graph
from tilefuse.tile.lower import LoweringOptions, schedule_space
from tilefuse.tile.target import Target

DEVICE = os.environ.get("TILEFUSE_TEST_DEVICE", "cpu")


def _kinds(fn, *args, **kw):
    torch._dynamo.reset()
    return [k.kind for k in tilefuse.explain(fn, *args, options={"matmul": "aten"}, **kw).kernels]


def _check(fn, *args, dynamic=False):
    torch._dynamo.reset()
    with tilefuse.config.patch(matmul="aten"):
        out = torch.compile(fn, backend="tilefuse", dynamic=dynamic)(*args)
    torch.testing.assert_close(out, fn(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,fn,shapes", [
    ("mm", lambda a, b: a @ b, [(37, 20), (20, 45)]),
    ("transposed", lambda a, b: a @ b.T, [(37, 20), (45, 20)]),
    ("linear", lambda a, b: F.linear(a, b), [(37, 20), (45, 20)]),
    ("bmm", lambda a, b: torch.bmm(a, b), [(3, 17, 9), (3, 9, 11)]),
    ("sliced operands", lambda a, b: a[:, 3:30:2] @ b[1:], [(37, 60), (15, 45)]),
    ("vector", lambda a, b: a @ b, [(1, 20), (20, 33)]),
])
def test_plain_products_run_through_aten_and_match(name, fn, shapes):
    args = [torch.randn(s, device=DEVICE) for s in shapes]
    assert _kinds(fn, *args) == ["aten-matmul"]
    _check(fn, *args)


def test_symbolic_sizes_and_bf16():
    a, b = torch.randn(30, 16, device=DEVICE), torch.randn(16, 24, device=DEVICE)
    fn = lambda a, b: a @ b  # noqa: E731
    torch._dynamo.reset()
    with tilefuse.config.patch(matmul="aten"):
        compiled = torch.compile(fn, backend="tilefuse", dynamic=True)
        for m in (30, 7, 55):
            x = torch.randn(m, 16, device=DEVICE)
            torch.testing.assert_close(compiled(x, b), fn(x, b))
    a, b = (t.to(torch.bfloat16) for t in (a, b))
    _check(fn, a, b)


def test_flattened_batch_views_run_through_aten():
    """F.linear on a 3-D input reads it through a flattened view (floor/mod indices): with the
    buffer's compile-time strides that is still one affine offset, so ATen runs it."""
    a, b = torch.randn(5, 37, 20, device=DEVICE), torch.randn(45, 20, device=DEVICE)
    assert _kinds(lambda a, b: F.linear(a, b), a, b) == ["aten-matmul"]
    _check(lambda a, b: F.linear(a, b), a, b)
    _check(lambda a, b: F.linear(a, b), a, b, dynamic=True)
    a, b = torch.randn(2, 3, 17, 9, device=DEVICE), torch.randn(9, 11, device=DEVICE)
    _check(lambda a, b: a @ b, a, b)
    # a batch that cannot be flattened (transposed input): the generated kernel, still right
    a = torch.randn(37, 5, 20, device=DEVICE).transpose(0, 1)
    _check(lambda a, b: F.linear(a, b), a, torch.randn(45, 20, device=DEVICE))


def test_products_with_something_fused_keep_the_generated_kernel():
    a, b, bias = torch.randn(37, 20, device=DEVICE), torch.randn(20, 45, device=DEVICE), torch.randn(45, device=DEVICE)
    # (a GPU runs the product in the library and the rest as a pointwise kernel: test_epilogue_split)
    want = ["aten-matmul", "pointwise"] if DEVICE == "cuda" else ["contraction"]
    assert _kinds(lambda a, b, c: F.gelu(a @ b + c), a, b, bias) == want
    assert _kinds(lambda a, b: (a + 2) @ b, a, b) != ["aten-matmul"]  # a prologue: not a plain view


def test_contraction_space_offers_aten_once_for_plain_products():
    g = GraphBuilder("mm")
    graph = g.output(g.bf16_product(512, 256, 384))
    (plan,) = plan_graph(graph).kernels
    space = schedule_space(graph, plan, LoweringOptions(target=Target.gpu(sm_count=132)))
    configs = space.schedules()
    assert space.default["impl"] == "generated"
    assert sum(c["impl"] == "aten" for c in configs) == 1
    none = schedule_space(graph, plan, LoweringOptions(target=Target.gpu(sm_count=132), matmul="generated"))
    assert "impl" not in none.knobs


def _fp64_close(fn, args, out, slack=2.0):
    """`out` is as close to the fp64 result as eager's own result is, within `slack`."""
    ref = fn(*[t.double() for t in args])
    eager_err = (fn(*args).double() - ref).abs().max().item()
    err = (out.double() - ref).abs().max().item()
    assert err <= slack * eager_err + 1e-5 * ref.abs().max().item(), (err, eager_err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,fn,shapes", [
    ("addmm", lambda x, w, b: torch.addmm(b, x, w), [(37, 20), (20, 45), (45,)]),
    ("linear 3-D", lambda x, w, b: F.linear(x, w, b), [(3, 13, 20), (45, 20), (45,)]),
    ("sliced bias", lambda x, w, b: F.linear(x, w, b[7:52]), [(37, 20), (45, 20), (60,)]),
    ("transposed input", lambda x, w, b: F.linear(x.T, w, b), [(20, 37), (45, 20), (45,)]),
])
def test_a_bias_added_to_every_row_is_folded_into_addmm(dtype, name, fn, shapes):
    """`addmm`'s decomposition (product, then a bias per column, one rounding) is one library
    call with the bias in it."""
    if dtype == torch.bfloat16 and DEVICE == "cpu" and name == "transposed input":
        pytest.skip("covered in fp32")
    args = [torch.randn(s, device=DEVICE).to(dtype) for s in shapes]
    torch._dynamo.reset()
    ex = tilefuse.explain(fn, *args, options={"matmul": "aten"})
    assert [k.kind for k in ex.kernels] == ["aten-matmul"], ex
    assert "torch.addmm(" in ex.kernels[0].notes[-1]
    torch._dynamo.reset()
    out = tilefuse.compile(fn, options={"matmul": "aten"})(*args)
    _fp64_close(fn, args, out)


def test_a_bias_per_row_is_not_addmm():
    a, b, c = torch.randn(37, 20, device=DEVICE), torch.randn(20, 45, device=DEVICE), torch.randn(37, device=DEVICE)
    fn = lambda a, b, c: a @ b + c[:, None]  # noqa: E731
    torch._dynamo.reset()
    ex = tilefuse.explain(fn, a, b, c, options={"matmul": "aten"})
    assert not any("torch.addmm(" in str(n) for k in ex.kernels for n in k.notes), ex
    _check(fn, a, b, c)


def test_operands_at_moving_offsets_and_strides():
    """The library call remembers each buffer layout's view: inputs that are views at another
    offset, or with other strides, on each call still read their own elements."""
    big, w, b = torch.randn(200, 20, device=DEVICE), torch.randn(45, 20, device=DEVICE), torch.randn(45, device=DEVICE)
    fn = lambda x, w, b: F.linear(x, w, b)  # noqa: E731
    torch._dynamo.reset()
    compiled = tilefuse.compile(fn, options={"matmul": "aten"})
    for k in list(range(0, 160, 7)) + [3, 3, 0]:
        x = big[k:k + 37]
        torch.testing.assert_close(compiled(x, w, b), fn(x, w, b), atol=1e-5, rtol=1e-5)
    wt = torch.randn(20, 45, device=DEVICE).T  # the same weight shape, transposed storage
    torch.testing.assert_close(compiled(big[:37], wt, b), fn(big[:37], wt, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,fn,shapes", [
    ("scaled input", lambda x, w: F.linear(x * 0.0883883, w), [(3, 13, 20), (45, 20)]),
    ("scaled product", lambda a, b: (a @ b) / 3.0, [(37, 20), (20, 45)]),
])
def test_a_constant_scale_of_the_product_is_the_librarys_alpha(name, fn, shapes):
    """A product multiplied by a constant before its rounding (a scaled operand whose scale
    `passes.scales` moves past the sum, as T5's tied head has it) is one library call with that
    alpha; a batched one stays generated. Against fp64."""
    args = [torch.randn(s, device=DEVICE) for s in shapes]
    torch._dynamo.reset()
    ex = tilefuse.explain(fn, *args, options={"matmul": "aten"})
    assert [k.kind for k in ex.kernels] == ["aten-matmul"], ex
    assert "beta=0, alpha=" in ex.kernels[0].notes[-1], ex.kernels[0].notes
    torch._dynamo.reset()
    out = tilefuse.compile(fn, options={"matmul": "aten"})(*args)
    _fp64_close(fn, args, out)
    a, b = torch.randn(3, 17, 9, device=DEVICE), torch.randn(3, 9, 11, device=DEVICE)
    bmm = lambda a, b: torch.bmm(a, b) * 0.5  # noqa: E731
    torch._dynamo.reset()
    assert not any("alpha=" in n for k in tilefuse.explain(bmm, a, b, options={"matmul": "aten"}).kernels
                   for n in k.notes)
    _check(bmm, a, b)


@pytest.mark.parametrize("name,fn,shapes", [
    ("mm", lambda a, b: a @ b, [(37, 20), (20, 45)]),
    ("transposed", lambda a, b: a @ b.T, [(37, 20), (45, 20)]),
    ("linear 3-D", lambda x, w: F.linear(x, w), [(3, 13, 20), (45, 20)]),
    ("bmm", lambda a, b: torch.bmm(a, b), [(3, 17, 9), (3, 9, 11)]),
    ("sliced operands", lambda a, b: a[:, 3:30:2] @ b[1:], [(37, 60), (15, 45)]),
    ("addmm 3-D", lambda x, w, b: F.linear(x, w, b[7:52]), [(3, 13, 20), (45, 20), (60,)]),
    ("transposed input", lambda x, w, b: F.linear(x.T, w, b), [(20, 37), (45, 20), (45,)]),
    ("alpha", lambda a, b: (a @ b) / 3.0, [(37, 20), (20, 45)]),
    ("permuted output", lambda a, b: (a @ b).T + 0, [(37, 20), (20, 45)]),
])
def test_the_generated_call_runs_products_on_views_made_once(name, fn, shapes, monkeypatch):
    """From the third call of a set of sizes the generated call runs each product with its
    views' layouts worked out once (`_Direct`): fresh random inputs every call, against fp64;
    inputs at another offset (a slice of a larger tensor) still read their own elements."""
    from tilefuse.runtime import aten_matmul

    direct = []
    call = aten_matmul._Direct.__call__
    monkeypatch.setattr(aten_matmul._Direct, "__call__", lambda self, *t: (direct.append(1), call(self, *t))[1])
    torch._dynamo.reset()
    compiled = tilefuse.compile(fn, options={"matmul": "aten"})
    gen = torch.Generator().manual_seed(len(name))
    for k in range(5):
        args = [torch.randn(s, generator=gen).to(DEVICE) for s in shapes]
        if k == 4:  # the same strides at another storage offset
            args = [torch.randn(t.numel() + 5, generator=gen).to(DEVICE)[5:].view(t.shape).copy_(t) for t in args]
        _fp64_close(fn, args, compiled(*args))
    if DEVICE == "cpu":
        assert direct, "the generated call made its views per call"


_FLIPPED = [
    # (found by the fuzzer: the reversed operand was handed to `as_strided` with a stride of -1)
    ("softmax times a flipped copy", lambda x: torch.softmax(x * 0.5, -1) @ x.flip(-1), [(7, 7)]),
    ("flipped rows", lambda a, b: a.flip(0) @ b, [(13, 9), (9, 11)]),
    ("flipped both ways", lambda a, b: a @ b.flip(0, 1), [(13, 9), (9, 11)]),
]


def _check_calls(fn, args, dynamic):
    """Three calls (the general call, then the generated one) against eager in fp64."""
    torch._dynamo.reset()
    with tilefuse.config.patch(fallback="error", matmul="aten"):
        compiled = torch.compile(fn, backend="tilefuse", dynamic=dynamic)
        outs = [compiled(*args) for _ in range(3)]
    want = fn(*[a.double() for a in args])
    for out in outs:
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("name,fn,shapes", _FLIPPED)
def test_a_flipped_operand_is_read_backwards_not_viewed(name, fn, shapes, dynamic):
    """A `flip` reads its buffer backwards: no strided view has that, so the planner keeps such
    an operand out of the library's views, and the product matches eager in fp64."""
    args = [torch.randn(s, device=DEVICE) for s in shapes]
    kinds = _kinds(fn, *args)
    assert "aten-matmul" not in kinds and "contraction" in [str(k.value) for k in kinds]
    _check_calls(fn, args, dynamic)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("name,fn,shapes", _FLIPPED)
def test_a_reversed_view_reaching_the_library_runs_as_a_flipped_copy(name, fn, shapes, dynamic, monkeypatch):
    """Should the planner let a reversed operand through (a coefficient it could not sign), the
    library reads a flipped copy of it, on the general call and the generated one alike."""
    from tilefuse.fusion import matmul_views

    monkeypatch.setattr(matmul_views, "_forwards", lambda coefs: True)
    args = [torch.randn(s, device=DEVICE) for s in shapes]
    assert "aten-matmul" in _kinds(fn, *args)
    _check_calls(fn, args, dynamic)


def test_an_operand_of_negative_strides_is_a_flipped_copy():
    """Should a layout with a negative stride reach the library's operand at run time, the
    operand is the view with those dims forwards, flipped (a copy), not `as_strided`'s error;
    the generated call's in-place product refuses such an operand (it is not a view)."""
    from tilefuse.runtime.aten_matmul import _reversed_view, _shares_memory

    t = torch.randn(60, dtype=torch.float64)
    grid = t[4:39].view(5, 7)
    got = _reversed_view(t, (5, 7), (7, -1), 4 + 6)  # rows forwards, columns backwards
    assert torch.equal(got, grid.flip(1)) and not _shares_memory(got, t)
    got = _reversed_view(t, (5, 7), (-7, -1), 4 + 34)  # both backwards
    assert torch.equal(got, grid.flip(0, 1))
    got = _reversed_view(t, (7, 5), (-1, 7), 4 + 6)  # transposed, one dim backwards
    assert torch.equal(got, grid.T.flip(0))
