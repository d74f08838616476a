"""A GPU product with an epilogue may run as the library's product (a bias folded in where
`addmm` adds one) followed by the epilogue as its own pointwise kernel: measured against the
fused kernel by the tuner (`impl=split`), forced by `matmul="aten"`. Here on the Triton
interpreter (the GPU code path, with the library's product run by ATen on the CPU), against
eager and an fp64 reference."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from irgraphs import GraphBuilder
from tilefuse.fusion import plan_graph
from tilefuse.fusion.library import choose_library_calls
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import cast, unary
from tilefuse.tile.lower import LoweringOptions, schedule_space
from tilefuse.tile.target import Target
from tilefuse.tune.cost import NOMINAL

SPLIT = {"target": "interpret", "matmul": "aten"}


def gelu_tanh(x):  # Hugging Face's NewGELUActivation, as GPT-2 writes it
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _run(fn, args, options=SPLIT):
    torch._dynamo.reset()
    ex = tilefuse.explain(fn, *args, options=options)
    torch._dynamo.reset()
    out = tilefuse.compile(fn, options=options)(*args)
    ref = fn(*[t.double() for t in args])
    eager_err = (fn(*args).double() - ref).abs().max().item()
    err = (out.double() - ref).abs().max().item()
    assert err <= 2 * eager_err + 1e-5 * ref.abs().max().item(), (err, eager_err)
    return ex


CASES = [
    ("addmm + tanh GELU", lambda x, w, b: gelu_tanh(torch.addmm(b, x, w)), [(37, 24), (24, 45), (45,)], "addmm"),
    ("linear 3-D + GELU", lambda x, w, b: F.gelu(F.linear(x, w, b)), [(3, 11, 24), (45, 24), (45,)], "addmm"),
    ("soft-capped head", lambda x, w: torch.tanh((x @ w.t()) / 30.0) * 30.0, [(37, 24), (53, 24)], "matmul"),
    ("residual", lambda x, w, b, r: r + F.linear(x, w, b), [(37, 24), (45, 24), (45,), (37, 45)], "addmm"),
    ("transposed input", lambda x, w, b: torch.relu(F.linear(x.T, w, b)), [(24, 37), (45, 24), (45,)], "addmm"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,fn,shapes,library", CASES, ids=[c[0] for c in CASES])
def test_split_product_and_epilogue_match_eager(dtype, name, fn, shapes, library):
    args = [(torch.randn(s) * 0.5).to(dtype) for s in shapes]
    ex = _run(fn, args)
    assert [k.kind for k in ex.kernels] == ["aten-matmul", "pointwise"], ex
    note = next(n for n in ex.kernels[0].notes if "the product in the library" in n)
    # bf16: addmm rounds product + bias once, as eager does; fp32: the plain product, the bias in the epilogue
    assert f"torch.{library if dtype == torch.bfloat16 else 'matmul'}(" in note, note


def test_the_epilogue_reads_the_rounded_sum_not_the_product():
    """In bf16 the library's `addmm` result is the epilogue's only read of the product: its
    kernel reads the sum's buffer, not the bias."""
    x, w, b = (torch.randn(s).to(torch.bfloat16) for s in [(37, 24), (24, 45), (45,)])
    ex = _run(lambda x, w, b: gelu_tanh(torch.addmm(b, x, w)), [x, w, b])
    epilogue = ex.kernels[1]
    assert "arg0_1" not in epilogue.source and "ptr_buf4" in epilogue.source, epilogue.source


class _AutocastBlock(torch.nn.Module):
    """BERT's feed-forward block as a training step runs it: fp32 parameters under bf16
    autocast (the biases rounded to bf16 before `addmm`), the first product's biased sum saved
    for the GELU's backward, dropout and a residual after the second."""

    def __init__(self, d):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 3 * d + 5), torch.nn.Linear(3 * d + 5, d)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = F.gelu(self.up(x))
            return (F.dropout(self.down(h), 0.1, training=self.training) + x).float()


def test_an_autocast_training_step_splits_its_products():
    """Both forward products split (the bias's conversion goes to the library call, the stored
    sum leaves the epilogue) and the step's gradients match eager's within its own error, on
    the first call and on later ones (the generated call, converting the bias itself)."""
    torch.manual_seed(0)
    block = _AutocastBlock(24).eval()  # dropout off: the same step in eager and compiled
    x, grad = torch.randn(3, 13, 24), torch.randn(3, 13, 24)

    def step(module, inputs):
        module.zero_grad(set_to_none=True)
        inputs = inputs.clone().requires_grad_()
        out = module(inputs)
        (out * grad).sum().backward()
        return [out, inputs.grad] + [p.grad for p in module.parameters()]

    torch._dynamo.reset()
    ex = tilefuse.explain(block, x.clone().requires_grad_(), options=SPLIT)
    forward = ex.reports[0].kernels
    assert [k.kind for k in forward].count("aten-matmul") == 2, ex
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(block), backend="tilefuse", options=dict(SPLIT, fallback="error"))
    for _ in range(3):  # (the first call runs each step the general way, later ones the generated call)
        got = step(compiled, x)
    eager = step(copy.deepcopy(block), x)
    ref = step(copy.deepcopy(block).double(), x.double())
    for g, e, r in zip(got, eager, ref):
        assert (g.double() - r).abs().max() <= 2 * (e.double() - r).abs().max() + 1e-6


class _ComputedBias(torch.nn.Module):
    """A bias computed from the parameter (`bias * 2`) before autocast rounds it: the rounded
    bias reads an inlined node, which has no buffer for a library call to read."""

    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, 3 * d + 5)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.gelu(F.linear(x, self.lin.weight, self.lin.bias * 2)).float()


def test_a_computed_bias_is_not_read_as_a_buffer():
    torch.manual_seed(0)
    block, x = _ComputedBias(24), torch.randn(3, 13, 24)
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(block), backend="tilefuse", options=dict(SPLIT, fallback="error"))
    for _ in range(3):
        inputs = x.clone().requires_grad_()
        out = compiled(inputs)
        out.sum().backward()
    ref = block.double()(x.double())
    eager = _ComputedBias(24)
    eager.load_state_dict(block.float().state_dict())
    eager_err = (eager(x).double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * eager_err + 1e-6


def test_a_gathered_operand_beside_a_converted_bias_plans():
    """A bias per row gathered from a table (an indirect index) and converted: planning looks
    through conversions of direct reads only."""
    torch.manual_seed(0)
    table, ids = torch.randn(7, 45), torch.randint(0, 7, (37,))
    x, w = (torch.randn(s).to(torch.bfloat16) for s in [(37, 24), (24, 45)])
    fn = lambda table, ids, x, w: torch.relu(torch.addmm(table.to(x.dtype)[ids], x, w))  # noqa: E731
    torch._dynamo.reset()
    out = tilefuse.compile(fn, options=dict(SPLIT, fallback="error"))(table, ids, x, w)
    ref = fn(table.double(), ids, x.double(), w.double())
    eager_err = (fn(table, ids, x, w).double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * eager_err + 1e-5


def test_layers_that_split_alike_share_the_first_layers_product(monkeypatch):
    """Where the tuner chooses the split (`impl=split`, faked here: the interpreter measures
    nothing), a later layer's identical plan reuses the first's choice; its library product is
    reported as the first's copy, so `explain` counts one distinct product, not one a layer."""
    from tilefuse import compiler
    from tilefuse.tile.schedule import Schedule
    from tilefuse.tune.tuner import TuneOutcome

    real = compiler.tune_plan

    def split_when_offered(graph, step, *args, **kwargs):
        choice = getattr(step, "library", None)
        if choice is not None and choice.split is not None:
            return TuneOutcome(Schedule(impl="split"), "measured")
        return real(graph, step, *args, **kwargs)

    monkeypatch.setattr(compiler, "tune_plan", split_when_offered)

    class Layers(torch.nn.Module):
        def __init__(self, d, n):
            super().__init__()
            self.linears = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))

        def forward(self, x):  # (layers over one input: chained, two products fuse into one kernel)
            return tuple(gelu_tanh(linear(x)) for linear in self.linears)

    torch.manual_seed(0)
    model, x = Layers(40, 3).to(torch.bfloat16), torch.randn(29, 40).to(torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad():
        ex = tilefuse.explain(model, x, options={"target": "interpret", "matmul": "auto", "autotune": "1"})
    products = [k for k in ex.reports[0].kernels if k.kind == "aten-matmul"]
    assert len(products) == 3, ex
    assert products[0].shares == "" and products[0].shared_by == 2, ex
    assert [k.shares for k in products[1:]] == [products[0].name] * 2, ex
    distinct = sum(1 for k in ex.reports[0].kernels if not k.shares)
    assert distinct == 2, ex  # one product, one epilogue


def test_symbolic_sizes_split():
    fn = lambda x, w, b: gelu_tanh(F.linear(x, w, b))  # noqa: E731
    w, b = torch.randn(45, 24) * 0.3, torch.randn(45)
    torch._dynamo.reset()
    with tilefuse.config.patch(**SPLIT):
        compiled = torch.compile(fn, backend="tilefuse", dynamic=True)
        for m in (37, 5, 64):
            x = torch.randn(m, 24)
            torch.testing.assert_close(compiled(x, w, b), fn(x, w, b), atol=1e-5, rtol=1e-5)


def test_generated_keeps_the_fused_kernel():
    x, w, b = torch.randn(37, 24), torch.randn(24, 45), torch.randn(45)
    ex = _run(lambda x, w, b: gelu_tanh(torch.addmm(b, x, w)), [x, w, b],
              options={"target": "interpret", "matmul": "generated"})
    assert [k.kind for k in ex.kernels] == ["contraction"]


def _mm_gelu_graph():
    g = GraphBuilder("mm_gelu")
    mm = g.bf16_product(512, 256, 384)
    out = g.ctx.pointwise((512, 384), dt.bfloat16, lambda i: cast(unary("tanh", cast(mm.load(i), dt.float32)), dt.bfloat16))
    return g.output(out)


def test_contraction_space_offers_the_split_once_on_a_gpu():
    from tilefuse.tile.contraction import contraction_time

    graph = _mm_gelu_graph()
    schedule = plan_graph(graph)
    choose_library_calls(graph, schedule, "auto", cpu=False)
    (plan,) = schedule.kernels
    assert plan.library.split is not None and plan.library.how == "measured"
    space = schedule_space(graph, plan, LoweringOptions(target=Target.gpu(sm_count=132)))
    configs = space.schedules()
    assert space.default["impl"] == "generated"
    assert sum(c["impl"] == "split" for c in configs) == 1
    split = next(c for c in configs if c["impl"] == "split")
    # the split pays a pass over the product on top of the library's time
    assert contraction_time(space, split, NOMINAL) > contraction_time(space, split.replace(impl="aten"), NOMINAL)
    none = schedule_space(graph, plan, LoweringOptions(target=Target.gpu(sm_count=132), matmul="generated"))
    assert "impl" not in none.knobs
    cpu = plan_graph(graph)
    choose_library_calls(graph, cpu, "auto", cpu=True)
    assert all(getattr(p.library, "split", None) is None for p in cpu.kernels)
