"""What a profile of a compiled model shows: every kernel launch and extern call as a named
range, and kernel names that say which graph and which fused ops (`<graph>_<kind>_<ops>_<k>`,
the graph part its kind and a fingerprint: `forward_3fa2c1`), unique, deterministic, valid
identifiers, with the ops' origins carried through CSE and inlining and the user's source lines
on forward and backward kernels alike."""
import inspect
import keyword
import re

import pytest
import torch
import torch.nn as nn
from backends_on_cpu import CPU_BACKENDS
from irgraphs import GraphBuilder
from torch.profiler import ProfilerActivity, profile

import tilefuse
from tilefuse import api
from tilefuse.fusion import plan_graph
from tilefuse.fusion.naming import MAX_OPS_CHARS, kernel_name
from tilefuse.ir.expr import Unary
from tilefuse.ir.graph import Graph
from tilefuse.ir.identifiers import MAX_GRAPH_TAG, graph_tag
from tilefuse.ir.origin import Origin
from tilefuse.passes import run_passes
from tilefuse.runtime import compiled as compiled_module

IDENTIFIER = re.compile(r"[A-Za-z][A-Za-z0-9]*(_[A-Za-z0-9]+)*")
MAX_NAME = 64  # a derived kernel's suffix included (`_epilogue`)


def _tag(name: str) -> str:
    """The graph part of a kernel name: `forward_3fa2c1`."""
    kind, fingerprint = name.split("_")[:2]
    assert re.fullmatch(r"[0-9a-f]{6}", fingerprint), name
    return f"{kind}_{fingerprint}"


class RMSNormLinear(nn.Module):
    def __init__(self, d=37, out=29):
        super().__init__()
        self.w = nn.Parameter(torch.rand(d) + 0.5)
        self.lin = nn.Linear(d, out)

    def forward(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w  # the RMSNorm line
        return torch.softmax(self.lin(x), -1)


def _place(fn, text: str) -> str:
    """`test_profiler.py:<line> in <fn>` for the line of `fn` that contains `text`."""
    lines, first = inspect.getsourcelines(fn)
    k = next(k for k, line in enumerate(lines) if text in line)
    return f"test_profiler.py:{first + k} in {fn.__name__}: "


def _events(prof) -> set:
    return {e.name for e in prof.events()}


def _explain_profiled(fn, *args, backend):
    """`tilefuse.explain` of `fn(*args)` run under the CPU profiler: (explanation, event names,
    fn's result)."""
    results = []

    def keep(*a):
        out = fn(*a)
        results.append(out)  # a side effect Dynamo replays after the graph
        return out

    torch._dynamo.reset()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ex = tilefuse.explain(keep, *args, options={"target": backend})
    return ex, _events(prof), results[0]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_profiler_shows_every_kernel_by_name(backend):
    torch.manual_seed(0)
    model = RMSNormLinear()
    x = torch.randn(13, 37)
    with torch.no_grad():
        ex, events, out = _explain_profiled(model, x, backend=backend)
        torch.testing.assert_close(out, model(x))
    names = [k.name for k in ex.kernels]
    assert len(names) >= 2, str(ex)
    missing = [n for n in names if n not in events]
    assert not missing, (missing, sorted(events))
    (report,) = ex.reports
    assert f"tilefuse {report.graph_name}" in events  # the graph's own range around its steps
    assert {_tag(n) for n in names} == {_tag(names[0])} and names[0].startswith("forward_"), names
    # the names and the reports say what each kernel computes, and where the program says it
    norm = [k for k in ex.kernels if "rsqrt" in k.ops]
    assert norm and {"pow", "mean", "rsqrt"} <= set(norm[0].ops), [k.ops for k in ex.kernels]
    assert "rsqrt" in norm[0].name and "mean" in norm[0].name, norm[0].name
    assert any("softmax" in n for n in names) and any("addmm" in n for n in names), names
    assert any(line.startswith(_place(RMSNormLinear.forward, "the RMSNorm line")) for line in norm[0].source_lines), \
        norm[0].source_lines
    assert all(line.startswith("test_profiler.py:") for k in ex.kernels for line in k.source_lines)
    if backend == "cpu":
        assert all(f'extern "C" void {k.name}(' in k.source for k in ex.kernels if k.kind != "aten-matmul")
    else:
        assert all(f"def {k.name}(" in k.source for k in ex.kernels)
    # the graph IR shows the ops and lines too, one comment per node
    assert "# rsqrt  (test_profiler.py:" in report.graph_ir, report.graph_ir


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_extern_calls_are_named_ranges(backend):
    def fn(x, w):
        y = torch.nn.functional.conv1d(x, w)  # no lowering: an extern call
        return (y * 2).sum(-1)

    torch.manual_seed(1)
    x, w = torch.randn(3, 5, 19), torch.randn(7, 5, 4)
    ex, events, out = _explain_profiled(fn, x, w, backend=backend)
    torch.testing.assert_close(out, fn(x, w))
    (report,) = ex.reports
    assert report.externs, str(ex)
    tag = _tag(report.kernels[0].name)
    externs = [e for e in events if e.startswith(f"{tag}_extern_")]
    assert externs and all(IDENTIFIER.fullmatch(e) for e in externs), sorted(events)
    assert any("convolution" in e for e in externs), externs


def test_without_a_profiler_the_check_runs_once_per_call_and_no_range_opens(monkeypatch):
    calls = []

    def enabled():
        calls.append(1)
        return False

    def no_range(name):
        raise AssertionError(f"a range was opened for {name} without a profiler")

    monkeypatch.setattr(compiled_module, "profiler_enabled", enabled)
    monkeypatch.setattr(compiled_module, "profiled", no_range)
    torch._dynamo.reset()
    model = RMSNormLinear()
    x = torch.randn(5, 37)
    with torch.no_grad():
        f = tilefuse.compile(model, target="cpu")
        for _ in range(3):
            torch.testing.assert_close(f(x), model(x))
    assert len(calls) == 3  # one check per graph call, however many kernels the graph has


def _kernels_after_reset(fn, *args):
    torch._dynamo.reset()
    ex = tilefuse.explain(fn, *args, options={"target": "cpu"})
    return [r.graph_name for r in ex.reports], [(k.name, k.source) for k in ex.kernels]


def test_names_are_deterministic_across_compiles():
    """The same program compiles to the same kernel names and sources (what the disk caches key
    on), whatever the API numbers its graphs; another program's kernels are named apart."""
    torch.manual_seed(2)
    model = RMSNormLinear(d=23, out=11)
    x = torch.randn(7, 23)
    with torch.no_grad():
        graphs1, first = _kernels_after_reset(model, x)
        graphs2, second = _kernels_after_reset(model, x)
        _, other = _kernels_after_reset(model, torch.randn(7 + 2, 23))  # another shape: another graph
    assert graphs1 != graphs2  # forward<N>, forward<N+1>
    assert first and first == second
    assert {_tag(n) for n, _ in first}.isdisjoint({_tag(n) for n, _ in other})


class Block(nn.Module):
    """Attention and an MLP, with LayerNorms: many kinds of kernels, forward and backward."""

    def __init__(self, d=24, heads=3):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, -1))
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, -1)  # the attention line
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x)), approximate="tanh"))


def _train_step_reports(model, x, backend):
    """One training step of `model` compiled by tilefuse: (compile reports of its forward and
    backward graphs, profiler event names of the step, the loss)."""
    torch._dynamo.reset()
    reports: list = []
    api._report_sinks.append(reports)
    try:
        f = tilefuse.compile(model, target=backend)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss = f(x).pow(2).mean()
            loss.backward()
    finally:
        api._report_sinks.remove(reports)
    return reports, _events(prof), loss


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_backward_kernels_carry_the_users_source_lines(backend):
    torch.manual_seed(3)
    model = Block()
    x = torch.randn(2, 11, 24)
    reports, events, loss = _train_step_reports(model, x, backend)
    ref = Block()
    ref.load_state_dict(model.state_dict())
    ref_loss = ref(x).pow(2).mean()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-5)
    backward = [r for r in reports if r.graph_name.startswith("backward")]
    assert len(backward) == 1, [r.graph_name for r in reports]
    kernels = backward[0].kernels
    assert kernels and all(k.name.startswith("backward_") for k in kernels)
    assert len({_tag(k.name) for k in kernels}) == 1
    missing = [k.name for k in kernels if k.name not in events]
    assert not missing, (missing, sorted(events))
    # the softmax's gradient comes from the attention line of forward() (the attention's
    # backward recomputes the probabilities, `exp`, traced at the softmax's line)
    grads = [k for k in kernels if any("softmax" in op or op == "exp" for op in k.ops)]
    where = _place(Block.forward, "the attention line")
    assert grads and any(line.startswith(where) for k in grads for line in k.source_lines), \
        [(k.name, k.source_lines) for k in kernels]
    assert all(line.startswith("test_profiler.py:") for k in kernels for line in k.source_lines)
    # every name in the process is unique, an identifier in C and Python, and short
    names = [k.name for r in reports for k in r.kernels]
    assert len(set(names)) == len(names), names
    for name in names:
        assert IDENTIFIER.fullmatch(name) and name.isidentifier() and not keyword.iskeyword(name), name
        assert len(name) <= MAX_NAME, name


def test_kernel_names_are_bounded_identifiers_for_any_graph_name_and_ops():
    ops = ["scaled_dot_product_flash_attention_for_cpu", "native_layer_norm_backward", "mul", "add"]
    tags = set()
    for graph_name in ("forward0", "forward1", "backward12", "my graph-1!", "__init__", "0th", "x" * 200, "",
                       "ünïcode"):
        tag = graph_tag(Graph(name=graph_name))
        tags.add(tag)
        assert len(tag) <= MAX_GRAPH_TAG, tag
        for index in (0, 7, 123):
            name = kernel_name(tag, "red", ops, index)
            assert IDENTIFIER.fullmatch(name) and name.isidentifier(), name
            assert len(name) <= MAX_GRAPH_TAG + len("_red_") + MAX_OPS_CHARS + len("_123"), name
            assert name.endswith(f"_{index}")
    assert graph_tag(Graph(name="forward0")) == graph_tag(Graph(name="forward1"))  # the API's count is no part
    assert kernel_name("forward_3fa2c1", "red", ["pow", "mean", "add", "rsqrt", "mul"], 1) == \
        "forward_3fa2c1_red_pow_mean_add_rsqrt_mul_1"
    # plain copies and casts only name a kernel that does nothing else
    assert kernel_name("b_1", "pw", ["to_copy", "gelu_backward", "clone"], 0) == "b_1_pw_gelu_backward_0"
    assert kernel_name("f_1", "pw", ["clone"], 2) == "f_1_pw_clone_2"


def test_origins_survive_cse_and_inlining():
    b = GraphBuilder("g")
    x = b.input("x", (5, 7))
    e1 = b.ctx.pointwise(x.shape, x.dtype, lambda i: Unary("exp", x.load(i), x.dtype))
    e2 = b.ctx.pointwise(x.shape, x.dtype, lambda i: Unary("exp", x.load(i), x.dtype))
    s = b.ctx.pointwise(x.shape, x.dtype, lambda i: e1.load(i) + e2.load(i))
    graph = b.output(s)
    graph.origins[e1.name] = Origin(("exp",), ("m.py:1 in f: a = x.exp()",))
    graph.origins[e2.name] = Origin(("special_exp",), ("m.py:2 in f: b = torch.special.exp2(x)",))
    graph.origins[s.name] = Origin(("add",), ("m.py:3 in f: return a + b",))
    graph = run_passes(graph)
    assert e2.name not in graph.nodes  # merged into e1 by CSE, which now stands for both
    assert graph.origins[e1.name].ops == ("exp", "special_exp")
    assert len(graph.origins[e1.name].lines) == 2
    assert "# exp, special_exp  (m.py:1, m.py:2)" in str(graph), str(graph)
    (kernel,) = plan_graph(graph).kernels  # the exp is inlined into the add's kernel
    assert kernel.origin.ops == ("exp", "special_exp", "add")
    assert kernel.name == f"{graph_tag(graph)}_pw_exp_special_exp_add_0" and kernel.name.startswith("g_")
    assert [line.split(" in ")[0] for line in kernel.origin.lines] == ["m.py:1", "m.py:2", "m.py:3"]


def test_decisions_use_the_final_kernel_names():
    torch.manual_seed(4)
    model = RMSNormLinear(d=19, out=9)
    with torch.no_grad():
        torch._dynamo.reset()
        ex = tilefuse.explain(model, torch.randn(3, 19), options={"target": "cpu"})
    (report,) = ex.reports
    text = "\n".join(report.decisions + [n for k in report.kernels for n in k.notes])
    assert not re.search(r"\bkernel\d+\b", text), text
    assert any(k.name in text for k in report.kernels), text
