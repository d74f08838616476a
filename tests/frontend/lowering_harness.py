"""Run functions through torch.compile with a backend that lowers to graph IR and
interprets it, and compare against eager with the fp64 rule.

    out, graphs = compile_run(fn, *inputs, dynamic=False)
    check(fn, *inputs)                  # compare + assert no Extern node

The backend is AOTAutograd with core-ATen decompositions; its forward (and backward)
compiler lowers the FX graph with `lower_fx`, verifies it, and returns a boxed callable
that runs the reference interpreter.
"""
from __future__ import annotations

import math

import torch
import torch._dynamo
from torch._decomp import core_aten_decompositions
from torch._functorch.aot_autograd import aot_module_simplified

from tilefuse.frontend.to_ir import lower_fx
from tilefuse.ir import Extern, verify
from tilefuse.ir.interpret import interpret

_DECOMPS = core_aten_decompositions()


class Recorder:
    """A torch.compile backend that records every lowered graph."""

    def __init__(self):
        self.graphs = []
        self.fx = []

    def compiler(self, gm, example_inputs):
        graph = lower_fx(gm, name=f"graph{len(self.graphs)}")
        verify(graph)
        self.graphs.append(graph)
        self.fx.append(gm)

        def run(args):
            out = interpret(graph, list(args))
            args.clear()
            return out

        run._boxed_call = True
        return run

    def __call__(self, gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=self.compiler, bw_compiler=self.compiler,
                                     decompositions=_DECOMPS)

    def externs(self):
        return [n for g in self.graphs for n in g.nodes.values() if isinstance(n, Extern)]


def compile_run(fn, *inputs, dynamic=False):
    torch._dynamo.reset()
    rec = Recorder()
    compiled = torch.compile(fn, backend=rec, fullgraph=True, dynamic=dynamic)
    out = compiled(*inputs)
    return out, rec


# ---------------------------------------------------------------- comparison

_TOL = {  # (atol, rtol) floor per dtype
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (8e-3, 8e-3),
}


def to_fp64(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().to(torch.float64)
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (list, tuple)):
        return type(x)(to_fp64(v) for v in x)
    return x


def flatten(x):
    if isinstance(x, (list, tuple)):
        return [v for item in x for v in flatten(item)]
    return [x]


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    d = (a.double() - b.double()).abs()
    d = d[torch.isfinite(d)]
    return d.max().item() if d.numel() else 0.0


def assert_close_fp64(actual, expected, ref64, name="output", factor=3.0):
    """`actual` (compiled) must be no further from the fp64 reference than eager
    (`expected`) is, times `factor`, or within the dtype's tolerance."""
    assert isinstance(actual, torch.Tensor), f"{name}: got {type(actual).__name__}"
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != eager {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != eager {expected.dtype}"
    if not expected.is_floating_point():
        assert torch.equal(actual, expected), f"{name}: integer/bool result differs from eager:\n{actual}\n{expected}"
        return
    # non-finite values must agree with eager exactly
    nf = ~torch.isfinite(expected)
    assert torch.equal(nf, ~torch.isfinite(actual)), f"{name}: non-finite positions differ from eager"
    if nf.any():
        assert torch.equal(actual[nf].isnan(), expected[nf].isnan()), f"{name}: nan positions differ"
        inf = nf & ~expected.isnan()
        assert torch.equal(actual[inf], expected[inf]), f"{name}: inf values differ"
    ref64 = ref64.to(torch.float64)
    finite = torch.isfinite(expected) & torch.isfinite(ref64)
    a, e, r = actual[finite], expected[finite], ref64[finite]
    if a.numel() == 0:
        return
    atol, rtol = _TOL.get(expected.dtype, (1e-5, 1e-5))
    scale = r.abs().max().item()
    tol = atol + rtol * scale
    err = _max_err(a, r)
    eager_err = _max_err(e, r)
    ok = err <= max(factor * eager_err, tol)
    if not ok:  # the same rounding as eager is also fine
        ok = _max_err(a, e) <= tol
    assert ok, (f"{name}: max error vs fp64 {err:.3g} > max({factor} x eager's {eager_err:.3g}, tol {tol:.3g})")


def check(fn, *inputs, dynamic=False, allow_extern=(), factor=3.0, expect_graphs=None, names=None):
    """Compile `fn`, run it, compare every output with eager by the fp64 rule and assert that
    no Extern node appears (except ops named in `allow_extern`). `names` labels the outputs in
    failure messages. Returns the recorder."""
    expected = fn(*inputs)
    try:
        ref64 = fn(*to_fp64(list(inputs)))
    except RuntimeError:  # the function does not accept fp64 (explicit dtype arguments)
        ref64 = expected
    actual, rec = compile_run(fn, *inputs, dynamic=dynamic)
    exp_l, act_l, ref_l = flatten(expected), flatten(actual), flatten(ref64)
    assert len(exp_l) == len(act_l), f"{len(act_l)} outputs, eager has {len(exp_l)}"
    for k, (a, e, r) in enumerate(zip(act_l, exp_l, ref_l)):
        label = f"output {k}" + (f" ({names[k]})" if names is not None and k < len(names) else "")
        if isinstance(e, torch.Tensor):
            assert_close_fp64(a, e, r, name=label, factor=factor)
        elif isinstance(e, float):
            assert math.isclose(a, e, rel_tol=1e-6) or (math.isnan(a) and math.isnan(e))
        else:
            assert a == e, f"output {k}: {a} != {e}"
    bad = [n for n in rec.externs() if not any(s in n.target_name for s in allow_extern)] \
        if not isinstance(allow_extern, bool) else []
    assert not bad, "unexpected extern calls: " + ", ".join(f"{n.target_name} ({n.reason})" for n in bad
                                                             if isinstance(n, Extern))
    if expect_graphs is not None:
        assert len(rec.graphs) == expect_graphs
    return rec


# ---------------------------------------------------------------- inputs


def rand(*shape, dtype=torch.float32, low=-3.0, high=3.0, gen=None):
    """Random values (never all zeros/ones), rounded to `dtype`."""
    if dtype.is_floating_point:
        return (torch.rand(*shape, generator=gen, dtype=torch.float64) * (high - low) + low).to(dtype)
    if dtype == torch.bool:
        return torch.rand(*shape, generator=gen) > 0.5
    return torch.randint(int(low), int(high) + 1, shape, generator=gen, dtype=dtype)


def positive(*shape, dtype=torch.float32, low=0.1, high=4.0):
    return rand(*shape, dtype=dtype, low=low, high=high)


def noncontig(*shape, dtype=torch.float32, kind="t", **kw):
    """A non-contiguous tensor of `shape`: transposed ("t") or sliced with a step ("s")."""
    if kind == "t":
        base = rand(*reversed(shape), dtype=dtype, **kw) if len(shape) >= 2 else rand(*shape, dtype=dtype, **kw)
        out = base.permute(*reversed(range(len(shape)))) if len(shape) >= 2 else base
    else:
        big = list(shape)
        big[-1] = big[-1] * 2
        out = rand(*big, dtype=dtype, **kw)[..., ::2]
    assert tuple(out.shape) == tuple(shape)
    return out


# ---------------------------------------------------------------- ops that core ATen decomposes


def check_traced(fn, *inputs, allow_extern=()):
    """Lower `fn` traced by make_fx *without* decompositions (for ops, such as most backward
    ops, that torch.compile's core-ATen graphs never contain) and compare with eager."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    graph = verify(lower_fx(gm))
    actual = interpret(graph, list(inputs))
    expected = fn(*inputs)
    try:
        ref64 = fn(*to_fp64(list(inputs)))
    except RuntimeError:
        ref64 = expected
    for k, (a, e, r) in enumerate(zip(flatten(actual), flatten(expected), flatten(ref64))):
        if isinstance(e, torch.Tensor):
            assert_close_fp64(a, e, r, name=f"output {k}")
    bad = [n for n in graph.nodes.values()
           if isinstance(n, Extern) and not any(s in n.target_name for s in allow_extern)]
    assert not bad, "unexpected extern calls: " + ", ".join(f"{n.target_name} ({n.reason})" for n in bad)
    return graph, gm


def check_training(make_model, *inputs, allow_extern=(), dynamic=False, factor=3.0):
    """Compile a module, run forward and backward, compare the loss and every parameter's
    gradient with eager by the fp64 rule. Returns the recorder (forward and backward graphs)."""
    import copy

    torch.manual_seed(1)
    model = make_model()
    eager_model = copy.deepcopy(model)
    ref_model = copy.deepcopy(model).double()
    torch._dynamo.reset()
    rec = Recorder()
    compiled = torch.compile(model, backend=rec, fullgraph=True, dynamic=dynamic)
    loss = compiled(*inputs)
    loss.backward()
    eager_loss = eager_model(*inputs)
    eager_loss.backward()
    ref_loss = ref_model(*to_fp64(list(inputs)))
    ref_loss.backward()
    assert_close_fp64(loss.detach(), eager_loss.detach(), ref_loss.detach(), name="loss", factor=factor)
    for (name, p), pe, pr in zip(model.named_parameters(), eager_model.parameters(), ref_model.parameters()):
        assert p.grad is not None, name
        assert_close_fp64(p.grad, pe.grad, pr.grad, name=f"grad {name}", factor=factor)
    assert len(rec.graphs) == 2, "expected a forward and a backward graph"
    bad = [n for n in rec.externs() if isinstance(n, Extern) and not any(s in n.target_name for s in allow_extern)]
    assert not bad, "unexpected extern calls: " + ", ".join(f"{n.target_name} ({n.reason})" for n in bad)
    return rec
