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
