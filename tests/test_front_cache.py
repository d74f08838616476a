"""The front cache: a graph compiled before reaches its stored compiled graphs from Dynamo's
graph, without AOTAutograd's trace, and gives eager's results on new data — a training graph
its outputs and gradients, through the autograd function rebuilt from the entry; graphs whose
AOTAutograd wrapper does work (aliased outputs, symbolic shapes; input writes beyond a version
bump) or that name
a function whose body their code does not show are never served from it; what the result
depends on (shapes, numbers in the graph's code, autocast) changes the key."""
import copy

import pytest
import torch
import torch._functorch.aot_autograd as aot_autograd

import tilefuse
from tilefuse import api, front_cache


class CallsCounted:
    """How many times `owner.attribute` was called while the test ran."""

    def __init__(self, monkeypatch, owner, attribute: str):
        self.count = 0
        real = getattr(owner, attribute)

        def counted(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, attribute, counted)


def TracesCounted(monkeypatch):  # noqa: N802 — reads as the count it is
    """How many times AOTAutograd traced a graph."""
    return CallsCounted(monkeypatch, aot_autograd, "aot_module_simplified")


def LeanRunners(monkeypatch):  # noqa: N802
    """How many compiled graphs were handed to Dynamo without AOTAutograd's wrapper."""
    return CallsCounted(monkeypatch, api, "_without_grad")


def compiled_twice(fn, make_args, tmp_path, monkeypatch, **options):
    """Compile and run `fn` in two fresh Dynamo compiles sharing a cache; returns (outputs of the
    second compile on new inputs, those inputs, the number of AOTAutograd traces in each)."""
    traces = TracesCounted(monkeypatch)
    counts = []
    for _ in range(2):
        torch._dynamo.reset()
        before = traces.count
        args = make_args()
        out = tilefuse.compile(fn, fallback="error", cache_dir=str(tmp_path), graph_cache=True, **options)(*args)
        counts.append(traces.count - before)
    return out, args, counts


def _close(out, fn, args):
    ref = fn(*(a.double() if a.is_floating_point() else a for a in args))
    for o, r in zip(out if isinstance(out, (tuple, list)) else [out], ref if isinstance(ref, (tuple, list)) else [ref]):
        torch.testing.assert_close(o.double(), r, atol=1e-4, rtol=1e-4)


def logits_view(x, w):
    """A product's result returned as a view (HF's logits reshaped after the head)."""
    return (torch.relu(x.reshape(-1, x.shape[-1]) @ w)).view(x.shape[0], x.shape[1], -1) * 2


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_a_second_compile_skips_aotautograd(tmp_path, monkeypatch, target):
    make = lambda: (torch.randn(3, 7, 24), torch.randn(24, 17))  # noqa: E731
    out, args, counts = compiled_twice(logits_view, make, tmp_path, monkeypatch, target=target)
    assert counts == [1, 0], counts
    _close(out, logits_view, args)
    assert out.shape == (3, 7, 17)
    assert any((tmp_path / "front").rglob("entry.json"))  # (in the compile's own cache directory)
    report = tilefuse.last_compilations().reports[-1]
    assert "front cache" in report.stage_seconds and report.cached


def test_dynamos_graph_names_the_device_of_its_inputs():
    """The front cache serves Dynamo's graph, whose placeholders hold `example_value`, not
    AOTAutograd's `val`: the graphs it loads run where the inputs are (a GPU graph loaded for
    the CPU allocated its buffers there, and its first launch failed in every warm process)."""
    seen = []

    def backend(gm, example_inputs):
        seen.append(api._device_of(gm))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda x, y: x * 2 + y, backend=backend)(torch.randn(3, device="meta"), torch.randn(3, device="meta"))
    torch._dynamo.reset()
    torch.compile(lambda x: x * 2, backend=backend)(torch.randn(3))
    assert seen == [torch.device("meta"), torch.device("cpu")], seen


def _mutates(cache, pos, new):
    cache.index_copy_(0, pos, new)
    return cache.sum(0) * 2


def _train_step(x, w):
    return (x @ w).tanh().sum()


def _aliased_training_output(x, w):
    h = torch.tanh(x @ w)
    return h.sum(), h.t()  # (a view of an intermediate: AOTAutograd rebuilds it after the call)


@pytest.mark.parametrize("case", ["symbolic", "training view", "training verify"])
def test_graphs_with_a_runtime_wrapper_always_trace(tmp_path, monkeypatch, case):
    options = {}
    if case == "symbolic":
        fn = logits_view
        make = lambda: (torch.randn(3, 7, 24), torch.randn(24, 17))  # noqa: E731
        options["dynamic"] = True
    else:
        fn = _aliased_training_output if case == "training view" else _train_step
        make = lambda: (torch.randn(6, 8), torch.randn(8, 3, requires_grad=True))  # noqa: E731
        if case == "training verify":
            options["verify"] = True
    out, args, counts = compiled_twice(fn, make, tmp_path, monkeypatch, **options)
    if case.startswith("training"):
        torch.autograd.backward(out[0] if isinstance(out, tuple) else out)
    else:
        _close(out, fn, args)
    assert counts == [1, 1], counts
    assert not (tmp_path / "front").exists() or not any((tmp_path / "front").rglob("entry.json"))


def _several_outputs(x, w, b, scale):
    """Outputs of every kind a training graph returns: a loss, an activation whose gradient
    comes laid out otherwise (a sum's gradient is an expanded scalar), an unused one (its
    gradient made of zeros), an integer one (not differentiable), and an input that does not
    require grad (`scale`: its gradient None)."""
    h = torch.nn.functional.gelu(x @ w + b) * scale
    return (h * h).mean(), h + 1, h.exp(), h.argmax(-1)


def _step(fn, args):
    loss, act, _unused, index = fn(*args)
    (loss + act.sum()).backward()
    return [loss, act, index] + [a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad]


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_a_training_graph_skips_aotautograd_the_second_time(tmp_path, monkeypatch, target):
    def step(compiled):
        args = (torch.randn(5, 7), torch.randn(7, 11, requires_grad=True), torch.randn(11, requires_grad=True),
                torch.rand(11) + 0.5)
        ref_args = [a.detach().double().requires_grad_(a.requires_grad) for a in args]
        return _step(compiled, args), _step(_several_outputs, ref_args)

    results = _served_twice(_several_outputs, step, tmp_path, monkeypatch, target=target)
    assert [count for count, _ in results] == [1, 0]
    for _, (got, ref) in results:
        assert got[2].dtype == torch.int64 and torch.equal(got[2], ref[2])
        for g, r in zip(got[:2] + got[3:], ref[:2] + ref[3:]):
            torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-4)
    served = results[1][1][0]
    assert served[1].grad_fn is not None and served[2].grad_fn is None
    reports = tilefuse.last_compilations(2).reports
    assert all(r.cached for r in reports) and "front cache" in reports[0].stage_seconds


def _two_layers(x, w1, w2):
    return torch.relu(x @ w1) @ w2


def test_a_training_entry_is_written_once_both_halves_ran(tmp_path, monkeypatch):
    """Until the backward has run, a training graph has no entry (its backward compiles then)."""
    make = lambda: (torch.randn(4, 6), torch.randn(6, 9, requires_grad=True), torch.randn(9, 3))  # noqa: E731
    traces = TracesCounted(monkeypatch)
    entries = lambda: list((tmp_path / "front").rglob("entry.json")) if (tmp_path / "front").exists() else []  # noqa: E731
    for backward, traced, written in [(False, 1, False), (True, 1, True), (True, 0, True)]:
        torch._dynamo.reset()
        before = traces.count
        args = make()
        out = tilefuse.compile(_two_layers, fallback="error", cache_dir=str(tmp_path), graph_cache=True)(*args)
        if backward:
            out.square().sum().backward()
            ref_w1 = args[1].detach().double().requires_grad_()
            _two_layers(args[0].double(), ref_w1, args[2].double()).square().sum().backward()
            torch.testing.assert_close(args[1].grad.double(), ref_w1.grad, atol=1e-4, rtol=1e-4)
        assert (traces.count - before, bool(entries())) == (traced, written)


def test_autocast_is_in_the_key_and_off_inside_the_call(tmp_path, monkeypatch):
    """A graph traced under autocast is stored under autocast's state and runs its compiled code
    with autocast off, as AOTAutograd runs it; the same graph without autocast is another key."""
    fn = lambda x, w: torch.softmax(x @ w, -1)  # noqa: E731
    make = lambda: (torch.randn(6, 8), torch.randn(8, 3))  # noqa: E731
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, args, counts = compiled_twice(fn, make, tmp_path, monkeypatch)
        ref = fn(*args)
    assert counts == [1, 0]
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    out, args, counts = compiled_twice(fn, make, tmp_path, monkeypatch)
    assert counts == [1, 0] and out.dtype == torch.float32
    _close(out, fn, args)


def test_the_key_follows_shapes_and_constants(tmp_path, monkeypatch):
    table = torch.randn(17)
    scale = {"value": 2.5}

    def with_constants(x):  # a tensor it reads (Dynamo passes it in) and a number in its code
        return x * table + torch.full((17,), scale["value"])

    make = lambda: (torch.randn(4, 17),)  # noqa: E731
    out, args, counts = compiled_twice(with_constants, make, tmp_path, monkeypatch)
    assert counts == [1, 0]
    _close(out, with_constants, args)
    table.copy_(torch.randn(17))  # new values of an input: the same entry, the new values read
    out, args, counts = compiled_twice(with_constants, make, tmp_path, monkeypatch)
    assert counts == [0, 0]
    _close(out, with_constants, args)
    scale["value"] = -1.5  # another number in the graph's code: another key
    out, args, counts = compiled_twice(with_constants, make, tmp_path, monkeypatch)
    assert counts == [1, 0]
    _close(out, with_constants, args)
    traces = TracesCounted(monkeypatch)
    torch._dynamo.reset()
    x = torch.randn(5, 17)  # another shape
    torch.testing.assert_close(tilefuse.compile(with_constants, cache_dir=str(tmp_path), graph_cache=True)(x),
                               with_constants(x))
    assert traces.count == 1


def test_an_entry_whose_graph_is_gone_compiles_again(tmp_path, monkeypatch):
    make = lambda: (torch.randn(3, 7, 24), torch.randn(24, 17))  # noqa: E731
    compiled_twice(logits_view, make, tmp_path, monkeypatch)
    for entry in (tmp_path / "graphs").iterdir():  # the front entry now names a missing graph
        if entry.is_dir():
            for f in entry.rglob("*"):
                if f.is_file():
                    f.unlink()
    out, args, counts = compiled_twice(logits_view, make, tmp_path, monkeypatch)
    assert counts[0] == 1
    _close(out, logits_view, args)


def test_plain_runtime_reads_aotautograds_metadata():
    class Input:
        mutates_data = mutates_metadata = False

    def meta(**changes):
        fields = dict(num_outputs_aliased=0, num_mutated_inp_runtime_indices=0, num_intermediate_bases=0,
                      tokens={}, grad_enabled_mutation=None, is_rng_op_functionalized=False,
                      input_info=[Input()], subclass_inp_meta=[0])
        fields.update(changes)
        return type("Meta", (), fields)()

    assert front_cache.plain_runtime(meta(), 2, 2)
    assert not front_cache.plain_runtime(meta(), 3, 2)  # (a lifted or duplicated argument)
    assert not front_cache.plain_runtime(meta(num_outputs_aliased=1), 2, 2)
    assert not front_cache.plain_runtime(meta(grad_enabled_mutation=False), 2, 2)
    from torch._functorch._aot_autograd.schemas import MutationType

    written = Input()
    written.mutates_data = True
    written.mutation_type = MutationType.MUTATED_OUT_GRAPH
    assert not front_cache.plain_runtime(meta(input_info=[written]), 2, 2)
    assert not front_cache.plain_runtime(meta(input_info=[written]), 2, 2, writes_in_graph=True)
    in_graph = Input()
    in_graph.mutates_data = True
    in_graph.mutation_type = MutationType.MUTATED_IN_GRAPH
    assert not front_cache.plain_runtime(meta(input_info=[in_graph]), 2, 2)
    assert front_cache.plain_runtime(meta(input_info=[in_graph]), 2, 2, writes_in_graph=True)
    resized = Input()  # (a metadata write, `x.t_()`: AOTAutograd's wrapper redoes it)
    resized.mutates_data, resized.mutates_metadata = False, True
    resized.mutation_type = MutationType.MUTATED_OUT_GRAPH
    assert not front_cache.plain_runtime(meta(input_info=[resized]), 2, 2, writes_in_graph=True)
    partial = meta()
    del type(partial).tokens  # (a PyTorch naming it otherwise: not known plain)
    assert not front_cache.plain_runtime(partial, 2, 2)
    assert not front_cache.plain_runtime(None, 2, 2)


_SCALE = {"k": 2.0}


@torch.compiler.allow_in_graph
def _opaque_helper(x):
    return x * _SCALE["k"]


def _calls_opaque(x):
    return torch.relu(_opaque_helper(x)) + 1


def test_a_function_the_graph_only_names_always_traces(tmp_path, monkeypatch):
    """`allow_in_graph` puts a Python function in Dynamo's graph by name; AOTAutograd traces
    its body, which the graph's code does not show: such graphs are never served from the front
    cache, so a change of the function's behaviour is compiled anew."""
    make = lambda: (torch.randn(5, 9),)  # noqa: E731
    out, args, counts = compiled_twice(_calls_opaque, make, tmp_path, monkeypatch)
    assert counts == [1, 1]
    _SCALE["k"] = 3.0
    try:
        out, args, counts = compiled_twice(_calls_opaque, make, tmp_path, monkeypatch)
        torch.testing.assert_close(out, _calls_opaque(*args))
    finally:
        _SCALE["k"] = 2.0
    assert not (tmp_path / "front").exists() or not any((tmp_path / "front").rglob("entry.json"))


class _Block(torch.nn.Module):
    """A pre-norm residual MLP block: parameters reach the graph as inputs (Dynamo lifts them)."""

    def __init__(self, width: int = 12):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 3 * width)
        self.down = torch.nn.Linear(3 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def test_a_module_trained_from_the_front_cache_matches_eager(tmp_path, monkeypatch):
    """Two steps of SGD on a module, in a compile that traces and in one served from the front
    cache: the same losses and weights as eager's steps (the optimizer writes the parameters
    in place between steps, as a training loop does)."""
    traces = TracesCounted(monkeypatch)
    for expected in (1, 0):
        torch._dynamo.reset()
        before = traces.count
        torch.manual_seed(3)
        model = _Block()
        reference = copy.deepcopy(model).double()
        compiled = tilefuse.compile(model, fallback="error", cache_dir=str(tmp_path), graph_cache=True)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
        for _ in range(2):
            x = torch.randn(2, 5, 12)
            for m, opt, inp in [(compiled, optimizers[0], x), (reference, optimizers[1], x.double())]:
                opt.zero_grad()
                m(inp).square().mean().backward()
                opt.step()
        assert traces.count - before == expected
        for p, r in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.double(), r, atol=1e-5, rtol=1e-5)


def _served_twice(fn, step, tmp_path, monkeypatch, **options):
    """`step(compiled fn)` in a compile that traces, then in one served from the front cache;
    returns [(traces, step's result)] of each."""
    traces = TracesCounted(monkeypatch)
    results = []
    for _ in range(2):
        torch._dynamo.reset()
        before = traces.count
        result = step(tilefuse.compile(fn, fallback="error", cache_dir=str(tmp_path), graph_cache=True, **options))
        results.append((traces.count - before, result))
    return results


def test_double_backward_is_refused_not_cut(tmp_path, monkeypatch):
    """A gradient penalty differentiates the gradients: AOTAutograd refuses it, and so must a
    served graph, never giving a gradient of None without a word."""
    def penalty(compiled):
        w = torch.randn(5, 3, requires_grad=True)
        g, = torch.autograd.grad(compiled(torch.randn(4, 5), w), w, create_graph=True)
        with pytest.raises(RuntimeError, match="double backward"):
            (g ** 2).sum().backward()
        return g.requires_grad

    results = _served_twice(_train_step, penalty, tmp_path, monkeypatch)
    assert results == [(1, True), (0, True)]


def _gated(h, w):
    return ((h > 0).float() * w).sum()


def test_inputs_without_a_gradient_are_detached(tmp_path, monkeypatch):
    """An input that requires grad but gets none from the graph (read only through a comparison)
    is cut from the graph, as AOTAutograd cuts it: its producer's graph, already freed by an
    earlier backward, is never walked."""
    def step(compiled):
        a = torch.randn(6, requires_grad=True)
        h = a.exp()
        h.sum().backward()  # frees h's graph
        w = torch.randn(6, requires_grad=True)
        compiled(h, w).backward()
        torch.testing.assert_close(w.grad, (h > 0).float())
        return a.grad is not None

    assert _served_twice(_gated, step, tmp_path, monkeypatch) == [(1, True), (0, True)]


_INNER = {"c": 2.0}


def _inner_region(x):
    return torch.sin(x) * _INNER["c"]


def _outer_region(x, w):
    return torch.utils.checkpoint.checkpoint(_inner_region, x @ w, use_reentrant=False) + 1


def _nested_checkpoints(x, w):
    return torch.utils.checkpoint.checkpoint(_outer_region, x, w, use_reentrant=False).sum()


def test_a_subgraph_inside_a_subgraph_is_in_the_key(tmp_path, monkeypatch):
    """A checkpointed region inside another: the inner region is an attribute of the outer one's
    graph; a number in its code is in the key, so a change of it compiles anew."""
    x, w = torch.randn(2, 3), torch.randn(3, 2)

    def step(compiled):
        loss = compiled(x, w.detach().requires_grad_())
        loss.backward()
        return loss.item()

    try:
        for c in (2.0, 5.0):
            _INNER["c"] = c
            results = _served_twice(_nested_checkpoints, step, tmp_path, monkeypatch)
            assert [count for count, _ in results] == [1, 0]
            for _, value in results:
                assert value == pytest.approx(_nested_checkpoints(x, w).item(), rel=1e-5)
    finally:
        _INNER["c"] = 2.0


def test_a_backward_compiled_under_other_knobs_is_not_stored(tmp_path, monkeypatch):
    """The entry is keyed on the forward's knobs; a backward compiled (when it first ran) under
    others would be served to a process that never asked for them: no entry is written."""
    def step(compiled):
        x, w = torch.randn(6, 8), torch.randn(8, 3, requires_grad=True)
        loss = compiled(x, w)
        with tilefuse.config.patch(target="interpret"):
            loss.backward()
        return True

    assert _served_twice(_train_step, step, tmp_path, monkeypatch) == [(1, True), (1, True)]


def _scores(q, k):
    return (q @ k.transpose(-1, -2)).sin().sum()


def _transposed(x):
    return x.t() + torch.ones(x.shape[1], x.shape[0])


@pytest.mark.parametrize("fn,shapes", [(_scores, ((2, 4, 4), (2, 5, 4))), (_transposed, ((4, 5),))],
                         ids=["view-of-a-product", "view-of-a-tangent"])
def test_a_backward_whose_gradients_are_views_is_served_with_them(tmp_path, monkeypatch, fn, shapes):
    """A backward that gives a gradient back as a view — of a product (the gradient of `k` in
    `q @ k.transpose(-1, -2)`) or of the incoming gradient — is rebuilt the same way from the
    front cache: its views are in the entry (served without them, the gradient came back
    untransposed: wrong values, or a shape autograd refused)."""
    def step(compiled):
        args = [torch.randn(s, requires_grad=True) for s in shapes]
        ref_args = [a.detach().double().requires_grad_() for a in args]
        out = compiled(*args)
        incoming = torch.randn(out.shape)  # (a non-scalar output's gradient: the tangent it views)
        got = torch.autograd.grad(out, args, incoming)
        want = torch.autograd.grad(fn(*ref_args), ref_args, incoming.double())
        return got, want

    results = _served_twice(fn, step, tmp_path, monkeypatch, target="cpu")
    assert [count for count, _ in results] == [1, 0]
    for _, (got, want) in results:
        for g, w in zip(got, want):
            assert g.shape == w.shape
            torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-5)


def test_a_plain_inference_graph_runs_without_aotautograds_wrapper_from_its_first_compile(tmp_path, monkeypatch):
    """A cold compile of a plain inference graph hands Dynamo the runner a warm process would
    take from the front cache: no AOTAutograd wrapper per call, the caller's grad mode kept
    around the call and off inside it, eager's values on new data."""
    lean = LeanRunners(monkeypatch)
    traces = TracesCounted(monkeypatch)
    torch._dynamo.reset()
    fn = tilefuse.compile(logits_view, fallback="error", cache_dir=str(tmp_path), graph_cache=True)
    for _ in range(3):
        args = (torch.randn(3, 7, 24), torch.randn(24, 17))
        out = fn(*args)
        _close(out, logits_view, args)
    assert traces.count == 1 and lean.count == 1  # traced (a cold compile), then handed over lean
    assert torch.is_grad_enabled() and not out.requires_grad
    with torch.no_grad():
        assert fn(torch.randn(3, 7, 24), torch.randn(24, 17)).shape == (3, 7, 17)
    assert torch.is_grad_enabled()


class KVCache(torch.nn.Module):
    """gpt-fast's static cache: buffers written at the given positions, then read whole."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.randn(2, 11, 6))
        self.register_buffer("v", torch.randn(2, 11, 6))

    def forward(self, pos, k, v):
        self.k.index_copy_(1, pos, k)
        self.v[:, pos] = v
        scores = torch.softmax(k @ self.k.transpose(1, 2), -1)
        return scores @ self.v


@pytest.mark.parametrize("target", ["cpu", "interpret"])
@pytest.mark.parametrize("case", ["argument", "buffers", "buffers without grad"])
def test_a_graph_writing_its_inputs_in_place_skips_aotautograd(tmp_path, monkeypatch, target, case):
    """A graph that writes inputs in place itself (AOTAutograd keeps the write in the graph, a
    KV-cache update) is served from the front cache, and from its first compile runs without
    AOTAutograd's wrapper, which would only bump the written inputs' version counters: the
    call bumps them too where autograd sees the write, and writes what eager writes."""
    lean = LeanRunners(monkeypatch)
    traces = TracesCounted(monkeypatch)
    pos = torch.tensor([7, 2, 9])
    for compile_ in range(2):
        torch._dynamo.reset()
        if case == "argument":
            fn, expected_fn = _mutates, _mutates
            make = lambda: (torch.randn(9, 5), torch.tensor([1, 4]), torch.randn(2, 5))  # noqa: E731
            written = lambda args: [args[0]]  # noqa: E731
        else:
            model = KVCache()
            fn, expected_fn = model, copy.deepcopy(model)
            make = lambda: (pos, torch.randn(2, 3, 6), torch.randn(2, 3, 6))  # noqa: E731
            written = lambda args: [model.k, model.v]  # noqa: E731
        compiled = tilefuse.compile(fn, fallback="error", cache_dir=str(tmp_path), graph_cache=True, target=target)
        before = traces.count
        for _ in range(2):
            args = make()
            expected_args = [a.clone() for a in args]
            versions = [t._version for t in written(args)]
            if case == "buffers without grad":
                with torch.no_grad():
                    out = compiled(*args)
                    ref = expected_fn(*expected_args)
            else:
                out, ref = compiled(*args), expected_fn(*expected_args)
            torch.testing.assert_close(out, ref)
            if case == "argument":
                torch.testing.assert_close(args[0], expected_args[0])
            else:
                torch.testing.assert_close(model.k, expected_fn.k)
                torch.testing.assert_close(model.v, expected_fn.v)
            # once each, as eager's one in-place write does (and AOTAutograd's wrapper)
            assert [t._version for t in written(args)] == [v + 1 for v in versions]
        assert traces.count - before == (1 if compile_ == 0 else 0)
    assert lean.count == 2  # (the first compile's lean runner, then the front cache's)


def aliasing(x):
    return torch.relu(x).t(), x.view(-1)


@pytest.mark.parametrize("fn,make", [
    (aliasing, lambda: (torch.randn(4, 5),)),
])
def test_graphs_whose_wrapper_does_work_keep_it(tmp_path, monkeypatch, fn, make):
    """An output that aliases an input: AOTAutograd's wrapper does work for it, and it keeps
    it; the results are eager's."""
    lean = LeanRunners(monkeypatch)
    torch._dynamo.reset()
    compiled = tilefuse.compile(fn, fallback="error", cache_dir=str(tmp_path), graph_cache=True)
    args = make()
    expected_args = [a.clone() for a in args]
    out = compiled(*args)
    ref = fn(*expected_args)
    for o, r in zip(out if isinstance(out, tuple) else [out], ref if isinstance(ref, tuple) else [ref]):
        torch.testing.assert_close(o, r)
    for a, r in zip(args, expected_args):
        torch.testing.assert_close(a, r)
    assert lean.count == 0


def test_a_plain_graph_traced_under_autocast_runs_as_eager_autocast(tmp_path, monkeypatch):
    """Traced under autocast, the graph holds its casts; run without AOTAutograd's wrapper it
    runs with autocast off inside (as that wrapper does), and gives eager autocast's result."""
    def fn(x, w):
        return torch.softmax(x @ w, -1) + x.sum(-1, keepdim=True)

    lean = LeanRunners(monkeypatch)
    torch._dynamo.reset()
    compiled = tilefuse.compile(fn, fallback="error", cache_dir=str(tmp_path), graph_cache=True)
    x, w = torch.randn(6, 32), torch.randn(32, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x, w)
        ref = fn(x, w)
        assert torch.is_autocast_enabled("cpu")
    assert lean.count == 1 and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_a_graph_returning_a_tensor_subclass_keeps_aotautograds_wrapper(tmp_path, monkeypatch):
    """A tensor subclass built inside the graph from plain inputs: AOTAutograd compiles its
    flattened inner tensors and its wrapper rebuilds the subclass, so the graph is never keyed
    for the front cache (nor handed over without that wrapper), in the first process or a
    later one."""
    from torch.testing._internal.two_tensor import TwoTensor

    def g(a, b):
        return TwoTensor(a * 2, b + 1)

    lean = LeanRunners(monkeypatch)
    for _ in range(2):  # a cold compile, then one that would find a front-cache entry
        torch._dynamo.reset()
        compiled = tilefuse.compile(g, fallback="error", cache_dir=str(tmp_path), graph_cache=True, fullgraph=True)
        a, b = torch.randn(3), torch.randn(3)
        out = compiled(a, b)
        assert isinstance(out, TwoTensor)
        torch.testing.assert_close(out.a, a * 2)
        torch.testing.assert_close(out.b, b + 1)
    assert lean.count == 0


def test_a_training_graph_runs_as_a_warm_one_after_its_first_steps(tmp_path, monkeypatch):
    """A cold compile of a plain training graph: AOTAutograd's function runs its first two
    steps (the entry is whole once the backward has run), then the same compiled graphs run
    through the front cache's autograd function, as a warm process runs them — each step's
    loss and gradients eager's; nothing compiled again."""
    traces = TracesCounted(monkeypatch)
    torch._dynamo.reset()
    torch.manual_seed(5)
    model = _Block()
    reference = copy.deepcopy(model).double()
    compiled = tilefuse.compile(model, fallback="error", cache_dir=str(tmp_path), graph_cache=True)
    nodes = []
    for _ in range(4):
        x = torch.randn(2, 5, 12)
        out = compiled(x)
        nodes.append(type(out.grad_fn).__name__)
        loss = out.square().mean()
        loss.backward()
        want = reference(x.double()).square().mean()
        want.backward()
        torch.testing.assert_close(loss.double(), want, atol=1e-5, rtol=1e-5)
        for p, r in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.double(), r.grad, atol=1e-5, rtol=1e-5)
            p.grad, r.grad = None, None
    assert traces.count == 1
    assert nodes[:2] == ["CompiledFunctionBackward"] * 2, nodes
    assert nodes[2:] == ["CompiledGraphFunctionBackward"] * 2, nodes
