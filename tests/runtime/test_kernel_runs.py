"""Runs of C++ kernels (`runtime.straight_line._Run`, `backends.cpu.fast_call.run_steps`): the
generated call of a CPU graph launches consecutive kernels with one native call, in one
parallel region, and gives what the general call and eager give — with several threads and
one, when a kernel is serial and its neighbour parallel, when an input arrives with other
strides (the run's checks sit at the call's entry), and within the bound on the bytes a run
keeps alive. Without the extension, kernels launch one by one as before."""
import re

import pytest
import torch

from tilefuse.backends.cpu import find_compiler
from tilefuse.config import config

needs_cxx = pytest.mark.skipif(find_compiler() is None, reason="no C++ compiler")


def _chain(x, y, w):
    """Kernels of several shapes one after the other: a column sum of a transcendental, a row
    mean against it, a pointwise result, and a small serial epilogue on a vector."""
    s = torch.tanh(x).sum(0)
    m = (y * s).mean(1, keepdim=True)
    out = torch.relu(x - m) * w
    v = torch.sigmoid(s * 0.5 + w)
    return out, v, m.amax()


def _reference(x, y, w):
    return tuple(t.float() for t in _chain(x.double(), y.double(), w.double()))


def _compile(rows, cols):
    from torch.fx.experimental.proxy_tensor import make_fx

    from tilefuse.compiler import compile_fx

    args = (torch.randn(rows, cols), torch.randn(rows, cols), torch.randn(cols))
    gm = make_fx(_chain, tracing_mode="fake")(*args)
    with config.patch(target="cpu"):
        compiled, _ = compile_fx(gm, torch.device("cpu"), "forward")
    return compiled


def _runs(source: str) -> list:
    """The run calls of a generated source; checks on the way that no buffer whose pointer a
    run passes was dropped before it (a bare `b.pop`: a reused buffer's memory lives on)."""
    pointers, dropped = {}, set()
    for line in source.splitlines():
        m = re.match(r"^    (p\d+) = b\['(\w+)'\]\.data_ptr\(\)$", line)
        if m:
            pointers[m.group(1)] = m.group(2)
        else:  # (or a place in the run's arena)
            assert not re.match(r"^    p\d+ = ", line) or re.match(r"^    p\d+ = a( \+ \d+)?$", line), line
        m = re.match(r"^    b\.pop\('(\w+)', None\)$", line)
        if m:
            dropped.add(m.group(1))
        if re.match(r"^    run\d+\(", line):
            passed = {pointers.get(p) for p in re.findall(r"\bp\d+\b", line.split("  # ")[0])} - {None}
            assert not passed & dropped, source
            pointers.clear()
    return re.findall(r"^    run\d+\(.*$", source, re.M)


def _fast_call_available() -> bool:
    from tilefuse.backends.cpu import fast_call

    return find_compiler() is not None and fast_call.steps_runner() is not None


def _check(compiled, rows, cols, gen, calls=3, make_x=None):
    for _ in range(calls):
        x = make_x() if make_x is not None else torch.randn(rows, cols, generator=gen)
        y, w = torch.randn(rows, cols, generator=gen), torch.randn(cols, generator=gen)
        outs = compiled(x, y, w)
        for got, want in zip(outs, _reference(x, y, w)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@needs_cxx
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows,cols", [(7, 33), (301, 257)], ids=["serial", "parallel"])
def test_consecutive_kernels_run_in_one_native_call(threads, rows, cols):
    if not _fast_call_available():
        pytest.skip("the fast call cannot be built here (no Python.h)")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        compiled = _compile(rows, cols)
        gen = torch.Generator().manual_seed(31 + rows)
        _check(compiled, rows, cols, gen)
        source = compiled.generated_call().__tilefuse_source__
        runs = _runs(source)
        assert len(runs) == 1, source
        assert len(runs[0].split("  # ")[1].split(", ")) >= 2, source  # (the kernels it runs)
        if rows < 100:  # every kernel in it, the buffers only they use in one allocation
            assert re.search(r"^    launch\d+\(", source, re.M) is None, source
            assert re.search(r"arena = empty(_strided)?\(", source) and re.search(r"^    p\d+ = a\b", source, re.M), source
        else:  # (a product raced to the library ends a run), spread over the threads
            assert "min(num_threads()" in runs[0], source
    finally:
        torch.set_num_threads(before)


def _strided_graph(rows, cols):
    """s[j] = Σi tanh(x[i, j]); m[i] = Σj x[i, j]·s[j]; y = relu(x - m)·w: x's strides read
    at run time."""
    from irgraphs import GraphBuilder
    from tilefuse.ir import dtypes as dt
    from tilefuse.ir.expr import binary, unary

    g = GraphBuilder("runs")
    x = g.input("x", (rows, cols))
    w = g.input("w", (cols,), strides="contiguous")
    s = g.ctx.reduce((cols,), (rows,), "sum", lambda i, r: unary("tanh", x.load((r[0], i[0]))), dt.float32)
    m = g.ctx.reduce((rows,), (cols,), "sum", lambda i, r: x.load((i[0], r[0])) * s.load((r[0],)), dt.float32)
    y = g.ctx.pointwise((rows, cols), dt.float32,
                        lambda i: binary("maximum", x.load(i) - m.load((i[0],)), 0.0) * w.load((i[1],)))
    return g.output(y, s)


def _strided_reference(x, w):
    x, w = x.double(), w.double()
    s = torch.tanh(x).sum(0)
    return (torch.relu(x - (x * s).sum(1, keepdim=True)) * w).float(), s.float()


@needs_cxx
def test_a_launch_reading_strides_at_run_time_keeps_its_own_check():
    """Kernels built for x's strides read at run time launch on their own, each behind its
    check (an x with other strides sends only those launches the general way, as outside runs):
    no run holds them, and every layout gives eager's results."""
    from tilefuse.compiler import compile_ir

    if not _fast_call_available():
        pytest.skip("the fast call cannot be built here (no Python.h)")
    with config.patch(target="cpu"):
        compiled, _ = compile_ir(_strided_graph(9, 40), torch.device("cpu"))
    gen = torch.Generator().manual_seed(32)
    w = torch.randn(40, generator=gen)
    xs = [torch.randn(9, 40, generator=gen) for _ in range(2)]
    xs += [torch.randn(40, 9, generator=gen).T, torch.randn(9, 80, generator=gen)[:, ::2], torch.randn(9, 40, generator=gen)]
    for k, x in enumerate(xs):
        for got, want in zip(compiled(x, w), _strided_reference(x, w)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        if k == 1:
            source = compiled.generated_call().__tilefuse_source__
            assert "return None" not in source, source  # (no check at the entry)
            assert re.search(r"^    if b\['x'\]\.stride\(\) == \(40, 1\):$", source, re.M), source
            for run in _runs(source):
                assert "b['x']" not in run, source
    assert compiled.generated_call() is not None  # (still the generated call after other layouts)


@needs_cxx
def test_a_run_keeps_no_more_dead_bytes_than_its_bound(monkeypatch):
    """Buffers that die inside a run live until it ends; past the bound the run is cut (here
    after every kernel whose buffers die: more runs than without the bound) and the results
    stay right."""
    from tilefuse.runtime import straight_line

    if not _fast_call_available():
        pytest.skip("the fast call cannot be built here (no Python.h)")
    monkeypatch.setattr(straight_line, "RUN_HELD_MAX_BYTES", 0)
    compiled = _compile(64, 48)
    gen = torch.Generator().manual_seed(33)
    _check(compiled, 64, 48, gen)
    source = compiled.generated_call().__tilefuse_source__
    unbounded = _compile(64, 48)
    monkeypatch.setattr(straight_line, "RUN_HELD_MAX_BYTES", 1 << 40)
    _check(unbounded, 64, 48, gen)
    whole = unbounded.generated_call().__tilefuse_source__
    assert len(_runs(whole)) == 1, whole
    assert len(_runs(source)) > 1, source  # cut after the first kernel whose buffers die


@needs_cxx
def test_without_the_extension_kernels_launch_one_by_one(monkeypatch):
    from tilefuse.backends.cpu import fast_call

    monkeypatch.setattr(fast_call, "_state", {"module": None})
    compiled = _compile(12, 20)
    gen = torch.Generator().manual_seed(34)
    _check(compiled, 12, 20, gen)
    source = compiled.generated_call().__tilefuse_source__
    assert not _runs(source), source


@needs_cxx
def test_the_knob_turns_runs_off():
    with config.patch(kernel_runs=False):
        compiled = _compile(12, 20)
        gen = torch.Generator().manual_seed(36)
        _check(compiled, 12, 20, gen)
    source = compiled.generated_call().__tilefuse_source__
    assert not _runs(source) and re.search(r"^    launch\d+\(", source, re.M), source
