"""Outputs that are views are compiled as their bases and made after the call: no kernel copies
what a view gives for free (a training forward returns the transposed activations and weights
its backward multiplies by), and the views follow the base's layout at run time."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tilefuse
from tilefuse import output_views

VIEW_ONLY_OPS = {"t", "transpose", "permute", "view", "unsafe_view", "alias", "expand", "unsqueeze", "squeeze"}


def _traced(fn, *args):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake")(*args)


def test_a_view_of_an_intermediate_is_made_from_it():
    def fn(x):
        y = x * 2
        return y.permute(1, 0).unsqueeze(0), y.sum()

    x = torch.randn(5, 7)
    gm = _traced(fn, x)
    (view,) = output_views.find(gm, 0)
    assert view.index == 0 and view.kind == "output" and view.base_node is not None
    assert [op.__name__.split(".")[0] for op, _ in view.replay] == ["permute", "unsqueeze"]
    compiled = output_views.compiled_as_bases(gm, [view])
    base, total = compiled(x)
    assert base.shape == (5, 7)  # the intermediate itself, not a copy of its view
    # the base as the compiled graph may lay it out (rows padded to 8): the view follows it
    padded = torch.empty(5, 8)[:, :7]
    padded.copy_(base)

    out = output_views.rebuild([view], _Compiled(), [x], [padded, total])
    torch.testing.assert_close(out[0], (x * 2).permute(1, 0).unsqueeze(0))
    assert out[0].data_ptr() == padded.data_ptr()
    assert out[0].stride() == padded.permute(1, 0).unsqueeze(0).stride()


def test_a_replayed_view_is_made_by_strides_once_its_base_layout_is_known():
    """A `Rebuilder` replays a view's ops once per layout of its base, then makes it by strides:
    the same view (values, storage, strides) every call, and replayed again for a base laid
    out otherwise."""
    def fn(x):
        y = x * 2
        return y.permute(1, 0).unsqueeze(0), y.sum()

    gen = torch.Generator().manual_seed(31)
    x = torch.randn(5, 7, generator=gen)
    gm = _traced(fn, x)
    (view,) = output_views.find(gm, 0)
    compiled = output_views.compiled_as_bases(gm, [view])
    rebuilder = output_views.Rebuilder([view])
    for k in range(3):
        x = torch.randn(5, 7, generator=gen)
        base, total = compiled(x)
        out = rebuilder(_Compiled(), [x], [base, total])
        torch.testing.assert_close(out[0], (x * 2).permute(1, 0).unsqueeze(0))
        assert out[0].data_ptr() == base.data_ptr() and out[0].stride() == base.permute(1, 0).unsqueeze(0).stride()
        assert rebuilder.replays  # (known after the first call)
    padded = torch.empty(5, 8)[:, :7]
    padded.copy_(base)
    out = rebuilder(_Compiled(), [x], [padded, total])
    torch.testing.assert_close(out[0], (x * 2).permute(1, 0).unsqueeze(0))
    assert out[0].stride() == padded.permute(1, 0).unsqueeze(0).stride()


def test_saved_views_of_private_storage_are_tensors_of_their_own():
    """From `private_from` on (a forward's saved tensors), a view of an intermediate value is made
    as a tensor of its own over the storage (no view, nothing to detach), with the view's
    values, strides and storage; a view of an input, and a view of an output the caller sees,
    stay views (their version counters are shared with what they view)."""
    def fn(x):
        y = x * 2
        return y.sum(), y.permute(1, 0), x.t()

    def shown(x):
        y = x * 2
        return y, y.permute(1, 0)

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 7, generator=gen)
    gm = _traced(fn, x)
    views = output_views.find(gm, 1)
    assert {v.index for v in views} == {1, 2}
    compiled = output_views.compiled_as_bases(gm, views)
    for private_from, private in [(1, True), (None, False), (2, False)]:
        out = output_views.Rebuilder(views, private_from)(_Compiled(), [x], list(compiled(x)))
        torch.testing.assert_close(out[1], (x * 2).permute(1, 0))
        assert out[1].stride() == (1, 7) and out[1]._is_view() != private
        assert out[2]._is_view() and out[2]._base is x  # an input's view, always a view
    gm = _traced(shown, x)
    views = output_views.find(gm, 1)
    out = output_views.Rebuilder(views, 1)(_Compiled(), [x], list(output_views.compiled_as_bases(gm, views)(x)))
    torch.testing.assert_close(out[1], (x * 2).permute(1, 0))
    assert out[1]._is_view() and out[1]._base is out[0]


def test_a_weight_written_before_the_backward_is_still_caught():
    """The transposed weight a forward saves is a view of the parameter, sharing its version
    counter: writing the weight in place before the backward raises, as in eager."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 6))
    x = torch.randn(9, 12)
    torch._dynamo.reset()
    compiled = tilefuse.compile(model, target="cpu")
    for _ in range(2):
        loss = compiled(x).square().sum()
        loss.backward()
    loss = compiled(x).square().sum()
    with torch.no_grad():
        model[2].weight.mul_(0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


class _Compiled:
    """The compiled graph as `rebuild` reads it: its symbols (none here)."""

    def __init__(self):
        from tilefuse.ir.graph import Graph

        self.graph = Graph(name="g")


def test_a_larger_base_is_not_kept_for_a_small_view():
    def fn(x):
        y = x * 2
        return (y[:, :2],)

    gm = _traced(fn, torch.randn(5, 7))
    assert output_views.find(gm, 0) == []


def test_training_forward_copies_no_views():
    """A linear layer and an attention product in a training step: the forward saves transposed
    operands for the backward without a copy kernel for any of them; gradients are eager's."""
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(24, 72)

        def forward(self, x):
            q, k, v = self.qkv(x).split(24, dim=-1)
            att = (q @ k.transpose(-2, -1) * 0.2).softmax(-1)
            return (att @ v).sum()

    model = Block()
    x = torch.randn(3, 11, 24)
    torch._dynamo.reset()
    compiled = tilefuse.compile(model, target="cpu")
    compiled(x).backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).backward()
    for g, want in zip(got, (p.grad for p in model.parameters())):
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-5)
    forward = [r for r in tilefuse.last_compilations().reports if r.graph_name.startswith("forward")][-1]
    copies = [k.name for k in forward.kernels if k.ops and set(k.ops) <= VIEW_ONLY_OPS]
    assert not copies, copies


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_a_gradient_that_views_a_product_is_made_from_it(target):
    """The gradient of `k` in `q @ k.transpose(-1, -2)` is the transposed product `qᵀ·dS`, as
    eager returns it: the backward stores the product and gives its view back, with no kernel
    copying it into the gradient, eager's strides and values; bf16 on the Triton path."""
    def attention(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v

    dtype = torch.bfloat16 if target == "interpret" else torch.float32
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 19, 16, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    do = torch.randn(2, 3, 19, 16, generator=gen).to(dtype)
    torch._dynamo.reset()
    compiled = tilefuse.compile(attention, target=target, fallback="error")
    for _ in range(2):
        got = torch.autograd.grad(compiled(q, k, v), (q, k, v), do)
    want = torch.autograd.grad(attention(q, k, v), (q, k, v), do)
    fp32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(attention(*fp32), fp32, do.float())
    for g, w, r in zip(got, want, ref):
        assert g.stride() == w.stride()
        assert (g.float() - r).abs().max() <= 2 * (w.float() - r).abs().max() + 1e-5
    backward = [r for r in tilefuse.last_compilations().reports if r.graph_name.startswith("backward")][-1]
    copies = [k.name for k in backward.kernels if k.ops and set(k.ops) <= VIEW_ONLY_OPS]
    assert not copies, copies


def test_two_gradients_viewing_one_value_are_copies():
    """Two outputs of a backward that are pieces of one value would share its storage
    (accumulating into one gradient in place would change the other): neither is made a view."""
    def fn(x):
        y = x * 2
        return y[:, :3], y[:, 3:]

    gm = _traced(fn, torch.randn(5, 7))
    assert output_views.find(gm, None, sole_views_from=0) == []
    (view,) = output_views.find(_traced(lambda x: (x * 2).t(), torch.randn(5, 7)), None, sole_views_from=0)
    assert view.base_node is not None and view.replay


GPU_RULES = {"matmul": "aten", "target": "interpret", "fallback": "error"}


@pytest.mark.parametrize("case", ["slice of a padded product", "flat view of a padded product", "transposed and flat"])
def test_views_of_a_base_laid_out_otherwise_than_traced(case):
    """A product the library writes with padded rows (257 columns) is the base of the views
    returned beside it: they read its values, not its padding, and nothing falls back."""
    h, w = torch.randn(2, 3, 64), torch.randn(257, 64)
    fns = {
        "slice of a padded product": lambda h, w: (lambda l: (l, l[:, -1, :]))(F.linear(h, w)),
        "flat view of a padded product": lambda h, w: ((h[0] @ w.t()).view(-1),),
        "transposed and flat": lambda h, w: (lambda y: (y.t(), y.view(-1)))(h[0] @ w.t()),
    }
    fn = fns[case]
    torch._dynamo.reset()
    with torch.no_grad():
        got = tilefuse.compile(fn, options=GPU_RULES)(h, w)
        want = fn(h, w)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def test_a_training_output_stays_writable():
    """A product's output (a view of the product's buffer in the graph) takes in-place ops in
    a training graph, as eager's does."""
    x, w = torch.randn(2, 3, 8, requires_grad=True), torch.randn(8, 5, requires_grad=True)
    torch._dynamo.reset()
    out = tilefuse.compile(lambda x, w: x @ w, target="cpu")(x, w)
    out.mul_(2)
    out.sum().backward()
    torch.testing.assert_close(w.grad, (x.detach().reshape(-1, 8).t() @ torch.full((6, 5), 2.0)))


def test_a_view_that_reinterprets_the_dtype_keeps_it():
    x = torch.randn(4, 6)
    torch._dynamo.reset()
    y, bits = tilefuse.compile(lambda x: (lambda y: (y, y.view(torch.int32)))(x * 2), target="cpu")(x)
    assert bits.dtype == torch.int32 and torch.equal(bits, (x * 2).view(torch.int32))


@pytest.mark.parametrize("shape,fn", [((4, 6), lambda x: x.cos().split(2, 0)),
                                      ((5, 7), lambda x: x.cos().chunk(2, 1)),
                                      ((3, 5), lambda x: (lambda y: (y, y.t()))(x.cos()))])
def test_pieces_and_views_under_dynamic_shapes(shape, fn):
    """With symbolic sizes a piece of `split` is not taken for the base of the others (it is a
    slice of their storage); a whole value still is. Two sizes, no eager fallback."""
    torch._dynamo.reset()
    compiled = tilefuse.compile(fn, target="cpu", dynamic=True, fallback="error")
    for extra in (0, 2):
        x = torch.randn(shape[0] + extra, shape[1] + extra)
        for got, want in zip(compiled(x), fn(x)):
            torch.testing.assert_close(got, want)


def test_a_static_views_layout_is_worked_out_once_and_a_symbolic_one_per_call():
    import sympy

    s = sympy.Symbol("s0", integer=True, positive=True)
    # the transpose of a (3, 4) base, its last two columns: sizes (2, 3), strides (1, 4), offset 2
    static = output_views.OutputView(1, "output", 0, (sympy.Integer(2), 3), (1, sympy.Integer(4)), sympy.Integer(2),
                                     base_strides=(sympy.Integer(4), 1))
    assert output_views._static_layout(static) == (((2, 3), (1, 4), 2), (4, 1))
    assert all(type(x) is int for part in output_views._static_layout(static)[0][:2] for x in part)
    symbolic = static._replace(sizes=(s, 3))
    assert output_views._static_layout(symbolic) is None
    # both give the view the strides describe, from a random base
    base = torch.randn(3, 4)

    class _Graph:
        graph = None

    out = output_views.rebuild([static], _Graph(), [], [base, None])
    torch.testing.assert_close(out[1], base[:, 2:].t())


def test_two_gradients_of_one_value_do_not_share_memory():
    """`a + b` of two parameters: the backward returns one gradient for both, the second a
    view of the first. Made a tensor of its own, `AccumulateGrad` kept both and the two
    `.grad`s shared memory (an in-place clip or accumulation of one changed the other); as
    in eager, each parameter gets its own."""
    torch.manual_seed(0)

    class Sum(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.randn(4, 6))
            self.b = nn.Parameter(torch.randn(4, 6))

        def forward(self, x):
            return (x * (self.a + self.b)).tanh().sum()

    model, x = Sum(), torch.randn(4, 6)
    torch._dynamo.reset()
    compiled = tilefuse.compile(model, target="cpu", fallback="error")
    for _ in range(3):
        compiled(x).backward()
        assert model.a.grad.untyped_storage().data_ptr() != model.b.grad.untyped_storage().data_ptr()
        model.a.grad.mul_(0.0)
        assert model.b.grad.abs().sum() > 0
        model.zero_grad(set_to_none=True)
