"""The front cache: an inference graph compiled before reaches its stored compiled graph from
Dynamo's graph, without AOTAutograd's trace, and gives eager's results on new data; graphs whose
AOTAutograd wrapper does work (training, input mutations, symbolic shapes, autocast) or that
name a function whose body their code does not show are never served from it; what the result
depends on (shapes, numbers in the graph's code) changes the key."""
import pytest
import torch
import torch._functorch.aot_autograd as aot_autograd

import tilefuse
from tilefuse import api, front_cache


class TracesCounted:
    """How many times AOTAutograd traced a graph inside the block."""

    def __init__(self, monkeypatch):
        self.count = 0
        real = aot_autograd.aot_module_simplified

        def counted(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(aot_autograd, "aot_module_simplified", counted)


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


def _mutates(cache, pos, new):
    cache.index_copy_(0, pos, new)
    return cache.sum(0) * 2


def _train_step(x, w):
    return (x @ w).tanh().sum()


@pytest.mark.parametrize("case", ["input mutation", "training", "symbolic", "autocast"])
def test_graphs_with_a_runtime_wrapper_always_trace(tmp_path, monkeypatch, case):
    options = {}
    if case == "input mutation":
        fn = _mutates
        make = lambda: (torch.randn(9, 5), torch.tensor([1, 4]), torch.randn(2, 5))  # noqa: E731
    elif case == "training":
        fn = _train_step
        make = lambda: (torch.randn(6, 8), torch.randn(8, 3, requires_grad=True))  # noqa: E731
    elif case == "symbolic":
        fn = logits_view
        make = lambda: (torch.randn(3, 7, 24), torch.randn(24, 17))  # noqa: E731
        options["dynamic"] = True
    else:
        fn = lambda x, w: torch.softmax(x @ w, -1)  # noqa: E731
        make = lambda: (torch.randn(6, 8), torch.randn(8, 3))  # noqa: E731
    if case == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, args, counts = compiled_twice(fn, make, tmp_path, monkeypatch)
            ref = fn(*args)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    else:
        out, args, counts = compiled_twice(fn, make, tmp_path, monkeypatch, **options)
        if case != "input mutation":
            _close(out, fn, args)
    assert counts == [1, 1], counts
    assert not (tmp_path / "front").exists() or not any((tmp_path / "front").rglob("entry.json"))


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
    written = Input()
    written.mutates_data = True
    assert not front_cache.plain_runtime(meta(input_info=[written]), 2, 2)
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
