"""Finite bases (`fusion.finite_base`): a flash loop computes its terms against 0 while a row's
running max is still -inf, and re-bases its partial sums by a product alone. Checked: which maxima
qualify (and which terms refuse), the kernels' re-basing without a select on every element, and
the results against an fp64 eager reference on both CPU backends — rows whose first key tiles are
all masked, rows masked throughout (NaN, as eager gives), NaN scores, infinite values."""
import math

import pytest
import torch

import tilefuse
from backends_on_cpu import CPU_BACKENDS
from lowered_plans import plans_of
from tilefuse.fusion.finite_base import _vanishes, finite_bases
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import Const, Index, Load, Unary, binary, where
from tilefuse.tile.ir import KernelKind, Let, statements
from tilefuse.tile.lower import lower_plan_kernels


def _masked(q, k, v, mask):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v


def _softcapped_after_mask(q, k, v, mask):
    s = (q @ k.transpose(-2, -1)).masked_fill(~mask, float("-inf"))
    return torch.softmax(torch.tanh(s / 5.0) * 5.0, dim=-1) @ v


def _logsumexp(q, k, v, mask):
    s = (q @ k.transpose(-2, -1) * 0.2).masked_fill(~mask, float("-inf"))
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - m)
    return (e @ v) / e.sum(-1, keepdim=True), m + e.sum(-1, keepdim=True).log()


def _flash_plan(fn, *args):
    return next((g, p, o) for g, p, o in plans_of(fn, *args) if p.kind == "flash")


def _inputs(b=2, h=3, t=70, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, t, d, generator=g) for _ in range(3))
    mask = torch.rand(t, t, generator=g) > 0.5
    mask[:, : t // 2] = False  # every row's first key tiles are all masked
    mask[3] = False  # a row masked throughout
    mask[7, -1] = True  # a row whose only live key is the last
    mask[7, t // 2:-1] = False
    return q, k, v, mask


def _row(d):
    return Load("m", (Index(sympy_sym("i0")), Index(sympy_sym("i1"))), d)


def sympy_sym(name):
    import sympy
    return sympy.Symbol(name, integer=True)


def test_the_running_max_of_masked_attention_is_a_finite_base():
    graph, plan, _ = _flash_plan(_masked, *_inputs())
    (m,) = [st.node for st in plan.stages if st.kind == "reduce" and graph[st.node].combiner.name == "max"]
    assert finite_bases(graph, plan) == {m}


def test_terms_reading_other_data_against_the_max_keep_the_select():
    f = dt.float32
    score = Load("s", (Index(sympy_sym("i0")), Index(sympy_sym("r0"))), f)
    other = Load("t", (Index(sympy_sym("i0")), Index(sympy_sym("r0"))), f)
    m = _row(f)
    assert _vanishes(Unary("exp", binary("sub", score, m), f), "m", score, True)
    # exp(t - max(s)): a row of -inf scores says nothing of t
    assert not _vanishes(Unary("exp", binary("sub", other, m), f), "m", score, True)
    # a term that does not vanish at -inf: exp(tanh(s) - m) is exp(-1) there
    assert not _vanishes(Unary("exp", binary("sub", Unary("tanh", score, f), m), f), "m", score, True)
    # a term with a value beside it: exp(s - m) + t is t in a row of -inf scores
    assert not _vanishes(binary("add", Unary("exp", binary("sub", score, m), f), other), "m", score, True)
    # a select the derivation cannot read
    picked = where(binary("gt", other, Const(0.0, f)), score, other)
    assert not _vanishes(Unary("exp", binary("sub", picked, m), f), "m", score, True)


def test_the_kernel_rebases_by_a_product_alone():
    graph, plan, options = _flash_plan(_masked, *_inputs())
    (kernel,) = [k for k in lower_plan_kernels(graph, plan, options) if k.kind == KernelKind.FLASH]
    rebased = [s for s in statements(kernel.body) if isinstance(s, Let) and s.name.startswith("rebased")]
    assert rebased and all(s.value.op == "mul" for s in rebased)
    bases = [s for s in statements(kernel.body) if isinstance(s, Let) and s.name.startswith("base")]
    assert bases  # the terms' base, selected per row


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("fn", [_masked, _softcapped_after_mask, _logsumexp])
def test_rows_masked_at_first_or_throughout_match_eager(backend, fn):
    q, k, v, mask = _inputs(t=70 if backend == "cpu" else 37)
    config = {} if backend == "cpu" else {"flash_config": "16,16,4,1"}
    compiled = tilefuse.compile(fn, target=backend, fallback="error", **config)
    out = compiled(q, k, v, mask)
    ref = fn(q.double(), k.double(), v.double(), mask)
    for o, r in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,)):
        assert torch.equal(o.isnan(), r.isnan())  # the row masked throughout is NaN, as in eager
        torch.testing.assert_close(o.double().nan_to_num(), r.nan_to_num(), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_nan_scores_and_infinite_values_propagate_as_in_eager(backend):
    q, k, v, mask = _inputs(t=40)
    q[0, 1, 5, 0] = float("nan")  # one row's scores NaN
    v[1, 2, 30, 3] = float("inf")  # an infinite value under a live key of some rows
    mask[:, 30] = True
    compiled = tilefuse.compile(_masked, target=backend, fallback="error",
                                **({} if backend == "cpu" else {"flash_config": "16,16,4,1"}))
    out = compiled(q, k, v, mask)
    ref = _masked(q.double(), k.double(), v.double(), mask)
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out.isinf(), ref.isinf())
    finite = ref.isfinite()
    torch.testing.assert_close(out.double()[finite], ref[finite], rtol=1e-5, atol=2e-5)


def _two_maxima(q, k, v):
    j = torch.arange(k.shape[-2])[None, :]
    s = q @ k.transpose(-1, -2) * 0.25
    late = s.masked_fill(j < 20, float("-inf"))  # the second softmax sees no key before 20
    return (torch.softmax(s, -1) * torch.softmax(late, -1)) @ v


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_sum_over_two_maxima_keeps_the_select_while_one_of_them_is_minus_inf(backend):
    # (its factor exp(r0 - r0' + r1 - r1') is NaN while r1 stays -inf and r0 moves: the select
    # drops the sum when r1 leaves -inf; a product alone would keep the NaN)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (8, 40, 40))
    compiled = tilefuse.compile(_two_maxima, target=backend, fallback="error", flash_config="16,16,4,1")
    out = compiled(q, k, v)
    ref = _two_maxima(q.double(), k.double(), v.double())
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=2e-5)
