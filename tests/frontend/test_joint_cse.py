"""tilefuse's merge of common subexpressions in a training graph's joint forward-backward
(`frontend.joint_cse`): what merges and what must not, agreement with AOTAutograd's own pass
on real joint graphs, and a training compile that never imports Inductor's pattern matcher."""
import operator
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tilefuse.frontend.joint_cse import eliminate_common_subexpressions

aten = torch.ops.aten
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")


def _graph(build, *shapes):
    """A GraphModule of aten calls made by `build(graph, *placeholders)`, with fake values."""
    g = torch.fx.Graph()
    mode = FakeTensorMode()
    phs = []
    for k, shape in enumerate(shapes):
        p = g.placeholder(f"x{k}")
        p.meta["val"] = mode.from_tensor(torch.randn(shape))
        phs.append(p)
    outs = build(g, *phs)
    with mode:
        for node in g.nodes:
            if node.op == "call_function":
                args = torch.fx.node.map_arg(node.args, lambda n: n.meta["val"])
                kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: n.meta["val"])
                node.meta["val"] = node.target(*args, **kwargs)
    g.output(tuple(outs))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def _run(gm, *inputs):
    return gm(*inputs)


def test_repeated_calls_merge_and_the_graph_computes_the_same():
    def build(g, x, y):
        a = g.call_function(aten.mul.Tensor, (x, y))
        b = g.call_function(aten.mul.Tensor, (x, y))  # the same as a
        ea = g.call_function(aten.exp.default, (a,))
        eb = g.call_function(aten.exp.default, (b,))  # the same once b is a
        return [g.call_function(aten.sub.Tensor, (ea, eb)), g.call_function(aten.add.Tensor, (ea, y))]

    gm = _graph(build, (5, 7), (5, 7))
    x, y = torch.randn(5, 7), torch.randn(5, 7)
    expected = _run(gm, x, y)
    assert eliminate_common_subexpressions(gm) == 2
    assert [n.target for n in _calls(gm)] == [aten.mul.Tensor, aten.exp.default, aten.sub.Tensor, aten.add.Tensor]
    for a, e in zip(_run(gm, x, y), expected):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


@pytest.mark.parametrize("first, second", [(0.0, -0.0), (1, 1.0), (True, 1), (2.5, 2.50000001)])
def test_constants_of_another_type_or_spelling_stay_apart(first, second):
    def build(g, x):
        return [g.call_function(aten.mul.Tensor, (x, first)), g.call_function(aten.mul.Tensor, (x, second))]

    gm = _graph(build, (3, 4))
    assert eliminate_common_subexpressions(gm) == 0
    assert len(_calls(gm)) == 2


def test_random_and_uninitialised_values_never_merge():
    def build(g, x):
        return [g.call_function(aten.rand_like.default, (x,)), g.call_function(aten.rand_like.default, (x,)),
                g.call_function(aten.empty_like.default, (x,)), g.call_function(aten.empty_like.default, (x,))]

    gm = _graph(build, (4, 4))
    assert eliminate_common_subexpressions(gm) == 0
    assert len(_calls(gm)) == 4


def test_a_write_between_two_reads_keeps_both():
    def build(g, x, y):
        before = g.call_function(aten.add.Tensor, (x, 1.0))
        g.call_function(aten.copy_.default, (x, y))  # x changes here
        after = g.call_function(aten.add.Tensor, (x, 1.0))
        again = g.call_function(aten.add.Tensor, (x, 1.0))  # the same as `after`
        return [before, g.call_function(aten.mul.Tensor, (after, again))]

    gm = _graph(build, (6,), (6,))
    x, y = torch.randn(6), torch.randn(6)
    expected = _run(gm, x.clone(), y)
    assert eliminate_common_subexpressions(gm) == 1
    for a, e in zip(_run(gm, x.clone(), y), expected):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert not torch.equal(expected[0] * expected[0], expected[1])  # (the write matters: the test can fail)


def test_values_returned_as_separate_outputs_stay_separate():
    def build(g, x):
        a = g.call_function(aten.neg.default, (x,))
        b = g.call_function(aten.neg.default, (x,))
        return [a, b]

    gm = _graph(build, (3,))
    assert eliminate_common_subexpressions(gm) == 0
    a, b = _run(gm, torch.randn(3))
    assert a.data_ptr() != b.data_ptr()


def test_tuple_values_returned_as_separate_outputs_stay_separate():
    """Two `topk` calls whose values are both returned: eager's two tensors, not one."""
    def build(g, x):
        a = g.call_function(aten.topk.default, (x, 3))
        b = g.call_function(aten.topk.default, (x, 3))
        return [g.call_function(operator.getitem, (a, 0)), g.call_function(operator.getitem, (b, 0))]

    gm = _graph(build, (4, 8))
    assert eliminate_common_subexpressions(gm) == 0
    a, b = _run(gm, torch.randn(4, 8))
    assert a.data_ptr() != b.data_ptr()


class _Block(torch.nn.Module):
    def __init__(self, d=24, heads=3):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.out = torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d))
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        s = (q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5).masked_fill(~causal, float("-inf"))
        x = x + self.out((s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm(x))


def test_merges_what_aotautograds_pass_merges_on_a_transformer_block():
    """Real joint graphs: this pass leaves exactly as many calls as AOTAutograd's own."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._decomp import core_aten_decompositions
    from torch._functorch.compile_utils import fx_graph_cse

    counts = []

    def partition(joint, inputs, **kwargs):
        from torch._functorch import partitioners

        theirs = sum(1 for n in fx_graph_cse(joint.graph).nodes if n.op == "call_function")
        before = len(_calls(joint))
        eliminate_common_subexpressions(joint)
        counts.append((before, len(_calls(joint)), theirs))
        return partitioners.default_partition(joint, inputs, **kwargs)

    torch.manual_seed(0)
    model = _Block()
    x = torch.randn(2, 7, 24, requires_grad=True)

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=lambda g, _: g, partition_fn=partition,
                                     decompositions=core_aten_decompositions())

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(x).sum().backward()
    torch._dynamo.reset()
    assert counts and all(ours == theirs < before for before, ours, theirs in counts), counts


def test_a_training_compile_imports_no_inductor_pattern_matcher(tmp_path):
    """The point of the pass: a training graph compiles (recompute on, the min-cut partition)
    with gradients equal to eager's, and Inductor's pattern matcher is never imported."""
    script = textwrap.dedent('''
        import sys, torch, tilefuse
        torch.manual_seed(0)
        lin1, lin2 = torch.nn.Linear(12, 20), torch.nn.Linear(20, 12)
        def step(x):
            h = lin1(x)
            return (lin2(torch.nn.functional.gelu(h)) * h.sum(-1, keepdim=True).sigmoid()).square().mean()
        x = torch.randn(9, 12)
        step(x).backward()
        expected = [p.grad.clone() for p in (*lin1.parameters(), *lin2.parameters())]
        for p in (*lin1.parameters(), *lin2.parameters()):
            p.grad = None
        with tilefuse.config.patch(target="cpu", fallback="error", recompute=True):
            torch.compile(step, backend="tilefuse")(x).backward()
        for p, e in zip((*lin1.parameters(), *lin2.parameters()), expected):
            torch.testing.assert_close(p.grad, e, rtol=1e-4, atol=1e-5)
        assert "torch._inductor.pattern_matcher" not in sys.modules
        print("ok")
    ''')
    env = dict(os.environ, PYTHONPATH=SRC, TILEFUSE_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
