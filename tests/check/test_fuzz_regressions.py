"""Regression tests for the bugs the differential fuzzer found, each from its shrunk reproducer."""
import pytest
import torch

from tilefuse.check import fuzz
from tilefuse.check.program import InputSpec, Program


def _check(lines, outputs, inputs, dtype="torch.float32", dynamic=False):
    p = Program(tuple(inputs), tuple(lines), tuple(outputs), dtype=dtype, dynamic=dynamic)
    outcome = fuzz.check_program(p)
    assert outcome.status == "ok", (outcome, p.function_source())


@pytest.mark.parametrize("shape", [(2,), (1, 2), (5, 7)])
def test_view_of_an_input_with_a_symbolic_length(shape):
    """fuzz seed 1, cases 141 and 246: `x.narrow(-1, 1, x.shape[-1] - 1)` under dynamic=True
    returned x[..., :-1]. AOTAutograd rebuilds an output that aliases an input with
    `as_strided` from the compiled output's own offset when the view has symbolic arguments;
    the compiled graph returned a fresh buffer (offset 0). Aliased outputs are now returned as
    the views they are."""
    _check(["v0 = x0.narrow(-1, 1, x0.shape[-1] - 1)"], ["v0"], [InputSpec("x0", shape)], dynamic=True)


def test_view_of_another_output_with_a_symbolic_length():
    _check(["v0 = x0 * 2", "v1 = v0.narrow(-1, 1, v0.shape[-1] - 1)", "v2 = v0.transpose(-1, -2)"],
           ["v0", "v1", "v2"], [InputSpec("x0", (3, 5), "transposed")], dynamic=True)


def test_aliased_output_is_a_view_of_the_input():
    def f(x):
        return x.narrow(-1, 1, x.shape[-1] - 1)

    torch._dynamo.reset()
    x = torch.randn(4, 6)
    out = torch.compile(f, backend="tilefuse", dynamic=True)(x)
    assert torch.equal(out, f(x))
    assert out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # no copy, as eager


def test_symbolic_size_sum_of_a_view_chain():
    """fuzz seed 2, case 129: a strided slice then a narrow by a symbolic length makes Dynamo
    emit `torch.sym_sum` (an n-ary sum of sizes), which the frontend did not evaluate."""
    _check(["v0 = x0[..., ::2]", "v1 = v0.narrow(-1, 1, v0.shape[-1] - 1)"], ["v1"], [InputSpec("x0", (1, 3))],
           dynamic=True)
    _check(["v0 = x0[..., ::2]", "v1 = v0.narrow(-1, 1, v0.shape[-1] - 1)", "v2 = v1 * 2"], ["v2"],
           [InputSpec("x0", (4, 9))], dynamic=True)


def test_bf16_value_used_at_two_precisions():
    """`v0.amax(1) > v0` is never true in eager (the same rounded value on both sides); the
    compiled kernel compared the bf16-rounded reduction with the fp32 mean it inlined (fuzz
    seed 2, case 249). Comparisons now see eager's rounding of their operands."""
    import torch

    torch.manual_seed(0)
    for _ in range(5):
        p = Program((InputSpec("x0", (2, 1, 1)),), ("v0 = x0.mean(0, keepdim=False)",
                                                     "v1 = v0.amax(1, keepdim=True)",
                                                     "v2 = torch.where(v1 > v0, v1, v0 * 2)"),
                    ("v2",), dtype="torch.bfloat16")
        for seed in range(8):
            outcome = fuzz.check_program(p, seed)
            assert outcome.status == "ok", outcome


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_a_decompositions_own_rounding_is_skipped_like_an_ops(target):
    """fuzz seed 2468, case 53: `v - logsumexp(v)` over one element is 0 in eager and in fp64.
    The logsumexp decomposition computes in float32 and converts back to bf16; that conversion
    was kept as if the program had written it, while `v = sin(x)` was inlined unrounded: -5e-4,
    which an RMS normalisation scaled to 0.45. Only conversions the program writes keep their
    rounding between fused ops now."""
    from tilefuse import config

    with config.patch(target=target):
        _check(["v0 = torch.sin(x0)", "v5 = v0.unsqueeze(-1)",
                "v7 = v5 - torch.logsumexp(v5, 2, keepdim=True)",
                "v10 = v7 * torch.rsqrt(v7.pow(2).mean(-1, keepdim=True) + 1e-6)"],
               ["v10"], [InputSpec("x0", (1, 1))], dtype="torch.bfloat16")


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_values_that_are_the_scores_themselves(target):
    """fuzz seed 2468, case 245: `softmax(s * 0.5) @ s` with `s = a @ b` fused into one flash
    kernel whose values tile was the score tile (query rows, not key rows): a shape error, or
    wrong values where the tiles happened to agree. The values may not read the scores."""
    from tilefuse import config

    with config.patch(target=target):
        _check(["v1 = torch.softmax(x2 @ x2.transpose(-1, -2), -1)", "v3 = v1 @ v1",
                "v4 = torch.softmax(v3 * 0.5, -1) @ v3"], ["v4"], [InputSpec("x2", (12, 3))])


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_outputs_viewing_a_value_that_a_strided_slice_does_not_cover(target):
    """fuzz seed 4444, case 296: `v[..., ::2]` and `v.transpose(-1, -2)` of one intermediate
    `v`. The strided slice spans all of `v`'s bytes, so it was taken as the base the transpose
    views, and the transpose read the elements the slice skips, unwritten (7e31). A base must
    hold every element of its storage."""
    from tilefuse import config

    with config.patch(target=target):
        for shape in [(1, 3, 1), (2, 5, 3)]:
            _check(["v1 = x0.sum(2)", "v6 = v1[..., ::2]", "v7 = v1.transpose(-1, -2)"], ["v6", "v7"],
                   [InputSpec("x0", shape)])


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_a_quotient_by_a_size_less_one(target):
    """fuzz seed 4444, case 198: a product's output laid out through `x.narrow(-1, 1, n - 1)`
    under dynamic=True divided its flat index by `s - 1`; `sympy.expand` had split the quotient
    into fractions term by term (`a*s/(s - 1) - a/(s - 1)`), which the Triton kernel divided as
    floats (a type error) and C++ truncated term by term. Quotients by a sum are now taken by
    polynomial division."""
    from tilefuse import config

    with config.patch(target=target):
        _check(["v1 = x0.narrow(-1, 1, x0.shape[-1] - 1)", "v2 = v1.unsqueeze(0).expand(3, *v1.shape)",
                "v8 = torch.softmax(v2 @ v2.transpose(-1, -2), -1)", "v9 = v8.bfloat16().to(v8.dtype) @ v2"],
               ["v9"], [InputSpec("x0", (5, 4, 3))], dtype="torch.float64", dynamic=True)


def test_floor_of_a_quotient_by_a_sum_is_divided_as_polynomials():
    import sympy

    from tilefuse.ir.symbolic import Floor, ceildiv, floordiv

    a, r, s = sympy.symbols("a r s", integer=True, positive=True)
    split = sympy.expand(Floor(sympy.expand(a * (s - 1) + r) / (s - 1)))  # expand splits the fraction
    assert split == a + Floor(r / (s - 1))
    assert floordiv(s * s - 1, s - 1) == s + 1
    for sv in range(2, 7):  # the identities, numerically
        assert ceildiv(s * s, s - 1).subs(s, sv) == -(-(sv * sv) // (sv - 1))
        for av in range(4):
            for rv in range(9):
                value = split.subs({a: av, r: rv, s: sv})
                assert value == (av * (sv - 1) + rv) // (sv - 1)


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_a_score_row_broadcast_to_every_row(target):
    """fuzz seed 1212, case 9: `softmax(v1 * 0.5, -1) @ x0` is one row of scores, which
    `maximum(v2, x1)` broadcasts to every row before a second product. The plan recomputed that
    row per tile of rows, and the Triton kernel multiplied a one-row tile into an accumulator of
    BLOCK_M rows (an assertion under the interpreter). Such a score row is computed once now;
    an attention whose one query row a bias broadcasts (below) gets its query tile broadcast."""
    from tilefuse import config

    with config.patch(target=target):
        _check(["v1 = x1.mean(1, keepdim=False)", "v2 = torch.softmax(v1 * 0.5, -1) @ x0",
                "v3 = torch.maximum(v2, x1)", "v4 = torch.softmax(v3 @ x1.transpose(-1, -2), -1)"],
               ["v4"], [InputSpec("x0", (16, 7)), InputSpec("x1", (16, 7))])
        _check(["v0 = torch.softmax(x0[:1] @ x1.transpose(-1, -2) + x2, -1) @ x1"], ["v0"],
               [InputSpec("x0", (3, 8)), InputSpec("x1", (40, 8)), InputSpec("x2", (16, 40))])
