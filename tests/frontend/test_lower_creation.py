"""Creation lowerings: full / zeros / ones / empty (+ _like, new_), scalar_tensor, arange."""
import pytest
import torch
from lowering_harness import check, rand

F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("dtype", [F32, BF16, torch.int64, torch.bool])
def test_full_and_like(dtype):
    x = rand(7, 13, dtype=dtype)

    def f(x):
        return (torch.full((3, 5), 2.5, dtype=F32), torch.full_like(x, 3), torch.zeros_like(x), torch.ones_like(x),
                torch.zeros(2, 7, dtype=dtype), torch.ones(4, dtype=dtype), x.new_full((2, 3), 1),
                x.new_zeros(5), x.new_ones((1, 2)), torch.empty_like(x).fill_(1), torch.empty(3, 2).zero_(),
                torch.full((2,), True), torch.full_like(x, 0.1, dtype=BF16), x + torch.ones_like(x))

    check(f, x)


def test_scalar_tensor_and_constants():
    x = rand(7, 13)
    check(lambda x: (x * torch.scalar_tensor(0.5), torch.where(x > 0, x, torch.scalar_tensor(-1.0)),
                     x + torch.tensor(2.0), torch.ops.aten.scalar_tensor(3, dtype=torch.int64) + 1), x)


ARANGES = [
    ("end", lambda: torch.arange(13)), ("start_end", lambda: torch.arange(3, 17)),
    ("step", lambda: torch.arange(1, 20, 3)), ("neg_step", lambda: torch.arange(10, -7, -2)),
    ("float", lambda: torch.arange(0.5, 3.2, 0.3)), ("float_neg", lambda: torch.arange(1.0, -1.0, -0.25)),
    ("float_dtype", lambda: torch.arange(0, 13, dtype=F32)), ("bf16", lambda: torch.arange(0, 2, 0.125, dtype=BF16)),
    ("int32", lambda: torch.arange(5, dtype=torch.int32)), ("linspace", lambda: torch.linspace(-1, 1, 17)),
]


@pytest.mark.parametrize("name,fn", ARANGES, ids=[a[0] for a in ARANGES])
def test_arange(name, fn):
    check(lambda x: fn() * x[0], torch.tensor([1.5]) if fn().is_floating_point() else torch.tensor([3]))


def test_arange_dynamic():
    check(lambda x: x * torch.arange(x.shape[0]).unsqueeze(1) + torch.arange(1, x.shape[1] * 2, 2), rand(7, 13),
          dynamic=True)
    check(lambda x: torch.full((x.shape[0], 3), 1.5) + x.sum(1, keepdim=True), rand(7, 13), dynamic=True)


def test_iota():
    from torch.fx.experimental.proxy_tensor import make_fx

    from tilefuse.frontend.to_ir import lower_fx
    from tilefuse.ir.interpret import interpret

    def f(x):
        return torch.ops.prims.iota(7, start=3, step=2, dtype=torch.int64, device=x.device, requires_grad=False) + x

    x = torch.randint(0, 5, (7,))
    g = lower_fx(make_fx(f)(x))
    assert not any(type(n).__name__ == "Extern" for n in g.nodes.values())
    assert torch.equal(interpret(g, [x])[0], f(x))


def test_copy_into_fresh_tensor():
    y = rand(5, dtype=BF16)
    check(lambda y: (torch.empty(3, 5).copy_(y), torch.zeros(2, 5, dtype=torch.int64).copy_(y * 4)), y)


def test_runtime_asserts_are_dropped():
    i = torch.randint(0, 5, (7,))
    check(lambda i: torch.nn.functional.one_hot(i, 5) * 2, i)


def test_captured_zero_dim_constants_become_literals():
    """`torch.tensor(c)` in a traced function is a captured constant; a 0-dim one is read as
    its value (as Hugging Face's `where(mask, tensor(0.), finfo.min)`), never loaded per element."""
    import tilefuse

    def f(x, keep):
        bias = torch.where(keep, torch.tensor(0.0), torch.tensor(-1e30))
        return torch.softmax(x + bias, -1) * torch.tensor(3) + torch.tensor(True)

    gen = torch.Generator().manual_seed(11)
    x, keep = torch.randn(6, 29, generator=gen), torch.rand(6, 29, generator=gen) > 0.3
    torch._dynamo.reset()
    report = tilefuse.explain(f, x, keep)
    assert report.kernels and not any("ptr_const" in k.source for k in report.kernels), str(report)
    torch._dynamo.reset()
    out = torch.compile(f, backend="tilefuse")(x, keep)
    torch.testing.assert_close(out, f(x, keep), rtol=1e-5, atol=1e-5)
