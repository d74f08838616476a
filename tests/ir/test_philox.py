"""Counter-based random numbers (`ir.philox`): the reference against the Philox4x32-10 known
answers, and every backend's `rand(seed, offset)` equal to the reference bit for bit."""
import pytest
import sympy
import torch

from tilefuse.config import config
from tilefuse.compiler import compile_ir
from tilefuse.ir import dtypes as dt
from tilefuse.ir import philox
from tilefuse.ir.expr import Binary, Index, cast
from tilefuse.ir.interpret import interpret

from backends_on_cpu import CPU_BACKENDS
from irgraphs import GraphBuilder


def _words(seed: int, offset: int) -> list[int]:
    """Philox4x32-10 in plain Python integers: the textbook rounds."""
    k0, k1 = seed & philox.WORD, (seed >> 32) & philox.WORD
    c = [offset & philox.WORD, (offset >> 32) & philox.WORD, 0, 0]
    for _ in range(philox.ROUNDS):
        p0, p1 = philox.ROUND_A * c[0], philox.ROUND_B * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k0) & philox.WORD, p1 & philox.WORD,
             ((p0 >> 32) ^ c[3] ^ k1) & philox.WORD, p0 & philox.WORD]
        k0, k1 = (k0 + philox.KEY_A) & philox.WORD, (k1 + philox.KEY_B) & philox.WORD
    return c


def test_known_answer():
    # Random123's known-answer vector for philox4x32_10 with a zero counter and key
    assert _words(0, 0) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


def test_reference_matches_the_rounds():
    gen = torch.Generator().manual_seed(7)
    seeds = torch.randint(0, philox.SEED_BOUND, (5,), generator=gen).tolist()
    offsets = [0, 1, 2, 2 ** 31 - 1, 2 ** 31, 2 ** 32 + 5, 2 ** 40 + 3, 12345678901]
    for seed in seeds:
        got = philox.uniform(torch.tensor(seed), torch.tensor(offsets)).tolist()
        assert got == [(_words(seed, o)[0] >> 8) * philox.UNIT for o in offsets]


def test_uniform_statistics():
    u = philox.uniform_like(torch.tensor(123456789), (400, 500))
    assert u.dtype == torch.float32 and 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs((u < 0.1).float().mean().item() - 0.1) < 0.005
    # neighbours are not correlated (a counter, not a stream, but no visible pattern)
    assert abs(torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1].item()) < 0.01


def _rand_graph(shape):
    """out[i] = rand(seed, linear index of i) + x[i] (a data operand keeps the kernel honest)."""
    b = GraphBuilder("rand")
    seed = b.input("seed", (), dt.int64)
    x = b.input("x", shape)
    strides = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        strides[k] = strides[k + 1] * shape[k + 1]

    def body(i):
        linear = Index(sum(ix.expr * st for ix, st in zip(i, strides)))
        return Binary("rand", seed.load(()), linear, dt.float32) + x.load(i)

    return b.output(b.ctx.pointwise(shape, dt.float32, body))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("shape", [(37,), (5, 67), (3, 4, 129)])
def test_backends_reproduce_the_reference(backend, shape):
    graph = _rand_graph(shape)
    seed = torch.randint(0, philox.SEED_BOUND, ())
    x = torch.randn(shape)
    expected = philox.uniform_like(seed, shape) + x
    (ref,) = interpret(graph, [seed, x])
    torch.testing.assert_close(ref, expected, rtol=0, atol=0)
    with config.patch(target=backend):
        compiled, _ = compile_ir(graph, torch.device("cpu"))
        (got,) = compiled(seed, x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
