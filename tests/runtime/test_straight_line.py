"""A compiled graph's generated call (`runtime.straight_line`): from the second call of a set
of sizes, calls run a generated function that gives what the general call gives; a buffer
whose layout differs from the one a launch was built for sends that launch the general way; a
launch guard that fails sends the whole call the general way; every set of sizes gets its own
function; the knob turns it off."""
import copy
import re

import pytest
import sympy
import torch

from irgraphs import GraphBuilder
from tilefuse.backends.cpu import find_compiler
from tilefuse.backends.inline_call import SKIP, STREAM, Buf, Expect, InlineCall
from tilefuse.compiler import compile_ir
from tilefuse.config import config
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import cast, size_symbol, unary

needs_cxx = pytest.mark.skipif(find_compiler() is None, reason="no C++ compiler")


def _graph(rows, cols):
    """y = exp(x - rowmax(x)) * w + 1, x's strides read at run time."""
    g = GraphBuilder("sl")
    x = g.input("x", (rows, cols))
    w = g.input("w", (cols,), strides="contiguous")
    m = g.ctx.reduce((rows,), (cols,), "max", lambda i, r: x.load((i[0], r[0])), dt.float32)
    y = g.ctx.pointwise((rows, cols), dt.float32,
                        lambda i: unary("exp", x.load(i) - m.load((i[0],))) * w.load((i[1],)) + 1.0)
    return g.output(y)


def _reference(x, w):
    x, w = x.double(), w.double()
    return (torch.exp(x - x.amax(-1, keepdim=True)) * w + 1).float()


def _compile(graph, target="cpu", **knobs):
    with config.patch(target=target, **knobs):
        compiled, _ = compile_ir(graph, torch.device("cpu"))
    return compiled


def _targets():
    return [pytest.param("cpu", marks=needs_cxx), "interpret"]


@pytest.mark.parametrize("target", _targets())
def test_generated_call_gives_the_general_calls_results(target):
    compiled = _compile(_graph(7, 33), target)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(33, generator=gen)
    for k in range(4):
        x = torch.randn(7, 33, generator=gen)
        (out,) = compiled(x, w)
        torch.testing.assert_close(out, _reference(x, w), rtol=1e-5, atol=1e-5)
        # made by the second call (sizes seen once may never come again), used by the rest
        assert (compiled.generated_call() is not None) == (k >= 1)
    source = compiled.generated_call().__tilefuse_source__
    assert source.startswith("def call(args, env, cg):")
    # CPU buffers through PyTorch's allocation without the dispatcher, where it has one
    assert re.search(r"= empty(_strided)?\(\(7, 33\), \(33, 1\)", source), source


@needs_cxx
def test_a_graph_holding_its_calls_is_freed_at_once():
    """The generated functions take the graph as an argument: no reference cycle keeps a
    dropped graph (its constants, its kernels) alive until the cyclic collector runs."""
    import gc
    import weakref

    compiled = _compile(_graph(5, 8))
    gen = torch.Generator().manual_seed(12)
    w = torch.randn(8, generator=gen)
    for _ in range(3):
        compiled(torch.randn(5, 8, generator=gen), w)
    assert compiled.generated_call() is not None
    ref = weakref.ref(compiled)
    gc.disable()
    try:
        del compiled
        assert ref() is None
    finally:
        gc.enable()


@needs_cxx
def test_a_buffer_with_other_strides_takes_the_general_launch():
    compiled = _compile(_graph(7, 33))
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(33, generator=gen)
    for _ in range(2):
        compiled(torch.randn(7, 33, generator=gen), w)
    source = compiled.generated_call().__tilefuse_source__
    assert "b['x'].stride() == (33, 1)" in source  # the kernel was built for x's strides
    transposed = torch.randn(33, 7, generator=gen).T  # same sizes, other strides: no recompile
    for x in (transposed, torch.randn(7, 33, generator=gen), torch.randn(7, 66, generator=gen)[:, ::2]):
        (out,) = compiled(x, w)
        torch.testing.assert_close(out, _reference(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("target", _targets())
def test_each_set_of_sizes_gets_its_own_call(target):
    rows, cols = size_symbol(0), size_symbol(1)
    compiled = _compile(_graph(rows, cols), target)
    gen = torch.Generator().manual_seed(5)
    for r, c in [(5, 12), (9, 40), (5, 12), (1, 3), (9, 40)]:
        x, w = torch.randn(r, c, generator=gen), torch.randn(c, generator=gen)
        (out,) = compiled(x, w)
        torch.testing.assert_close(out, _reference(x, w), rtol=1e-5, atol=1e-5)
    env = {rows: 9, rows.name: 9, cols: 40, cols.name: 40}
    assert compiled.generated_call(env) is not None
    assert "(9, 40)" in compiled.generated_call(env).__tilefuse_source__


@pytest.mark.parametrize("target", _targets())
def test_the_knob_turns_it_off(target):
    compiled = _compile(_graph(6, 10), target, generated_wrapper=False)  # (a compile's knob)
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(10, generator=gen)
    for _ in range(3):
        x = torch.randn(6, 10, generator=gen)
        torch.testing.assert_close(compiled(x, w)[0], _reference(x, w), rtol=1e-5, atol=1e-5)
    assert compiled.generated_call() is None


@needs_cxx
def test_dead_buffers_of_the_same_layout_are_reused():
    from torch.fx.experimental.proxy_tensor import make_fx

    from tilefuse.compiler import compile_fx

    torch.manual_seed(10)
    model = torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.GELU(), torch.nn.LayerNorm(40),
                                torch.nn.Linear(40, 40), torch.nn.Tanh(), torch.nn.LayerNorm(40),
                                torch.nn.Linear(40, 7)).eval()
    params = [p.detach() for p in model.parameters()]

    def fn(x, *weights):
        return torch.func.functional_call(model, dict(zip(dict(model.named_parameters()), weights)), (x,))

    reference = copy.deepcopy(model).double()
    x = torch.randn(9, 16)
    with torch.no_grad():
        gm = make_fx(fn, tracing_mode="fake")(x, *params)
        with config.patch(target="cpu"):
            compiled, _ = compile_fx(gm, torch.device("cpu"), "forward")
        for _ in range(3):
            x = torch.randn(9, 16)
            (out,) = compiled(x, *params)
            expected = reference(x.double())
            torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert "'s memory" in compiled.generated_call().__tilefuse_source__


def _squared(e):
    return e * e


def _reshaped_graph(b_is_output: bool):
    """a[i, j] = Σk x[i, j, k] (4 × 6), read by a product c = a @ w (a dies), then b[j, i] =
    Σk tanh(y[j, i, k]) (6 × 4: as many bytes as a) — an output, or read by e[j] = max_i b[j, i]
    and f[i] = Σj b[j, i] — and d[j, i] = Σk y[j, i, k]² in float64."""
    g = GraphBuilder("reshaped")
    x = g.input("x", (4, 6, 64), strides="contiguous")
    w = g.input("w", (6, 5), strides="contiguous")
    y = g.input("y", (6, 4, 48), strides="contiguous")
    a = g.ctx.reduce((4, 6), (64,), "sum", lambda i, r: x.load((i[0], i[1], r[0])), dt.float32)
    c = g.ctx.reduce((4, 5), (6,), "sum", lambda i, r: a.load((i[0], r[0])) * w.load((r[0], i[1])), dt.float32)
    b = g.ctx.reduce((6, 4), (48,), "sum", lambda i, r: unary("tanh", y.load((i[0], i[1], r[0]))), dt.float32)
    d = g.ctx.reduce((6, 4), (48,), "sum", lambda i, r: _squared(cast(y.load((i[0], i[1], r[0])), dt.float64)),
                     dt.float64)
    if b_is_output:
        return g.output(c, b, d)
    e = g.ctx.reduce((6,), (4,), "max", lambda i, r: b.load((i[0], r[0])), dt.float32)
    f = g.ctx.reduce((4,), (6,), "sum", lambda i, r: b.load((r[0], i[0])), dt.float32)
    return g.output(c, e, d, f)


def _reshaped_reference(x, w, y, b_is_output: bool):
    x, w, y = x.double(), w.double(), y.double()
    b = torch.tanh(y).sum(-1)
    c, d = (x.sum(-1) @ w).float(), (y ** 2).sum(-1)
    return (c, b.float(), d) if b_is_output else (c, b.amax(-1).float(), d, b.sum(0).float())


@pytest.mark.parametrize("target", _targets())
@pytest.mark.parametrize("b_is_output", [False, True], ids=["intermediate", "output"])
def test_a_dead_buffer_of_as_many_bytes_is_reused_in_another_layout(target, b_is_output):
    """A buffer of another shape over as many bytes of the same type takes a dead buffer's
    memory in its own layout (a tensor of its own over that storage, not a view: a graph output
    too); one of another type does not."""
    compiled = _compile(_reshaped_graph(b_is_output), target)
    gen = torch.Generator().manual_seed(11)
    for _ in range(3):
        x, w, y = (torch.randn(*shape, generator=gen) for shape in ((4, 6, 64), (6, 5), (6, 4, 48)))
        out = compiled(x, w, y)
        for got, want in zip(out, _reshaped_reference(x, w, y, b_is_output)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not any(t._is_view() for t in out)
    source = compiled.generated_call().__tilefuse_source__
    taken = re.findall(r"\['buf\d+'\] = reinterpret\(b\.pop\('buf\d+'\), \(6, 4\), \(4, 1\), 0\)", source)
    assert len(taken) == 1 and source.count("reinterpret(") == 1, source  # (d: float64, a new buffer)


@needs_cxx
def test_without_a_reinterpreting_call_only_the_same_layout_is_reused(monkeypatch):
    """Where PyTorch offers no `_reinterpret_tensor`, memory taken in another layout would be a
    view, which could reach the caller (as an output, or through a chain of takers): only
    buffers of the same layout are reused then."""
    from tilefuse.runtime import straight_line

    monkeypatch.setattr(straight_line, "REINTERPRETS_AS_NEW", False)
    compiled = _compile(_reshaped_graph(False), "cpu")
    gen = torch.Generator().manual_seed(12)
    for _ in range(3):
        x, w, y = (torch.randn(*shape, generator=gen) for shape in ((4, 6, 64), (6, 5), (6, 4, 48)))
        for got, want in zip(compiled(x, w, y), _reshaped_reference(x, w, y, False)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert "reinterpret(" not in compiled.generated_call().__tilefuse_source__


class _Inlined:
    """A stand-in launcher that answers `inline` with a call of its own, recording what the
    generated function passes, and launches the real kernel."""

    def __init__(self, launch, expect: Expect | None = None):
        self.launch = launch
        self.expect = expect
        self.allowed = True
        self.calls, self.general, self.setups, self.streams = [], 0, 0, []

    def __call__(self, buffers, env):
        self.general += 1
        self.launch(buffers, env)

    def inline(self, buffers, env):
        expects = {"x": self.expect} if self.expect is not None else {}
        launch, seen = self.launch, list(buffers)

        def call(stream, *tensors):
            self.streams.append(stream)
            self.calls.append(tuple(t.shape for t in tensors))
            launch(dict(zip(seen, tensors)), env)

        return InlineCall(call, (STREAM, *(Buf(n) for n in seen)), expects, label="stand-in",
                          guard=lambda: self.allowed, setup=self._setup, stream=lambda: 1234)

    def _setup(self):
        self.setups += 1


@needs_cxx
def test_checks_guards_setup_and_stream_reach_the_generated_call():
    compiled = _compile(_graph(4, 9))
    kernel_steps = [s for s in compiled.steps if hasattr(s, "launch")]
    first = kernel_steps[0]
    stand_in = _Inlined(first.launch, Expect((9, 1), aligned=True))
    first.launch = stand_in
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(9, generator=gen)

    def check(x):
        torch.testing.assert_close(compiled(x, w)[0], _reference(x, w), rtol=1e-5, atol=1e-5)

    check(torch.randn(4, 9, generator=gen))  # the general call
    check(torch.randn(4, 9, generator=gen))  # the general call, which records
    assert stand_in.general == 2 and not stand_in.calls
    check(torch.randn(4, 9, generator=gen))  # the generated call
    assert stand_in.general == 2 and len(stand_in.calls) == 1 and stand_in.setups == 1
    assert stand_in.streams == [1234]
    check(torch.randn(9, 4, generator=gen).T)  # x's strides differ: that launch goes the general way
    assert stand_in.general == 3 and len(stand_in.calls) == 1
    storage = torch.randn(40, generator=gen)
    check(storage[1:37].view(4, 9))  # 4 bytes past an aligned base: the promised alignment fails
    assert stand_in.general == 4 and len(stand_in.calls) == 1 and stand_in.setups == 3  # (once per call)
    stand_in.allowed = False  # a launch hook: the whole call goes the general way, set up nothing
    check(torch.randn(4, 9, generator=gen))
    assert stand_in.general == 5 and stand_in.setups == 3


@needs_cxx
def test_a_skipped_launch_is_left_out():
    compiled = _compile(_graph(3, 5))
    first = [s for s in compiled.steps if hasattr(s, "launch")][0]

    class Skipped:
        def __call__(self, buffers, env):
            pass

        def inline(self, buffers, env):
            return SKIP

    real = first.launch
    first.launch = Skipped()
    gen = torch.Generator().manual_seed(8)
    x, w = torch.randn(3, 5, generator=gen), torch.randn(5, generator=gen)
    compiled(x, w)
    compiled(x, w)
    assert f"# {first.name}: nothing to compute" in compiled.generated_call().__tilefuse_source__
    first.launch = real


def test_a_graph_whose_calls_bind_sizes_is_not_generated():
    from tilefuse.ir.graph import Extern
    from tilefuse.runtime.straight_line import plannable

    g = GraphBuilder("binds")
    n = size_symbol(3)
    x = g.input("x", (5,), strides="contiguous")
    graph = g.output(x)
    assert plannable(graph)
    graph.add(Extern("nz", dt.int64, (n, sympy.Integer(1)), target=torch.ops.aten.nonzero.default))
    assert not plannable(graph)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_launches_call_the_binarys_own_launcher():
    from torch.fx.experimental.proxy_tensor import make_fx

    from tilefuse.compiler import compile_fx

    def fn(x, w, cache, pos):
        cache.index_copy_(0, pos, x[:1])  # an in-place write into an input
        return torch.softmax(x @ w, -1) * 2 + cache.sum(0)

    gen = torch.Generator(device="cuda").manual_seed(9)

    def inputs():
        return (torch.randn(37, 24, device="cuda", generator=gen), torch.randn(24, 24, device="cuda", generator=gen),
                torch.randn(5, 24, device="cuda", generator=gen), torch.tensor([3], device="cuda"))

    gm = make_fx(fn, tracing_mode="fake")(*inputs())
    with config.patch(target="triton"):
        compiled, _ = compile_fx(gm, torch.device("cuda"), "forward")
    for _ in range(3):
        args = inputs()
        expected_cache = args[2].clone()
        expected = fn(args[0].double(), args[1].double(), expected_cache.double(), args[3])
        (out,) = compiled(*args)
        torch.testing.assert_close(out.double(), expected, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(args[2].double(), expected_cache.double().index_copy_(0, args[3], args[0][:1].double()))
    source = compiled.generated_call().__tilefuse_source__
    assert "stream0" in source
    assert re.search(r"^    launch\d+\(b, env\)", source, re.M) is None, source  # every kernel launched directly


def _fast_call_available() -> bool:
    from tilefuse.backends.cpu import fast_call

    return find_compiler() is not None and fast_call.launcher() is not None


def _generated_source(rows: int, cols: int, seed: int) -> str:
    """The generated call's source of `_graph(rows, cols)` on the CPU, after three calls that
    give the reference's results."""
    compiled = _compile(_graph(rows, cols))
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(cols, generator=gen)
    for _ in range(3):
        x = torch.randn(rows, cols, generator=gen)
        (out,) = compiled(x, w)
        torch.testing.assert_close(out, _reference(x, w), rtol=1e-5, atol=1e-5)
    return compiled.generated_call().__tilefuse_source__


@needs_cxx
def test_cpu_kernels_launch_through_the_fast_call():
    """Where the fast call builds (CPython's headers present), a C++ kernel's launch in the
    generated call is one call of it with the buffers' pointers, and gives the same results."""
    if not _fast_call_available():
        pytest.skip("the fast call cannot be built here (no Python.h)")
    source = _generated_source(11, 37, seed=21)
    assert re.search(r"launch\d+\(\d+, \d+, \d+, (1|min\(num_threads\(\), \d+\)), b\['", source), source
    assert "b['x'].data_ptr()" in source


@needs_cxx
def test_without_the_fast_call_kernels_launch_through_ctypes(monkeypatch):
    from tilefuse.backends.cpu import fast_call

    monkeypatch.setattr(fast_call, "_state", {"module": None})
    source = _generated_source(6, 19, seed=22)
    assert ".data_ptr()" not in source and "b['x']" in source


def test_the_fast_call_is_given_up_without_headers(monkeypatch):
    import sysconfig

    from tilefuse.backends.cpu import fast_call

    monkeypatch.setattr(fast_call, "_state", {})
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"include": "/nonexistent-include"})
    assert fast_call.launcher() is None
    assert fast_call.launcher() is None  # (decided once)


def _conv_block(x, w, scale, shift):
    y = torch.nn.functional.conv2d(x, w, padding=1)
    return torch.relu(y * scale[:, None, None] + shift[:, None, None]), torch.nn.functional.max_pool2d(y, 2)


@needs_cxx
@pytest.mark.parametrize("channels_last", [False, True])
def test_aten_calls_are_written_out(channels_last):
    """An ATen call (a convolution, a pooling with its indices) is written into the generated
    call with its sizes as integers, and gives the general call's results."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from tilefuse.compiler import compile_fx

    gen = torch.Generator().manual_seed(23)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(2, 5, 9, 11, generator=gen).to(memory_format=fmt)
    w = torch.randn(6, 5, 3, 3, generator=gen).to(memory_format=fmt)
    scale, shift = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    with torch.no_grad():
        gm = make_fx(_conv_block, tracing_mode="fake")(x, w, scale, shift)
        with config.patch(target="cpu"):
            compiled, _ = compile_fx(gm, torch.device("cpu"), "forward")
        for _ in range(3):
            x = torch.randn(2, 5, 9, 11, generator=gen).to(memory_format=fmt)
            outs = compiled(x, w, scale, shift)
            expected = _conv_block(x.double(), w.double(), scale.double(), shift.double())
            for out, want in zip(outs, expected):
                torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    source = compiled.generated_call().__tilefuse_source__
    assert "cg._extern(" not in source, source
    assert re.search(r"r = f\d+\(b\['", source) and "[1, 1]" in source  # (the padding, as integers)


def _sorted_block(x):
    values, order = torch.sort(x * 3 - 1, dim=-1, stable=True, descending=True)
    return values + 1, order


@needs_cxx
def test_an_aten_call_with_keyword_arguments_is_written_out():
    """`sort` with keyword arguments and two results: written out, its pieces taken from its
    result, the same values and indices as eager."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from tilefuse.compiler import compile_fx

    gen = torch.Generator().manual_seed(24)
    x = torch.randn(3, 17, generator=gen)
    with torch.no_grad():
        gm = make_fx(_sorted_block, tracing_mode="fake")(x)
        with config.patch(target="cpu"):
            compiled, _ = compile_fx(gm, torch.device("cpu"), "forward")
        for _ in range(3):
            x = torch.randn(3, 17, generator=gen)
            values, order = compiled(x)
            want_values, want_order = _sorted_block(x.double())
            torch.testing.assert_close(values.double(), want_values, rtol=1e-6, atol=1e-6)
            assert torch.equal(order, want_order)
    source = compiled.generated_call().__tilefuse_source__
    assert "cg._extern(" not in source and "stable=True" in source and "r[" in source, source
