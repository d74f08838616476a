"""The CUDA-graph runner's bookkeeping, on CPU: a fake recorder stands for CUDA graph capture
with its semantics (capture runs nothing a replay does not; a replay rewrites the captured
outputs over the captured buffers), so warm-up, copies in and out, static inputs, layouts,
the capture bound and refusals are checked against eager without a GPU. Real capture is
checked on the GPU (`docs/benchmarks.md`)."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tilefuse.compiler import CompileReport, compile_fx
from tilefuse.runtime import cuda_graphs
from tilefuse.runtime.cuda_graphs import CudaGraphRunner


class FakeGraph:
    """Replays a recorded run over the same buffers, writing into the captured outputs."""

    def __init__(self, run, outputs):
        self.run, self.outputs, self.replays = run, outputs, 0

    def replay(self):
        self.replays += 1
        for o, new in zip(self.outputs, self.run()):
            if isinstance(o, torch.Tensor):
                o.copy_(new)


class FakeRunner(CudaGraphRunner):
    def __init__(self, *a, fail=None, **k):
        super().__init__(*a, **k)
        self.fail = fail
        self.recorded = []

    def _record(self, run):
        if self.fail:
            raise RuntimeError(self.fail)
        outputs = run()
        for o in outputs:  # a capture computes nothing: only a replay writes the outputs
            if isinstance(o, torch.Tensor) and o.is_floating_point():
                o.fill_(float("nan"))
        graph = FakeGraph(run, outputs)
        self.recorded.append(graph)
        return graph, outputs

    def _uncapturable(self, args):
        return ""


def compiled_graph(fn, *args, dynamic=False):
    gm = make_fx(fn, tracing_mode="symbolic" if dynamic else "fake")(*args)
    return compile_fx(gm, torch.device("cpu"), "forward")


def step(weight, cache, pos, x):
    """A decode-like step: a write into a cache passed as input, then a product over it."""
    cache.index_copy_(0, pos, x)
    return torch.softmax(cache @ weight, -1).sum(0), x * 2


def step_inputs(n=7):
    return torch.randn(5, 3), torch.randn(n, 5), torch.tensor([n - 2]), torch.randn(1, 5)


def test_warm_up_capture_replay_and_copies():
    compiled, _ = compiled_graph(step, *step_inputs())
    report = CompileReport("forward")
    runner = FakeRunner(compiled, static=[0], mutated=[1], report=report)
    weight = torch.randn(5, 3)
    for call in range(5):
        _, cache, pos, x = step_inputs()
        pos = torch.tensor([call % 7])
        ref_cache = cache.clone()
        expected = step(weight, ref_cache, pos, x)
        out = runner(weight, cache, pos, x)
        for got, want in zip(out, expected):
            torch.testing.assert_close(got, want)
        torch.testing.assert_close(cache, ref_cache)  # the write reached the caller's cache
        assert len(runner.recorded) == (0 if call == 0 else 1)  # warm-up first, then one capture
    graph = runner.recorded[0]
    assert graph.replays == 4
    first, second = runner(weight, *step_inputs()[1:]), runner(weight, *step_inputs()[1:])
    assert first[0].data_ptr() != second[0].data_ptr()  # each call's outputs are its own
    assert report.cuda_graphs.startswith("captured")


def test_a_moved_static_input_is_captured_again():
    compiled, _ = compiled_graph(step, *step_inputs())
    runner = FakeRunner(compiled, static=[0], mutated=[1])
    w1, w2 = torch.randn(5, 3), torch.randn(5, 3)
    for weight, captures in ((w1, 0), (w1, 1), (w1, 1), (w2, 2), (w2, 2), (w1, 3)):
        args = step_inputs()[1:]
        expected = step(weight, args[0].clone(), *args[1:])
        out = runner(weight, *args)
        torch.testing.assert_close(out[0], expected[0])
        assert len(runner.recorded) == captures


def test_parameters_are_static():
    compiled, _ = compiled_graph(step, *step_inputs())
    runner = FakeRunner(compiled, static=[], mutated=[1])
    weight = torch.nn.Parameter(torch.randn(5, 3), requires_grad=False)
    for _ in range(3):
        with torch.no_grad():
            runner(weight, *step_inputs()[1:])
    assert runner.static == [0]
    assert 0 not in runner.captures[()].owned and set(runner.captures[()].owned) == {1, 2, 3}


def test_buffers_dynamo_marked_static_are_written_in_place():
    """A module's buffers (a KV cache the step writes into) are marked static by Dynamo: read
    and written where they are, never copied in and back; moved, they are captured again."""
    compiled, _ = compiled_graph(step, *step_inputs())
    runner = FakeRunner(compiled, static=[], mutated=[1])
    weight = torch.randn(5, 3)
    cache = step_inputs()[1]
    torch._dynamo.mark_static_address(cache, guard=False)
    ref_cache = cache.clone()
    for k in range(4):
        _, _, pos, x = step_inputs()
        with torch.no_grad():
            out = runner(weight, cache, pos, x)
        expected = step(weight, ref_cache, pos, x)
        torch.testing.assert_close(out[0], expected[0])
        torch.testing.assert_close(cache, ref_cache)
    assert runner.static == [1] and set(runner.captures[()].owned) == {0, 2, 3}
    moved = ref_cache.clone()
    torch._dynamo.mark_static_address(moved, guard=False)
    _, _, pos, x = step_inputs()
    with torch.no_grad():
        out = runner(weight, moved, pos, x)
    torch.testing.assert_close(out[0], step(weight, ref_cache, pos, x)[0])
    torch.testing.assert_close(moved, ref_cache)
    assert len(runner.recorded) == 2


def test_symbolic_sizes_get_one_capture_per_size_up_to_the_bound(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "MAX_CAPTURES", 2)

    def fn(x, w):
        return torch.relu(x @ w).sum(-1)

    compiled, _ = compiled_graph(fn, torch.randn(6, 4), torch.randn(4, 3), dynamic=True)
    runner = FakeRunner(compiled, static=[1], mutated=[])
    w = torch.randn(4, 3)
    for n in (3, 3, 3, 5, 5, 9, 9, 9, 3):
        x = torch.randn(n, 4)
        torch.testing.assert_close(runner(x, w)[0], fn(x, w))
    assert len(runner.captures) == 2 and len(runner.recorded) == 2  # sizes 3 and 5; 9 past the bound


def test_a_graph_that_cannot_be_captured_runs_uncaptured_and_says_why():
    compiled, _ = compiled_graph(step, *step_inputs())
    report = CompileReport("forward")
    runner = FakeRunner(compiled, static=[0], mutated=[1], report=report,
                        fail="operation not permitted when stream is capturing")
    weight = torch.randn(5, 3)
    for _ in range(3):
        args = step_inputs()[1:]
        expected = step(weight, args[0].clone(), *args[1:])
        torch.testing.assert_close(runner(weight, *args)[0], expected[0])
    assert runner.refused and report.cuda_graphs.startswith("not used: capture failed: RuntimeError")


def test_verify_steps_run_uncaptured():
    compiled, _ = compiled_graph(step, *step_inputs())
    runner = FakeRunner(compiled, static=[0], mutated=[1])
    seen = []
    runner.run(list(step_inputs()), on_step=lambda k, s, b: seen.append(k))
    assert seen and not runner.recorded


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_real_capture_on_a_gpu():
    import tilefuse

    def fn(w, cache, pos, x):
        cache.index_copy_(0, pos, x)
        return torch.softmax(cache @ w, -1)

    w, cache = torch.randn(64, 32, device="cuda"), torch.zeros(16, 64, device="cuda")
    f = tilefuse.compile(fn, mode="reduce-overhead", fallback="error")
    ref_cache = cache.clone()
    for k in range(4):
        x = torch.randn(1, 64, device="cuda")
        pos = torch.tensor([k], device="cuda")
        out = f(w, cache, pos, x)
        torch.testing.assert_close(out, fn(w, ref_cache, pos, x))
        torch.testing.assert_close(cache, ref_cache)
    assert tilefuse.last_compilations(1).reports[0].cuda_graphs.startswith("captured")


def test_expanded_inputs_are_copied_once_per_element():
    def fn(x, b):
        return torch.tanh(x) + b

    b0 = torch.randn(6, 1).expand(6, 4)  # stride 0 along the last dim
    compiled, _ = compiled_graph(fn, torch.randn(6, 4), b0)
    runner = FakeRunner(compiled, static=[], mutated=[])
    for _ in range(4):
        x, b = torch.randn(6, 4), torch.randn(6, 1).expand(6, 4)
        torch.testing.assert_close(runner(x, b)[0], fn(x, b))
    assert len(runner.recorded) == 1 and runner.captures[()].expanded == {1}
