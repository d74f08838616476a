"""Reduction lowerings: dims None / [] / negative / several, keepdim, dtype arguments."""
import pytest
import torch
from lowering_harness import check, noncontig, rand

from tilefuse.ir import Reduce
from tilefuse.ir.expr import Load, walk
from tilefuse.ir.monoid import SUM

F32, BF16 = torch.float32, torch.bfloat16

DIMS = [None, 0, -1, (0, 2), (-1, 1), ()]
REDUCTIONS = [
    ("sum", lambda x, d, k: x.sum(d, keepdim=k) if d is not None else x.sum()),
    ("mean", lambda x, d, k: x.mean(d, keepdim=k) if d is not None else x.mean()),
    ("amax", lambda x, d, k: x.amax(d if d is not None else (), keepdim=k)),
    ("amin", lambda x, d, k: x.amin(d if d is not None else (), keepdim=k)),
    ("var", lambda x, d, k: x.var(d, keepdim=k)),
    ("std", lambda x, d, k: x.std(d, keepdim=k)),
    ("var_c0", lambda x, d, k: torch.var(x, d, correction=0, keepdim=k)),
    ("std_c2", lambda x, d, k: torch.std(x, d, correction=2, keepdim=k)),
    ("var_mean", lambda x, d, k: torch.var_mean(x, d, keepdim=k)),
    ("std_mean", lambda x, d, k: torch.std_mean(x, d, correction=0, keepdim=k)),
    ("norm", lambda x, d, k: torch.linalg.vector_norm(x, dim=d, keepdim=k)),
    ("norm1", lambda x, d, k: torch.linalg.vector_norm(x, 1, dim=d, keepdim=k)),
    ("norm_inf", lambda x, d, k: torch.linalg.vector_norm(x, float("inf"), dim=d, keepdim=k)),
    ("norm3", lambda x, d, k: torch.linalg.vector_norm(x, 3, dim=d, keepdim=k)),
    ("logsumexp", lambda x, d, k: torch.logsumexp(x, d if d is not None else (0, 1, 2), keepdim=k)),
]


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("name,fn", REDUCTIONS, ids=[r[0] for r in REDUCTIONS])
def test_reduction(name, fn, dtype):
    """Every dims form (None, one, negative, several, empty = all) with and without keepdim."""
    dims = [d for d in DIMS if not (name == "logsumexp" and d == ())]

    def f(x):
        return tuple(fn(x, d, keepdim) for d in dims for keepdim in (False, True))

    rec = check(f, rand(5, 7, 13, dtype=dtype))
    assert any(isinstance(n, Reduce) for g in rec.graphs for n in g.nodes.values())


def test_prod_and_logical():
    x = rand(5, 7, dtype=F32, low=0.5, high=1.5)
    b = rand(5, 7, dtype=torch.bool)
    check(lambda x, b: (x.prod(), x.prod(1), x.prod(0, keepdim=True), b.any(), b.all(), b.any(1), b.all(0),
                        b.any(-1, keepdim=True), (x > 1).all(1), torch.any(b, dim=(0, 1)), torch.any(b, dim=()),
                        torch.all(x, dim=()), x.to(torch.int64).prod(0)),
          x, b)


def test_integer_and_bool_sums():
    i = torch.randint(-50, 50, (7, 13), dtype=torch.int32)
    b = rand(7, 13, dtype=torch.bool)
    check(lambda i, b: (i.sum(), i.sum(0), b.sum(1), i.sum(1, dtype=torch.int32), i.amax(1),
                        b.sum(dtype=torch.float32)),
          i, b)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_dtype_argument(dtype):
    x = rand(7, 33, dtype=dtype)
    check(lambda x: (x.sum(1, dtype=torch.float32), x.mean(0, dtype=torch.float64), x.sum(dtype=torch.float16),
                     x.prod(1, dtype=torch.float32), torch.linalg.vector_norm(x, dim=1, dtype=torch.float32)), x)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_arg_and_indices(dtype):
    x = rand(7, 13, 5, dtype=dtype)
    check(lambda x: (x.argmax(), x.argmin(), x.argmax(1), x.argmin(-1, keepdim=True), x.argmax(keepdim=True),
                     x.max(1), x.min(-1, keepdim=True), x.max(), x.min(), torch.max(x, 0).values), x)


def test_argmax_ties_and_nan():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, float("nan"), 5.0, float("nan")], [4.0, 4.0, 4.0, 4.0]])
    check(lambda x: (x.argmax(1), x.argmin(1), x.amax(1), x.max(1), x.min(0)), x)


def test_noncontiguous_and_broadcast():
    x = noncontig(13, 7)
    check(lambda x: (x.sum(0), x.mean(1, keepdim=True), x.var(0), (x * x.t()[0][:, None]).sum(1)), x)


@pytest.mark.filterwarnings("ignore:var")
@pytest.mark.filterwarnings("ignore:std")
def test_var_small_n():
    x = rand(4, 1)
    check(lambda x: (x.var(1), torch.var(x, 0, correction=5), x.std(1, correction=0)), x)


def test_zero_dim_input():
    s = torch.tensor(1.5)
    check(lambda s: (s.sum(), s.amax(), s.sum(0), s.mean(-1), s.argmax(), s.prod()), s)


@pytest.mark.parametrize("name", ["sum", "mean", "amax", "var_mean", "norm"])
def test_dynamic(name):
    fn = dict(REDUCTIONS)[name]
    check(lambda x: fn(x, -1, False), rand(5, 7, 13), dynamic=True)
    check(lambda x: fn(x, (0, 1), True), rand(6, 9, 11), dynamic=True)


def test_reduce_body_dtype():
    """Accumulation in fp32 for bf16 (node dtype bf16), int64 for integer sums."""
    x = rand(7, 13, dtype=BF16)
    rec = check(lambda x: x.sum(1), x)
    red = [n for n in rec.graphs[0].nodes.values() if isinstance(n, Reduce)]
    assert red[0].body.dtype.name == "float32" and red[0].dtype.name == "bfloat16"
    rec = check(lambda i: i.sum(1), torch.randint(0, 9, (7, 13), dtype=torch.int32))
    red = [n for n in rec.graphs[0].nodes.values() if isinstance(n, Reduce)]
    assert red[0].body.dtype.name == "int64" and red[0].dtype.name == "int64"


def test_var_is_the_corrected_two_pass_sums():
    """The mean, then the deviations' sum and sum of squares, both reading the mean (the
    corrected two-pass algorithm: the deviations' sum repairs the mean's rounding)."""
    rec = check(lambda x: x.var(1), rand(7, 13))
    nodes = list(rec.graphs[0].nodes.values())
    reds = [n for n in nodes if isinstance(n, Reduce)]
    assert len(reds) == 3 and all(r.combiner == SUM for r in reds)
    graph = rec.graphs[0]
    inputs = {n.name for n in graph.inputs}

    def reads_a_computed_value(r):
        return any(isinstance(e, Load) and e.buffer not in inputs for e in walk(r.body))

    assert not reads_a_computed_value(reds[0]) and all(reads_a_computed_value(r) for r in reds[1:])
