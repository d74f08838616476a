"""The OpInfo sweep, CI subset: representative ops of every family through
torch.compile(backend="tilefuse", fullgraph=True); none may mismatch or fail unless listed in
op_sweep.EXPECTED with its reason. `tilefuse ops --sweep` runs the whole op_db."""
import pytest
import torch

pytest.importorskip("expecttest")  # PyTorch's OpInfo database imports it

from tilefuse.check import op_sweep  # noqa: E402


@pytest.fixture(scope="module")
def subset_results():
    return {(r.op, r.dtype): r for r in op_sweep.run_subset()}


def test_ci_subset_has_no_mismatch_or_error(subset_results):
    bad = [(k, r.status, r.detail) for k, r in subset_results.items() if r.status in ("mismatch", "error")]
    assert not bad, bad
    assert set(subset_results) == set(op_sweep.CI_SUBSET)


def test_ci_subset_classifies_generated_and_extern(subset_results):
    assert subset_results[("softmax", "float32")].status == "generated"
    assert subset_results[("mm", "float32")].kernels >= 1
    sort = subset_results[("sort", "float32")]
    assert sort.status == "extern" and any("sort" in e for e in sort.externs)


def test_every_expected_failure_has_a_reason():
    for key, reason in op_sweep.EXPECTED.items():
        assert isinstance(key, tuple) and len(key) == 2 and len(reason) > 20, (key, reason)


def test_sweep_detects_a_wrong_op(monkeypatch):
    """The sweep can fail: with sigmoid's lowering made wrong, sigmoid is a mismatch."""
    from tilefuse.frontend import registry

    real = registry.find_lowering

    def wrong(target):
        fn = real(target)
        if fn is not None and "sigmoid" in str(target):
            return lambda ctx, x, *a, **k: real(torch.ops.aten.exp.default)(ctx, x)  # exp, not sigmoid
        return fn

    monkeypatch.setattr("tilefuse.frontend.to_ir.find_lowering", wrong)
    (result,) = op_sweep.run_sweep(dtypes=("float32",), ops=["sigmoid"], samples=1)
    assert result.status == "mismatch", result


def test_regressions_found_by_the_sweep():
    """Found by the sweep: a constant boolean store (`(True).to(tl.int1)`) and integer -> bf16
    casts, which the Triton interpreter turned into garbage (arange in bf16)."""
    torch._dynamo.reset()
    out = torch.compile(lambda x: torch.ones(2, dtype=torch.bool) & (x[:2] > 0), backend="tilefuse")(torch.ones(3))
    assert out.tolist() == [True, True]
    torch._dynamo.reset()
    out = torch.compile(lambda: torch.arange(-1, 2, 2, dtype=torch.bfloat16), backend="tilefuse")()
    assert out.tolist() == [-1.0, 1.0]
    torch._dynamo.reset()
    x = torch.tensor([1, 257, -3, 1000001])
    out = torch.compile(lambda x: x.to(torch.bfloat16) * 3, backend="tilefuse")(x)
    assert torch.equal(out, x.to(torch.bfloat16) * 3)


def _compiled(fn, *args):
    torch._dynamo.reset()
    return torch.compile(fn, backend="tilefuse", fullgraph=True)(*args)


# found by the full sweep of 2026-12-01 (each was an error: the graph ran eagerly)


def test_complex32_passes_between_externs():
    """complex32 (`chalf`) had no IR dtype: an error, not an extern."""
    x = torch.randn(5, 6)
    out = _compiled(lambda x: (x * 2).to(torch.chalf) * 3, x)
    assert out.dtype == torch.chalf
    assert torch.equal(torch.view_as_real(out.cfloat()), torch.view_as_real(((x * 2).to(torch.chalf) * 3).cfloat()))


def test_narrow_at_a_tensor_start():
    """The output is a view of the input whose storage offset is a size nothing in the graph
    computes; giving outputs back as views evaluated it."""
    x = torch.randn(5, 6)
    for start in (0, 2, 4):
        t = torch.tensor(start)
        out = _compiled(lambda x, t: torch.narrow(x, 1, t, 2) * 1.5, x, t)
        torch.testing.assert_close(out, torch.narrow(x, 1, t, 2) * 1.5)
        view = _compiled(lambda x, t: torch.narrow(x, 1, t, 2), x, t)
        assert torch.equal(view, x[:, start:start + 2])


def test_tensor_split_at_tensor_indices():
    """A slice whose data-dependent size no step binds was lowered to a kernel (which could not
    be launched): such ops now run in ATen, whose result binds the size."""
    x = torch.randn(5, 6)
    cuts = torch.tensor([1, 3, 4])
    outs = _compiled(lambda x, c: torch.tensor_split(x, c), x, cuts)
    assert [o.shape[0] for o in outs] == [1, 2, 1, 1]
    for o, e in zip(outs, torch.tensor_split(x, cuts)):
        assert torch.equal(o, e)


def test_outputs_that_are_strided_slices_of_one_intermediate():
    """`unravel_index`'s two outputs, strided slices of one intermediate, were taken for a base
    and its view (the second rebuilt past the end of the first's storage)."""
    idx = torch.randint(0, 20, (2, 3))
    outs = _compiled(lambda i: torch.unravel_index(i, (4, 5)), idx)
    for o, e in zip(outs, torch.unravel_index(idx, (4, 5))):
        assert torch.equal(o, e)


def test_compare_resolves_conjugate_views():
    """`fft.ifft` may return a conjugate view: comparing it raised instead of judging it."""
    from tilefuse.compare import compare_outputs

    z = torch.randn(6, dtype=torch.cfloat)
    assert compare_outputs(z.conj(), z.conj().resolve_conj(), z.conj().to(torch.cdouble)) is None
    assert compare_outputs(z.conj(), z.resolve_conj(), None) is not None  # still finds a wrong value


# found by the full sweep on the Triton interpreter (2026-12-01)


def test_integer_pow_with_negative_exponents():
    """`_ipow` walked the bits of a negative exponent (garbage); PyTorch gives 1 for 1, ±1 for
    -1 and 0 for every other base (`__rpow__` on int64)."""
    base = torch.tensor([5, 2, 1, -1, -1, 0, -3, 3, 7])
    exp = torch.tensor([-8, -1, -5, -3, -2, -1, 3, 0, 2])
    out = _compiled(lambda a, b: a ** b, base, exp)
    assert torch.equal(out, base ** exp)


def test_scalar_condition_combined_with_a_block():
    """The interpreter combined a scalar bool (a comparison of a 0-d value) with a block of
    bools into int32 data typed int1: numpy rejected it (`lerp` with a Python-scalar weight)."""
    x, y = torch.randn(5, 7), torch.randn(5, 7)
    torch.testing.assert_close(_compiled(lambda x, y: torch.lerp(x, y, 0.4), x, y), torch.lerp(x, y, 0.4))
    s = torch.tensor(0.7)
    for fn in (lambda x, s: torch.where((s > 0.5) & (x > 0), x, -x), lambda x, s: torch.where((s < 0.5) | (x > 0), x, 0.0),
               lambda x, s: x[(x > 0) ^ (s > 0.5)].sum()):
        torch.testing.assert_close(_compiled(fn, x, s), fn(x, s))
    i = torch.tensor([-2, 0, 3, 0, 5])  # heaviside: a literal True inside the combination
    for v in (torch.tensor(1), torch.tensor([7, 8, 9, -1, 2])):
        assert torch.equal(_compiled(torch.heaviside, i, v), torch.heaviside(i, v))


def test_integer_constants_beyond_int32():
    """An int64 literal past int32 (the int64-max sentinel of `multilabel_margin_loss`'s
    first-ignored-target search) was printed bare, and the interpreter converted it to the
    other operand's int32 (an error; listed as an open bug before)."""
    import torch.nn.functional as F

    x = torch.randn(3, 7)
    t = torch.tensor([[2, 0, 6, 4, 1, 5, 3], [5, 4, 3, 2, 1, 0, 0], [3, 3, 3, 1, 1, 1, 6]])  # no -1: see README
    torch.testing.assert_close(_compiled(F.multilabel_margin_loss, x, t), F.multilabel_margin_loss(x, t))
    big = torch.tensor([2**40, -2**35, 7])
    assert torch.equal(_compiled(lambda b: torch.where(b > 0, b, 2**62), big), torch.where(big > 0, big, 2**62))
