"""Sizes and scalars only known when the program runs (unbacked symbols: `nonzero`'s count,
`item()`) are bound from the extern that produces them, and the generated kernels after it use
them; ops wrapped in effect tokens (`with_effects`) run as externs."""
import pytest
import torch

import tilefuse


@pytest.fixture(autouse=True)
def _capture_scalars(monkeypatch):
    import torch._dynamo.config as dynamo_config

    monkeypatch.setattr(dynamo_config, "capture_scalar_outputs", True)
    monkeypatch.setattr(dynamo_config, "capture_dynamic_output_shape_ops", True)


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
