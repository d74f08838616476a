"""Captured tensors whose values are an index formula (`frontend.index_constants`): which fit
and which do not, the compiled programs (checked against eager at fp64), the mask analysis they
reach, and the guard that keeps a changed tensor from being read as its old formula."""
import math

import pytest
import torch

import tilefuse
from lowered_plans import recorded_lowerings
from tilefuse.config import config
from tilefuse.frontend import index_constants
from tilefuse.frontend.index_constants import Guarded, fit


def _fits_tried(monkeypatch) -> list:
    """The sources of the tensors `fit` is asked about from now on (in this test)."""
    seen, real = [], index_constants.fit
    monkeypatch.setattr(index_constants, "fit", lambda *a: seen.append(a[1]) or real(*a))
    return seen


def _formulas_found(monkeypatch) -> list:
    """The sources of the formulas `find` returns from now on (in this test)."""
    found, real = [], index_constants.find
    monkeypatch.setattr(index_constants, "find", lambda *a: found.extend(f.source for f in real(*a)) or real(*a))
    return found


def _fit(t):
    formula = fit(0, "t", t)
    if formula is not None:
        assert torch.equal(formula.evaluate(), t)  # (what the graph computes is the tensor)
    return formula


@pytest.mark.parametrize("rows,cols", [(7, 7), (37, 53), (53, 37)])
def test_masks_and_tables_that_are_formulas(rows, cols):
    i, j = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
    ones = torch.ones(rows, cols)
    cases = {
        "tril": torch.tril(ones).view(1, 1, rows, cols),
        "tril bool": torch.tril(ones).bool(),
        "triu masked": torch.triu(ones, diagonal=1).bool(),  # True where masked
        "window": ((j <= i) & (i - j < 4)).float(),
        "shifted": torch.tril(ones, diagonal=-2),
        "additive": torch.zeros(rows, cols).masked_fill(j > i, float("-inf")),
        "finite fill": torch.zeros(rows, cols, dtype=torch.bfloat16).masked_fill(j > i + 1, torch.finfo(torch.bfloat16).min),
        "distance": (j - i).float(),
        "scaled distance": (3 * i - 2 * j + 5).to(torch.int32),
        "row index": torch.arange(rows)[:, None],
        "expanded positions": torch.arange(cols).expand(1, -1),
    }
    for name, t in cases.items():
        formula = _fit(t)
        assert formula is not None, name
        assert formula.kind == ("affine" if name in ("distance", "scaled distance", "row index",
                                                     "expanded positions") else "band"), name


def test_tensors_that_are_not_formulas():
    g = torch.Generator().manual_seed(1)
    tril = torch.tril(torch.ones(17, 17))
    almost = tril.clone()
    almost[11, 3] = 0.0  # one element off the band
    holes = (torch.rand(17, 17, generator=g) > 0.5).float()
    nan = (torch.arange(17)[None, :] - torch.arange(17)[:, None]).float()
    nan[4, 4] = float("nan")
    for name, t in {"one element off": almost, "random mask": holes, "random": torch.randn(17, 5, generator=g),
                    "zeros (a cache)": torch.zeros(9, 9), "ones": torch.ones(9, 9), "with a nan": nan,
                    "inverse frequencies": 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)),
                    "signed zeros": -(torch.arange(9)[None, :] - torch.arange(9)[:, None]).float(),
                    "three dims vary": torch.arange(24).view(2, 3, 4)}.items():
        assert _fit(t) is None, name


def test_only_formulas_whose_values_pass_2_to_the_24_are_verified_on_their_device():
    """A device tensor is fitted from a host copy; a float table of integers past 2**24 may round
    differently there, so it is verified on its device as well."""
    small = fit(0, "t", (torch.arange(64)[None, :] - torch.arange(64)[:, None]).float())
    big = fit(0, "t", (torch.arange(64)[None, :] * 300_000 + 7).double().expand(3, 64).contiguous())
    tril = fit(0, "t", torch.tril(torch.ones(64, 64)))
    assert big is not None and big.kind == "affine"
    assert index_constants._exact_in_float32(small) and index_constants._exact_in_float32(tril)
    assert not index_constants._exact_in_float32(big)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.bool])
def test_a_device_tensor_fits_as_its_host_copy_does(dtype, monkeypatch):
    i, j = torch.arange(300)[:, None], torch.arange(300)[None, :]
    cases = [torch.tril(torch.ones(300, 300)), ((j <= i) & (i - j < 17)).float(), (j - i) * 3 + 1,
             (j * 70_001 - i).view(1, 300, 300)]
    checked, real = [], index_constants.IndexFormula.matches
    monkeypatch.setattr(index_constants.IndexFormula, "matches",
                        lambda self, t: checked.append(t.device.type) or real(self, t))
    for t in cases:
        on_host = fit(0, "t", t.to(dtype))
        checked.clear()
        on_device = fit(0, "t", t.to(dtype).cuda())
        # (fitted on the host; verified on the device only where values pass 2**24)
        past = on_host is not None and not index_constants._exact_in_float32(on_host)
        assert ("cuda" in checked) == past
        if on_host is None or not past:
            assert (on_host is None) == (on_device is None)
        if on_device is not None:  # (past 2**24: only if the device rounds as the host did)
            assert on_device.device.type == "cuda" and on_device.terms == on_host.terms
            assert torch.equal(on_device.evaluate(), t.to(dtype).cuda())


class _Causal(torch.nn.Module):
    """nanoGPT's attention: a `tril` buffer and `masked_fill`."""

    def __init__(self, block, heads, dim, dtype=torch.float64):
        super().__init__()
        self.heads = heads
        self.proj = torch.nn.Linear(dim, 3 * dim, dtype=dtype)
        self.register_buffer("bias", torch.tril(torch.ones(block, block, dtype=dtype)).view(1, 1, block, block))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.proj(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        return (torch.softmax(att, dim=-1) @ v).transpose(1, 2).reshape(b, t, c)


def _flash_plans(fn, *args):
    torch._dynamo.reset()
    with config.patch(graph_cache=False), recorded_lowerings() as seen:
        report = tilefuse.explain(fn, *args)
    return [plan for _, plan, _ in seen if plan.kind == "flash"], report


def test_a_tril_buffer_is_a_causal_formula():
    from tilefuse.fusion.masking import live_key_range
    from tilefuse.ir.expr import out_index, red_index

    model = _Causal(block=160, heads=2, dim=64, dtype=torch.float32)
    x = torch.randn(2, 131, 64)  # (fewer tokens than the buffer's rows)
    with torch.no_grad():
        plans, report = _flash_plans(model, x)
    assert len(plans) == 1 and plans[0].flash.masked is not None
    assert "k - r <= 0" in str(report), str(report)
    # the mask is a formula: no block summary is computed, and the key loop of a block of
    # rows stops at the diagonal (an upper bound on the live keys, as `where(j > i, ...)` gets)
    assert "summary" not in str(report), str(report)
    (key,) = red_index(1)
    bounds = [live_key_range(plans[0].flash.masked, row, key) for row in out_index(4)]
    assert any(upper is not None for _, upper in bounds), plans[0].flash.masked
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend="tilefuse")(x)
        expected = model.double()(x.double())
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5)


def test_the_training_step_of_a_tril_buffer():
    model = _Causal(block=24, heads=2, dim=16)
    x = torch.randn(2, 19, 16, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 19, 16, dtype=torch.float64)
    expected = torch.autograd.grad(model(x), (x, *model.parameters()), dy)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tilefuse")
    got = torch.autograd.grad(compiled(x), (x, *model.parameters()), dy)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-9)


def test_alibi_distance_from_a_closure():
    seq, heads = 45, 3
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    distance = (j - i).double()
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float64).view(heads, 1, 1)

    def alibi(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) / 4.0 + slopes * distance, dim=-1) @ v

    q, k, v = (torch.randn(2, heads, seq, 16, dtype=torch.float64) for _ in range(3))
    plans, report = _flash_plans(alibi, q, k, v)
    assert len(plans) == 1 and "L['distance'] = 0 + -1·r + 1·k" in str(report), str(report)
    from tilefuse.ir.expr import Load, walk

    read = {e.buffer for e in walk(plans[0].flash.masked) if isinstance(e, Load)}
    assert len(read) == 2, plans[0].flash.masked  # the scores and the slopes: no distance table
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(alibi, backend="tilefuse")(q, k, v), alibi(q, k, v),
                               rtol=1e-10, atol=1e-10)


def test_arguments_and_written_buffers_are_read_as_data(monkeypatch):
    def masked(x, mask):  # the mask is an argument: another one may come next call
        return torch.softmax(x.masked_fill(mask == 0, float("-inf")), -1)

    class Cache(torch.nn.Module):  # a buffer the graph writes
        def __init__(self):
            super().__init__()
            self.register_buffer("cache", torch.tril(torch.ones(6, 6)))

        def forward(self, x, pos):
            self.cache.index_copy_(0, pos, x)
            return self.cache.sum(-1)

    seen = _fits_tried(monkeypatch)
    torch._dynamo.reset()
    torch.compile(masked, backend="tilefuse")(torch.randn(5, 5), torch.tril(torch.ones(5, 5)))
    torch._dynamo.reset()
    torch.compile(Cache(), backend="tilefuse")(torch.randn(1, 6), torch.tensor([2]))
    assert seen == [], seen


def test_a_buffer_written_after_compiling_is_read_again():
    model = _Causal(block=16, heads=2, dim=8)
    x = torch.randn(2, 16, 8, dtype=torch.float64)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tilefuse")
    torch.testing.assert_close(compiled(x), model(x))
    # the same values in a new tensor: verified again, still the formula
    model.bias = torch.tril(torch.ones(16, 16, dtype=torch.float64)).view(1, 1, 16, 16)
    torch.testing.assert_close(compiled(x), model(x))
    # a window now: the buffer no longer follows the formula it was compiled with
    with torch.no_grad():
        model.bias.copy_(model.bias.triu(-3))
    with pytest.warns(UserWarning, match="no longer follows the formula"):
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-10, atol=1e-10)
    model.bias[0, 0, 9, 2] = 1.0  # (written again, after the fallback: read as data)
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-10, atol=1e-10)


def test_the_guard_verifies_a_changed_tensor_once_and_then_gives_up():
    tril = torch.tril(torch.ones(6, 6))
    formula = fit(1, "tril", tril)
    calls, fallbacks = [], []
    guarded = Guarded(lambda *a: calls.append("fast") or "fast", [formula], [None, tril],
                      lambda args: fallbacks.append(len(args)) or (lambda *a: "slow"), None)
    x = torch.randn(2)
    assert guarded(x, tril) == "fast" and guarded.rechecks == 0
    assert guarded(x, tril.clone()) == "fast" and guarded.rechecks == 1  # (another tensor, same values)
    tril.add_(0)  # an in-place write: the version moves
    assert guarded(x, tril) == "fast" and guarded.rechecks == 2  # (on consecutive calls)
    assert guarded(x, tril) == "fast" and guarded.rechecks == 2  # (verified: nothing to check)
    tril.add_(0)
    assert guarded(x, tril) == "fast" and guarded.rechecks == 1  # (a streak starts again)
    with pytest.warns(UserWarning, match="changed"):
        for n in range(index_constants.MAX_RECHECKS):  # a new tensor every call: verified each time, up to a bound
            guarded(x, torch.tril(torch.ones(6, 6)))
    assert fallbacks == [2] and guarded(x, tril) == "slow"
    guarded = Guarded(lambda *a: "fast", [formula], [None, tril], lambda args: (lambda *a: "slow"), None)
    with pytest.warns(UserWarning, match="no longer follows"):
        assert guarded(x, torch.ones(6, 6)) == "slow"

    def failing(args):
        raise RuntimeError("boom")

    guarded = Guarded(lambda *a: "fast", [formula], [None, tril], failing, lambda *a: "eager")
    with pytest.warns(UserWarning, match="runs eagerly"):
        assert guarded(x, torch.ones(6, 6)) == "eager"


def test_the_knob_turns_it_off(monkeypatch):
    seen = []
    monkeypatch.setattr(index_constants, "find", lambda *a: seen.append(1) or [])
    torch._dynamo.reset()
    model = _Causal(block=8, heads=2, dim=8)
    x = torch.randn(1, 8, 8, dtype=torch.float64)
    out = tilefuse.compile(model, index_constants=False)(x)
    assert seen == []
    torch.testing.assert_close(out, model(x))


class _Writes(torch.nn.Module):
    """A captured position table that the graph itself writes, in the ways PyTorch spells it."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        base = torch.arange(16, dtype=torch.float64).view(2, 8) - 4
        self.register_buffer("pos", base[0])
        self.register_buffer("other", base[1])  # (shares pos's storage)

    def forward(self, x):
        if self.how == "foreach":
            torch._foreach_add_([self.pos], 8.0)
        elif self.how == "out":
            torch.add(x, 1.0, out=self.pos)
        elif self.how == "aten":
            torch.ops.aten.add_.Tensor(self.pos, 8.0)
        elif self.how == "iadd":
            self.pos += 8
        elif self.how == "alias":  # a write to another buffer in the same storage
            self.other.fill_(5.0)
        elif self.how == "relu":  # a functional call that writes its input
            torch.nn.functional.relu(self.pos, inplace=True)
        elif self.how == "view_iadd":
            p = self.pos[:4]
            p += 1
        return x + self.pos


@pytest.mark.parametrize("how", ["foreach", "out", "aten", "iadd", "alias", "relu", "view_iadd"])
def test_buffers_the_graph_writes_stay_data(how):
    import copy

    model, expected_model = _Writes(how), _Writes(how)
    expected_model.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tilefuse")
    x = torch.randn(8, dtype=torch.float64)
    for _ in range(2):
        torch.testing.assert_close(compiled(x), expected_model(x))
        for a, b in zip(model.buffers(), expected_model.buffers()):
            assert torch.equal(a, b), how


def test_a_returned_view_of_a_buffer_aliases_it():
    class Positions(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("pos", torch.arange(16).view(1, 16))

        def forward(self, x):
            return x + 1, self.pos[:, : x.shape[1]]

    model = Positions()
    torch._dynamo.reset()
    _, view = torch.compile(model, backend="tilefuse")(torch.zeros(1, 8, dtype=torch.long))
    view[0, 0] = 100
    assert model.pos[0, 0] == 100


def test_dynamic_shapes_and_inference_tensors_are_read_as_data(monkeypatch):
    seen = _fits_tried(monkeypatch)
    model = _Causal(block=24, heads=2, dim=8)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tilefuse", dynamic=True)
    for t in (9, 17):
        x = torch.randn(2, t, 8, dtype=torch.float64)
        torch.testing.assert_close(compiled(x), model(x))
    with torch.inference_mode():
        frozen = _Causal(block=24, heads=2, dim=8)
        x = torch.randn(2, 11, 8, dtype=torch.float64)
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(frozen, backend="tilefuse")(x), frozen(x))
    assert seen == [], seen


def test_items_of_containers_passed_in_are_read_as_data(monkeypatch):
    def masked(x, batch):
        return x.masked_fill(batch["mask"] == 0, 0.0)

    seen = _fits_tried(monkeypatch)
    torch._dynamo.reset()
    torch.compile(masked, backend="tilefuse")(torch.randn(8, 8), {"mask": torch.tril(torch.ones(8, 8))})
    assert seen == [], seen


def test_the_backward_reads_its_row_statistics_once_per_key_under_a_causal_formula():
    """The attention backward's per-key statistics (max, log-sum, the row term) under
    `where(j > i, 0, dS)` are [1, keys] loads, not guarded [rows, keys] ones (a guard made the
    kernels need more shared memory than an H100 has; docs/benchmarks.md, twenty-eighth section)."""
    import re

    seq, dim = 96, 32
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]

    def causal(q, k, v):
        s = q @ k.transpose(-1, -2) / math.sqrt(dim)
        return torch.softmax(torch.where(j > i, float("-inf"), s), dim=-1) @ v

    q, k, v = (torch.randn(2, 2, seq, dim, requires_grad=True) for _ in range(3))
    torch._dynamo.reset()
    report = tilefuse.explain(causal, q, k, v, options={"target": "interpret", "graph_cache": False})
    backward = [kk.name for r in report.reports for kk in r.kernels if "flash" in kk.name and "backward" in kk.name]
    assert len(backward) == 2, backward
    per_key_guarded = re.compile(r"tl\.broadcast\(ptr_\w+ \+ \(rj \+ \(\d+ \* pid_b\)\), tmp")
    for name in backward:
        assert not per_key_guarded.search(report.source(name)), report.source(name)
    torch._dynamo.reset()
    dy = torch.randn(2, 2, seq, dim)
    got = torch.autograd.grad(torch.compile(causal, backend="tilefuse", options={"target": "interpret"})(q, k, v),
                              (q, k, v), dy)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(causal(*exact), exact, dy.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5)


def test_a_cache_written_beside_a_causal_mask_leaves_the_mask_a_formula(monkeypatch):
    """gpt-fast's layout: the graph writes the KV cache at `input_pos` and reads the
    `causal_mask` attribute gathered by the same positions; only the cache is data."""

    class Decoder(torch.nn.Module):
        def __init__(self, seq=16, dim=8):
            super().__init__()
            self.proj = torch.nn.Linear(dim, dim, dtype=torch.float64)
            for layer in range(2):
                self.register_buffer(f"k_cache{layer}", torch.zeros(1, seq, dim, dtype=torch.float64))
            self.causal_mask = torch.tril(torch.ones(seq, seq, dtype=torch.bool))

        def forward(self, x, input_pos):
            for cache in (self.k_cache0, self.k_cache1):  # (the second layer's cache write
                k = self.proj(x)                          # depends on the mask through x)
                cache[:, input_pos] = k
                mask = self.causal_mask[None, input_pos]
                s = (k @ cache.transpose(-1, -2)).masked_fill(~mask, float("-inf"))
                x = torch.softmax(s, -1) @ cache
            return x

    model, twin = Decoder(), Decoder()
    twin.load_state_dict(model.state_dict())
    found = _formulas_found(monkeypatch)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tilefuse")
    with torch.no_grad():
        for pos in (torch.arange(0, 5), torch.arange(5, 9)):
            x = torch.randn(1, len(pos), 8, dtype=torch.float64)
            torch.testing.assert_close(compiled(x, pos), twin(x, pos))
            torch.testing.assert_close(model.k_cache1, twin.k_cache1)
    assert found and all("causal_mask" in f for f in found), found


def test_a_mask_combined_with_and_stays_a_formula_and_odd_inputs_compile(monkeypatch):
    class Padded(torch.nn.Module):  # Hugging Face's way: causal & padding
        def __init__(self):
            super().__init__()
            self.register_buffer("bias", torch.tril(torch.ones(8, 8, dtype=torch.bool)))

        def forward(self, x, pad):
            keep = self.bias & pad[:, None, :]
            return x.masked_fill(~keep, -1.0)

    found = _formulas_found(monkeypatch)
    model = Padded()
    x, pad = torch.randn(2, 8, 8), torch.rand(2, 8) > 0.3
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(model, backend="tilefuse")(x, pad), model(x, pad))
    assert found and "bias" in found[0], found
    if torch.backends.mkldnn.is_available():  # (an input without storage: its memory cannot be compared)
        tril = torch.tril(torch.ones(4, 4))
        assert index_constants._shares_storage(tril, [torch.randn(4, 4).to_mkldnn()])
        assert index_constants._shares_storage(torch.randn(4, 4).to_mkldnn(), [tril])
