"""Out-of-range indices through torch.compile: generated kernels raise as eager does (C++ and
the Triton interpreter), in-range (and negative, where allowed) indices stay exact, and an
index that is provably in range gets no check."""
import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.compare import compare_outputs, to_fp64
from tilefuse.ir.bounds import IndexCheckError
from backends_on_cpu import CPU_BACKENDS

BACKENDS = CPU_BACKENDS


def _compiled(fn, backend):
    torch._dynamo.reset()
    with tilefuse.config.patch(target=backend, fallback="error"):
        return torch.compile(fn, backend="tilefuse", dynamic=False)


def _run(fn, backend, *args):
    with tilefuse.config.patch(target=backend, fallback="error"):
        return _compiled(fn, backend)(*args)


def _assert_matches_eager(fn, backend, *args):
    out = _run(fn, backend, *args)
    bad = compare_outputs(out, fn(*args), fn(*to_fp64(args)))
    assert bad is None, str(bad)


def _assert_raises_like_eager(fn, backend, *args, op):
    with pytest.raises(Exception) as eager:
        fn(*args)
    with pytest.raises(type(eager.value)) as ours:
        _run(fn, backend, *args)
    # raised by the generated kernel's check (not by eager re-running the graph), naming the op
    assert isinstance(ours.value, IndexCheckError), repr(ours.value)
    assert f"{op}: index out of range" in str(ours.value)


def _randint(gen, lo, hi, shape):
    return torch.randint(lo, hi, shape, generator=gen)


# every op: (function, make inputs (generator, rows, cols) -> args with indices in range,
# op name, where the index tensor is in args, the size it indexes, whether negatives are allowed)
def _index_select(x, i):
    return x.index_select(1, i) * 2 + 1


def _embedding(w, i):
    return F.embedding(i, w) * 3


def _gather(x, i):
    return torch.gather(x, 1, i) - 0.5


def _advanced(x, i):
    return x[i] * 2


def _advanced_two(x, i, j):
    return x[i, j] + 1


def _scatter(x, i):
    return torch.zeros_like(x).scatter(1, i, 2.5) + x


CASES = {
    "index_select": (_index_select, lambda g, n, m: (torch.randn(n, m, generator=g), _randint(g, 0, m, (5,))),
                     "index_select", 1, lambda n, m: m, False),
    "embedding": (_embedding, lambda g, n, m: (torch.randn(n, m, generator=g), _randint(g, 0, n, (3, 7))),
                  "embedding", 1, lambda n, m: n, False),
    "gather": (_gather, lambda g, n, m: (torch.randn(n, m, generator=g), _randint(g, 0, m, (n, 4))),
               "gather", 1, lambda n, m: m, False),
    "advanced": (_advanced, lambda g, n, m: (torch.randn(n, m, generator=g), _randint(g, -n, n, (6,))),
                 "index", 1, lambda n, m: n, True),
    "advanced_two": (_advanced_two, lambda g, n, m: (torch.randn(n, m, generator=g), _randint(g, -n, n, (2, 5)),
                                                     _randint(g, -m, m, (5,))), "index", 2, lambda n, m: m, True),
    "scatter": (_scatter, lambda g, n, m: (torch.randn(n, m, generator=g), _randint(g, 0, m, (n, 1))),
                "scatter", 1, lambda n, m: m, False),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_in_range_indices_match_eager(case, backend):
    fn, make, *_ = CASES[case]
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    args = make(gen, 7, 13)  # odd sizes: ragged tiles
    compiled = _compiled(fn, backend)
    with tilefuse.config.patch(target=backend, fallback="error"):
        for _ in range(2):  # fresh data through the same compiled graph
            out = compiled(*args)
            bad = compare_outputs(out, fn(*args), fn(*to_fp64(args)))
            assert bad is None, str(bad)
            args = make(gen, 7, 13)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_out_of_range_indices_raise_like_eager(case, backend):
    fn, make, op, slot, size_of, negatives = CASES[case]
    gen = torch.Generator().manual_seed(hash(case) % 997)
    n, m = 7, 13
    size = size_of(n, m)
    bad_values = [size, size + 3, -size - 1 if negatives else -1]
    compiled = _compiled(fn, backend)
    for bad in bad_values:
        args = list(make(gen, n, m))
        idx = args[slot].clone()
        flat = idx.view(-1)
        flat[torch.randint(0, flat.numel(), (1,), generator=gen)] = bad
        args[slot] = idx
        with pytest.raises(Exception) as eager:
            fn(*args)
        with tilefuse.config.patch(target=backend, fallback="error"):
            with pytest.raises(type(eager.value)) as ours:
                compiled(*args)
        assert isinstance(ours.value, IndexCheckError), repr(ours.value)
        assert f"{op}: index out of range" in str(ours.value)
        assert f"with size {size}" in str(ours.value)


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the C++ backend's launches")
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_generated_call_checks_indices_in_its_own_launches(case, monkeypatch):
    """From the third call of a set of sizes the graph runs its generated call, where a kernel
    with index checks is launched directly (an error word per call): in-range indices stay
    exact, an out-of-range one raises eager's error, and the next call is right again."""
    from tilefuse.backends.cpu import launcher

    checked = []
    launch = launcher._CheckedLaunch.__call__
    monkeypatch.setattr(launcher._CheckedLaunch, "__call__", lambda self, *t: (checked.append(1), launch(self, *t))[1])
    fn, make, op, slot, size_of, _ = CASES[case]
    gen = torch.Generator().manual_seed(hash(case) % 991)
    n, m = 9, 11
    compiled = _compiled(fn, "cpu")
    with tilefuse.config.patch(target="cpu", fallback="error"):
        for _ in range(4):
            args = make(gen, n, m)
            bad = compare_outputs(compiled(*args), fn(*args), fn(*to_fp64(args)))
            assert bad is None, str(bad)
        assert checked, "the generated call launched no checked kernel directly"
        args = list(make(gen, n, m))
        idx = args[slot].clone()
        idx.view(-1)[-1] = size_of(n, m) + 2
        args[slot] = idx
        with pytest.raises(Exception) as eager:
            fn(*args)
        with pytest.raises(type(eager.value)) as ours:
            compiled(*args)
        assert isinstance(ours.value, IndexCheckError), repr(ours.value)
        assert f"{op}: index out of range" in str(ours.value) and f"with size {size_of(n, m)}" in str(ours.value)
        args = make(gen, n, m)
        assert compare_outputs(compiled(*args), fn(*args), fn(*to_fp64(args))) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_indices_in_range_are_wrapped(backend):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 5, generator=gen, dtype=torch.float32)
    i = torch.tensor([-9, -1, 0, 8, -4, 3])
    _assert_matches_eager(_advanced, backend, x, i)
    _assert_matches_eager(lambda x, i: x[:, i].sum(-1), backend, x, torch.tensor([-5, 4, -2]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nll_loss_target_out_of_range_raises(backend):
    # reaches tilefuse as a gather (a decomposition): the error is still an IndexError like eager's
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 11, generator=gen).log_softmax(-1)
    t = _randint(gen, 0, 11, (6,))

    def fn(x, t):
        return F.nll_loss(x, t, reduction="none")

    _assert_matches_eager(fn, backend, x, t)
    t[2] = 11
    with pytest.raises(IndexError):
        fn(x, t)
    with pytest.raises(IndexError):
        _run(fn, backend, x, t)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_inside_a_concatenation_checks_only_its_part(backend):
    # the gathered rows are one part of a cat: the other part's positions never check its index
    gen = torch.Generator().manual_seed(11)
    x, y = torch.randn(7, 13, generator=gen), torch.randn(4, 5, generator=gen)
    i = _randint(gen, 0, 13, (5,))

    def fn(x, y, i):
        return torch.cat([x.index_select(1, i), y]) * 2

    _assert_matches_eager(fn, backend, x, y, i)
    i[1] = 13
    _assert_raises_like_eager(fn, backend, x, y, i, op="index_select")


def _report(fn, *args):
    torch._dynamo.reset()
    reports = []
    from tilefuse import api

    api._report_sinks.append(reports)
    try:
        with tilefuse.config.patch(target="cpu", fallback="error"):
            torch.compile(fn, backend="tilefuse", dynamic=False)(*args)
    finally:
        api._report_sinks.remove(reports)
    return "\n".join(k.tile_ir for r in reports for k in r.kernels)


def test_provably_in_range_indices_emit_no_check():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, 6, generator=gen)
    i = _randint(gen, -50, 50, (6,))
    checked = _report(lambda x, i: x[i % 9] * 2, x, i)
    assert "check" not in checked  # Python remainder by the size: always in range
    assert "check" not in _report(lambda x: x[torch.arange(9)] * 2, x)
    assert "check" not in _report(lambda x, i: x.index_select(0, i.clamp(0, 8)) + 1, x, i)
    assert "check" not in _report(lambda x: torch.gather(x, 1, torch.arange(6).flip(0).expand(9, 6)), x)
    for mode in ("nearest", "bilinear", "bicubic"):  # indices from float arithmetic on arange
        assert "check" not in _report(lambda x: F.interpolate(x, scale_factor=2.5, mode=mode), x[None, None])
    # the same ops at unproven indices do check (the test can fail)
    assert "check" in _report(lambda x, i: x[i] * 2, x, i.clamp(-9, 8))
    assert "check" in _report(lambda x, j: x.index_select(0, j) + 1, x, i.clamp(0, 8))


def test_indices_an_op_produced_are_in_its_range():
    """`topk`, `sort`, `max(dim)` and `argmax` give indices in [0, n) of the dim they search:
    gathering along a dim of that size needs no check (a gathered MoE's experts), gathering
    along a smaller one still checks, and raises as eager does."""
    gen = torch.Generator().manual_seed(5)
    s, w = torch.randn(7, 10, generator=gen), torch.randn(10, 4, generator=gen)

    def experts(s, w):
        return w[torch.topk(s, 3, dim=-1).indices].sum(1)

    for fn in (experts, lambda s, w: w[torch.sort(s, dim=1).indices[:, :2]].sum(1),
               lambda s, w: w[s.max(dim=1).indices] * 2, lambda s, w: w[s.argmax(-1)] + 1,
               lambda s, w: w[torch.argmax(s.T.contiguous(), 0)] - 1):
        assert "check" not in _report(fn, s, w)
        _assert_matches_eager(fn, "cpu", s, w)
    small = w[:6]  # indices into 10 columns, gathered from 6 rows: checked
    early = s.clone()
    early[:, :6] += 100  # (these indices happen to fit)
    assert "check" in _report(experts, early, small)
    _assert_matches_eager(experts, "cpu", early, small)
    down = lambda s, w: w[torch.topk(s, 2, dim=0).indices].sum(0)  # noqa: E731 - indices in [0, 7)
    top = s.clone()
    top[:2] += 100  # (rows 0 and 1 win: in range of 5 too)
    assert "check" not in _report(down, s, w[:7]) and "check" in _report(down, top, w[:5])
    late = s.clone()
    late[0, 9] = 1000  # index 9 of 6 rows
    for backend in BACKENDS:
        _assert_raises_like_eager(experts, backend, late, small, op="index")


def test_index_checks_can_be_turned_off():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 3, generator=gen)
    i = torch.tensor([1, 5, 0])
    with tilefuse.config.patch(index_checks=False):
        out = _run(lambda x, i: x.index_select(0, i) + 1, "cpu", x, i)
    # no error; the out-of-range row reads nothing (zeros), the others are right
    torch.testing.assert_close(out[[0, 2]], x[[1, 0]] + 1)
    torch.testing.assert_close(out[1], torch.ones(3))


KERNEL_KINDS = {
    # a gather as a contraction's operand (inside the K loop), a row reduction and a softmax
    # over gathered rows (a looped one: rows longer than a tile), with static and symbolic sizes
    "contraction_a": (lambda w, i, m: F.embedding(i, w) @ m,
                      lambda g: (torch.randn(50, 64, generator=g), _randint(g, 0, 50, (40,)),
                                 torch.randn(64, 48, generator=g)), 50, "embedding"),
    "contraction_b": (lambda x, i, m: m @ x.index_select(0, i),
                      lambda g: (torch.randn(50, 33, generator=g), _randint(g, 0, 50, (64,)),
                                 torch.randn(20, 64, generator=g)), 50, "index_select"),
    "row_sum": (lambda x, i: x[i].sum(-1), lambda g: (torch.randn(30, 300, generator=g), _randint(g, -30, 30, (7,))),
                30, "index"),
    "long_softmax": (lambda x, i: torch.softmax(x[i], -1),
                     lambda g: (torch.randn(30, 9000, generator=g), _randint(g, -30, 30, (3,))), 30, "index"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("kind", sorted(KERNEL_KINDS))
def test_checks_in_every_kind_of_kernel(kind, dynamic, backend):
    fn, make, size, op = KERNEL_KINDS[kind]
    gen = torch.Generator().manual_seed(len(kind))
    args = list(make(gen))
    torch._dynamo.reset()
    with tilefuse.config.patch(target=backend, fallback="error"):
        compiled = torch.compile(fn, backend="tilefuse", dynamic=dynamic)
        bad = compare_outputs(compiled(*args), fn(*args), fn(*to_fp64(args)))
        assert bad is None, str(bad)
        idx = args[1].clone()
        idx[1] = size
        args[1] = idx
        with pytest.raises(IndexCheckError, match=f"{op}: index out of range .* with size {size}"):
            compiled(*args)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["nearest", "bilinear", "bicubic"])
def test_interpolation_without_checks_matches_eager(mode, backend):
    # its indices are proven in range (no check, no mask): a wrong proof would read outside x
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 3, 7, 11, generator=gen)
    for scale in (2.5, 0.6, 3.0):
        _assert_matches_eager(lambda x: F.interpolate(x, scale_factor=scale, mode=mode), backend, x)
