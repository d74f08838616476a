"""End-to-end: plain PyTorch through torch.compile(backend="tilefuse"), compared with eager
under the fp64 rule, and fusion asserted through tilefuse.explain.

Runs on CPU through the Triton interpreter; set TILEFUSE_TEST_DEVICE=cuda to run the same
suite on a GPU with real Triton kernels.
"""
import os

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.explanation import graph_tag_of

DEVICE = os.environ.get("TILEFUSE_TEST_DEVICE", "cpu")
DTYPES = [torch.float32, torch.bfloat16]


def _to(args, dtype=None):
    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            a = a.to(DEVICE, dtype) if dtype else a.to(DEVICE)
        elif isinstance(a, torch.Tensor):
            a = a.to(DEVICE)
        out.append(a)
    return out


def assert_matches_eager(fn, args, dtype, dynamic=None):
    """Compiled output is no further from the fp64 reference than eager is (plus the dtype's
    tolerance)."""
    args = _to(args, dtype)
    ref = fn(*[a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args])
    eager = fn(*args)
    compiled = torch.compile(fn, backend="tilefuse", dynamic=dynamic)(*args)
    ref, eager, compiled = (x if isinstance(x, (tuple, list)) else (x,) for x in (ref, eager, compiled))
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    for r, e, c in zip(ref, eager, compiled):
        assert c.shape == e.shape and c.dtype == e.dtype
        err_c = (c.double() - r).abs().max().item()
        err_e = (e.double() - r).abs().max().item()
        scale = r.abs().max().item() + 1
        assert err_c <= 2 * err_e + tol * scale, (err_c, err_e)


def rmsnorm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def layernorm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def softmax(x):
    return torch.softmax(x, dim=-1)


def gelu_linear(x, w, b):
    return F.gelu(x @ w + b)


def mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


CASES = {
    "rmsnorm": (rmsnorm, lambda: [torch.randn(13, 67), torch.randn(67)]),
    "layernorm": (layernorm, lambda: [torch.randn(11, 45) * 2 + 1, torch.randn(45), torch.randn(45)]),
    "softmax": (softmax, lambda: [torch.randn(9, 70) * 4]),
    "gelu_linear": (gelu_linear, lambda: [torch.randn(19, 40), torch.randn(40, 24) / 6, torch.randn(24)]),
    "mlp": (mlp, lambda: [torch.randn(10, 32), torch.randn(48, 32) / 5, torch.randn(48), torch.randn(16, 48) / 7,
                          torch.randn(16)]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_eager(name, dtype):
    fn, make = CASES[name]
    assert_matches_eager(fn, make(), dtype)


@pytest.mark.parametrize("name", ["rmsnorm", "softmax", "gelu_linear"])
def test_symbolic_batch_serves_every_size(name):
    """One compiled graph (symbolic batch) serves every batch size: no recompilation."""
    fn, make = CASES[name]
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return tilefuse.dynamo_backend(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=counting_backend, dynamic=True)
    for n in (3, 17, 29):
        args = make()
        args[0] = torch.randn(n, *args[0].shape[1:])
        args = _to(args)
        torch.testing.assert_close(compiled(*args), fn(*args), atol=1e-4, rtol=1e-4)
    assert len(graphs) == 1


def test_non_contiguous_and_broadcast_inputs():
    x = torch.randn(24, 15).t()  # non-contiguous
    y = torch.randn(15, 1)
    assert_matches_eager(lambda a, b: torch.tanh(a) * b + a.sum(-1, keepdim=True), [x, y], torch.float32)


@pytest.mark.parametrize("name,kernels", [("rmsnorm", 1), ("layernorm", 1), ("softmax", 1), ("gelu_linear", 1)])
def test_fusion_through_explain(name, kernels):
    fn, make = CASES[name]
    # fusion structure: the generated contraction (on CPU a large or symbolic product with an
    # epilogue otherwise runs through ATen, its epilogue as a pointwise kernel)
    report = tilefuse.explain(fn, *_to(make()), options={"matmul": "generated"})
    assert len(report.kernels) == kernels, str(report)
    assert not report.externs, report.externs
    if name == "gelu_linear":
        assert report.kernels[0].kind == "contraction"


def test_mlp_has_no_more_kernels_than_matmuls():
    fn, make = CASES["mlp"]
    report = tilefuse.explain(fn, *_to(make()))
    assert len(report.kernels) <= 2, str(report)
    assert not report.externs


def test_explain_prints_graph_kernels_and_times():
    fn, make = CASES["softmax"]
    report = tilefuse.explain(fn, *_to(make()))
    name = report.kernels[0].name
    assert "softmax" in name, name
    summary = str(report)
    tag, short = graph_tag_of(name)
    for needed in (f"named {tag}_", short, "reduction", "time:", "fusion decision"):
        assert needed in summary
    assert report.source(short) == report.source(name)
    verbose = report.format(verbose=True)
    kernel_source = f'extern "C" void {name}(' if report.reports[0].backend == "cpu" else f"def {name}("
    for needed in ("graph IR", kernel_source, "fusion decisions"):
        assert needed in verbose


def test_explain_prints_what_the_lowering_decided():
    # (notes added after the fusion decisions: the flash kernel's skipped key tiles, its
    # re-basing, its row tiles — each once, though tuning and fitting lower the plan again)
    def causal(q, k, v):
        s = q @ k.transpose(-1, -2) * 0.2
        i = torch.arange(s.shape[-2])[:, None]
        j = torch.arange(s.shape[-1])[None, :]
        return torch.softmax(torch.where(j > i, float("-inf"), s), dim=-1) @ v

    q, k, v = (torch.randn(1, 2, 70, 16) for _ in range(3))
    with tilefuse.config.patch(target="cpu", flash_config="16,16,4,1,2"):
        verbose = tilefuse.explain(causal, q, k, v).format(verbose=True)
    section = verbose.split("--- lowering notes", 1)[1].split("\n\n", 1)[0]
    for needed in ("are fully masked for the row block and skipped", "terms take base 0",
                   "each program carries 2 row tiles"):
        assert section.count(needed) == 1, section
