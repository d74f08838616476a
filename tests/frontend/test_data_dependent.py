"""Sizes and scalars only known when the program runs (unbacked symbols: `nonzero`'s count,
`item()`) are bound from the extern that produces them, and the generated kernels after it use
them; ops wrapped in effect tokens (`with_effects`) run as externs."""
import pytest
import torch

import tilefuse


@pytest.fixture(autouse=True)
def _capture_scalars():
    # torch's own patch (monkeypatch on torch's config modules deletes the knob on undo under pytest 9)
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        yield


def _check(fn, *args):
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="tilefuse", fullgraph=True)
    out = compiled(*args)
    ref = fn(*[a.double() if a.is_floating_point() else a for a in args])
    eager = fn(*args)
    assert out.shape == eager.shape
    assert (out.double() - ref).abs().max() <= 3 * (eager.double() - ref).abs().max() + 1e-5


def test_a_size_from_nonzero_reaches_the_generated_kernels():
    torch.manual_seed(0)
    fn = lambda x: torch.sigmoid(x[x > 0.3] * 2 + 1)  # noqa: E731  (masked_select: unbacked count)
    for n in (37, 101):
        _check(fn, torch.randn(n))


def test_an_item_scalar_is_bound_for_what_follows():
    torch.manual_seed(1)
    fn = lambda x, k: x * k.sum().item() + 1  # noqa: E731
    _check(fn, torch.randn(5, 7), torch.randint(1, 4, (3,)))


def test_ops_with_effect_tokens_run_in_aten():
    torch.manual_seed(2)
    a = torch.randn(6, 6) + 6 * torch.eye(6)
    _check(lambda a: torch.linalg.inv(a) * 2 + 1, a)


def test_outputs_that_are_columns_of_nonzero_compile_and_train():
    """`torch.where(mask)` gives the columns of `nonzero`'s (u0, 2) result: the second starts
    at a data-dependent offset (u0) and neither spans the storage; deciding which output other
    outputs alias must not guard on u0 (it raised), nor take one column for the other's base
    (the second column came back as a view of the first: KeyError on u0)."""
    torch.manual_seed(3)

    def fn(idx, x):
        tok, slot = torch.where(idx == 1)
        return x[tok] * (slot[:, None] + 1), tok, slot

    idx, x = torch.randint(0, 3, (9, 2)), torch.randn(9, 5, requires_grad=True)
    torch._dynamo.reset()
    out = torch.compile(fn, backend="tilefuse", fullgraph=True)(idx, x)
    want = fn(idx, x)
    for o, w in zip(out, want):
        torch.testing.assert_close(o, w)
    g, = torch.autograd.grad(out[0].sum(), x)
    g_want, = torch.autograd.grad(want[0].sum(), x)
    torch.testing.assert_close(g, g_want)
