"""Row tiles (`tile.row_tiles`): a flash program's rows as several independent tiles sharing each
key tile. The transformed kernels run through the C++ backend and the Triton interpreter against
an fp64 eager reference; the transformation shares what does not depend on the rows, renames what
does, refuses kernels whose loops depend on the rows, and the GPU's rules and search offer it only
where it applies."""
import math
from dataclasses import replace

import pytest
import sympy
import torch

import tilefuse
from lowered_plans import plans_of, recorded_lowerings
from tilefuse.errors import ConfigError
from tilefuse.tile import flash
from tilefuse.tile.ir import Arange, DotTile, For, LoadTile, statements
from tilefuse.tile.limits import shared_memory_bytes
from tilefuse.tile.common import tile_symbol
from tilefuse.tile.lower import lower_plan_kernels, schedule_space
from tilefuse.tile.row_tiles import jam_rows
from tilefuse.tile.target import Target
from tilefuse.tile.verify import verify_tile_kernel


def _plain(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v


def _softcap(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(torch.tanh(s / 7.0) * 7.0, dim=-1) @ v


def _biased(q, k, v, bias):
    return torch.softmax(q @ k.transpose(-1, -2) * 0.3 + bias, dim=-1) @ v


def _causal(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    i = torch.arange(s.shape[-2])[:, None]
    j = torch.arange(s.shape[-1])[None, :]
    return torch.softmax(torch.where(j > i, float("-inf"), s), dim=-1) @ v


def _flash_of(fn, *args, **knobs):
    torch._dynamo.reset()
    with recorded_lowerings() as seen, tilefuse.config.patch(target="cpu", fallback="error", **knobs):
        torch.compile(fn, backend="tilefuse", dynamic=False)(*args)
    found = [x for x in seen if x[1].kind == "flash"]
    assert found, "no flash kernel"
    return found[0]


def _plan_only(fn, *args):
    """The flash plan compiling `fn` lowers, captured without running it (large shapes)."""
    return next(x for x in plans_of(fn, *args) if x[1].kind == "flash")


def _gpu(options, schedule):
    return replace(options, target=Target.gpu(sm_count=132), schedule=schedule)


def _rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def test_a_program_carries_two_row_tiles_that_share_each_key_tile():
    graph, plan, options = _flash_of(_plain, *(_rand(1, 2, 256, 64) for _ in range(3)))
    schedule = {"BLOCK_M": 64, "BLOCK_N": 32, "warps": 4, "stages": 3, "row_tiles": 1}
    (one,) = lower_plan_kernels(graph, plan, _gpu(options, schedule))
    (two,) = lower_plan_kernels(graph, plan, _gpu(options, {**schedule, "row_tiles": 2}))
    verify_tile_kernel(two)
    loop_one = next(s for s in one.body if isinstance(s, For))
    loop_two = next(s for s in two.body if isinstance(s, For))
    loads_one = [s for s in statements(loop_one.body) if isinstance(s, LoadTile)]
    loads_two = [s for s in statements(loop_two.body) if isinstance(s, LoadTile)]
    assert len(loads_two) == len(loads_one)  # K and V tiles loaded once for both row tiles
    dots_one = [s for s in statements(loop_one.body) if isinstance(s, DotTile)]
    dots_two = [s for s in statements(loop_two.body) if isinstance(s, DotTile)]
    assert len(dots_two) == 2 * len(dots_one)
    assert one.grid_size({})[0] == 256 // 64 and two.grid_size({})[0] == 256 // (2 * 64)
    # the Q tiles twice, the pipelined K and V tiles once
    assert shared_memory_bytes(two) == shared_memory_bytes(one) + 64 * 64 * 4
    assert any("2 row tiles" in n for n in plan.notes)


def test_a_causal_kernel_visits_the_union_of_its_row_tiles_keys():
    graph, plan, options = _flash_of(_causal, *(_rand(1, 2, 256, 64) for _ in range(3)))
    schedule = {"BLOCK_M": 64, "BLOCK_N": 32, "warps": 4, "stages": 3}
    (kernel,) = lower_plan_kernels(graph, plan, _gpu(options, schedule))
    jammed, why = jam_rows(kernel, 2)  # (bounds computed for one row tile: refused)
    assert jammed is None and ("pid" in why or "loop" in why), why
    (two,) = lower_plan_kernels(graph, plan, _gpu(options, {**schedule, "row_tiles": 2}))
    assert _jammed([two])
    program = {tile_symbol("BLOCK_M"): 2 * tile_symbol("BLOCK_M")}
    loops_one = [s for s in statements(kernel.body) if isinstance(s, For)]
    loops_two = [s for s in statements(two.body) if isinstance(s, For)]
    assert len(loops_one) == len(loops_two) == 2  # the unmasked interior, then the diagonal
    for one, both in zip(loops_one, loops_two):
        for a, b in ((one.start, both.start), (one.stop, both.stop)):
            assert sympy.simplify(sympy.sympify(a.expr).xreplace(program) - b.expr) == 0


def test_a_mask_read_from_data_keeps_one_row_tile():
    q, k, v = (_rand(1, 2, 256, 32) for _ in range(3))
    mask = torch.rand(256, 256) > 0.5

    def masked(q, k, v, mask):
        s = q @ k.transpose(-1, -2) * 0.2
        return torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1) @ v

    graph, plan, options = _flash_of(masked, q, k, v, mask)
    schedule = {"BLOCK_M": 64, "BLOCK_N": 32, "warps": 4, "stages": 3}
    one = lower_plan_kernels(graph, plan, _gpu(options, {**schedule, "row_tiles": 1}))
    notes = sum("reads tensor data" in n for n in plan.notes)
    kept = lower_plan_kernels(graph, plan, _gpu(options, {**schedule, "row_tiles": 2}))
    assert sum("reads tensor data" in n for n in plan.notes) == notes + 1  # (not once per attempt)
    assert not _jammed(kept)
    assert [str(x) for x in kept] == [str(x) for x in one]
    assert any("one row tile per program" in n for n in plan.notes)


def _jammed(kernels) -> bool:
    return any(isinstance(s, Arange) and s.name == "rm_r1" for kern in kernels for s in statements(kern.body))


@pytest.mark.parametrize("fn", [_plain, _softcap, _causal], ids=["plain", "softcap", "causal"])
# (48 and 96 rows: whole tiles of 16 rows, but not whole programs of 32 or 64: the last program's
# second tile lies past the rows and must be masked)
@pytest.mark.parametrize("shape", [(2, 3, 100, 32), (1, 2, 257, 40), (2, 1, 48, 16), (1, 2, 96, 32)])
@pytest.mark.parametrize("row_tiles", [2, 4])
def test_row_tiles_compute_what_eager_computes_on_the_cpu(fn, shape, row_tiles):
    q, k, v = (_rand(*shape) for _ in range(3))
    torch._dynamo.reset()
    kernels = []
    compiled = tilefuse.compile(fn, target="cpu", fallback="error", flash_config=f"16,32,1,1,{row_tiles}")
    with recorded_lowerings(kernels):
        out = compiled(q, k, v)
    assert _jammed(kernels)
    ref = fn(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_row_tiles_with_a_broadcast_bias_and_non_contiguous_inputs():
    b, h, n, d = 2, 3, 70, 24
    q = _rand(b, n, h, d).transpose(1, 2)  # (strided: heads inside tokens)
    k, v = _rand(b, h, d, n).transpose(-1, -2), _rand(b, h, n, d)
    bias = _rand(1, h, 1, n)  # per head and key, broadcast over batch and rows
    torch._dynamo.reset()
    compiled = tilefuse.compile(_biased, target="cpu", fallback="error", flash_config="16,32,1,1,2")
    kernels = []
    with recorded_lowerings(kernels):
        out = compiled(q, k, v, bias)
    assert _jammed(kernels)
    ref = _biased(q.double(), k.double(), v.double(), bias.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_row_tiles_through_the_triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = (_rand(1, 2, 97, 32, dtype=torch.float16) for _ in range(3))
    torch._dynamo.reset()
    compiled = tilefuse.compile(_softcap, target="interpret", fallback="error", flash_config="16,32,4,1,2")
    kernels = []
    with recorded_lowerings(kernels):
        out = compiled(q, k, v)
    assert _jammed(kernels)
    ref = _softcap(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), ref, rtol=2e-3, atol=2e-3)


def test_the_gpu_rules_take_two_row_tiles_where_they_measured_faster():
    bf16 = torch.bfloat16
    graph, plan, options = _flash_of(_plain, *(_rand(1, 2, 1024, 64, dtype=bf16) for _ in range(3)))
    gpu = replace(options, target=Target.gpu(sm_count=132))
    assert flash.current_flash_schedule(graph, plan, gpu)["row_tiles"] == 2
    space = schedule_space(graph, plan, gpu)
    assert space.knobs["row_tiles"] == (1, 2) and "row_tiles" in space.families
    # a schedule tuned before the knob existed keeps one row tile
    old = replace(gpu, schedule={"BLOCK_M": 128, "BLOCK_N": 64, "warps": 8, "stages": 3})
    assert flash.current_flash_schedule(graph, plan, old)["row_tiles"] == 1
    # 1088 rows: whole 64-row tiles, not whole programs of two: the rows are masked
    graph, plan, options = _plan_only(_plain, *(torch.empty(4, 8, 1088, 64, dtype=bf16) for _ in range(3)))
    (kernel,) = lower_plan_kernels(graph, plan, replace(options, target=Target.gpu(sm_count=132)))
    assert _jammed([kernel]) and "mmask" in str(kernel)
    short = _flash_of(_plain, *(_rand(1, 2, 256, 64, dtype=bf16) for _ in range(3)))
    assert flash.current_flash_schedule(short[0], short[1], replace(short[2], target=Target.gpu()))["row_tiles"] == 1
    graph, plan, options = _flash_of(_causal, *(_rand(1, 2, 1024, 64, dtype=bf16) for _ in range(3)))
    gpu = replace(options, target=Target.gpu(sm_count=132))
    assert flash.current_flash_schedule(graph, plan, gpu)["row_tiles"] == 1  # (the rules: unmasked only)
    space = schedule_space(graph, plan, gpu)
    assert space.knobs["row_tiles"] == (1, 2)  # the search may take them for a causal mask
    mask = torch.rand(1024, 1024) > 0.5
    graph, plan, options = _flash_of(lambda q, k, v, m: torch.softmax((q @ k.transpose(-1, -2)).masked_fill(
        m, float("-inf")), dim=-1) @ v, *(_rand(1, 2, 1024, 64, dtype=bf16) for _ in range(3)), mask)
    space = schedule_space(graph, plan, replace(options, target=Target.gpu(sm_count=132)))
    assert "row_tiles" not in space.knobs and "row_tiles" not in space.default  # (a block summary's ranges)
    # head dim 128, unmasked or causal: two 128-row tiles of 64 keys with 8 warps
    for fn in (_plain, _causal):
        graph, plan, options = _flash_of(fn, *(_rand(1, 2, 1024, 128, dtype=bf16) for _ in range(3)))
        rules = flash.current_flash_schedule(graph, plan, replace(options, target=Target.gpu(sm_count=132)))
        assert [rules[k] for k in ("BLOCK_M", "BLOCK_N", "warps", "row_tiles")] == [128, 64, 8, 2]
    # every schedule the search offers fits the registers: two 128-row tiles of 64 keys, not of 128
    graph, plan, options = _flash_of(_plain, *(_rand(1, 2, 1024, 128, dtype=bf16) for _ in range(3)))
    space = schedule_space(graph, plan, replace(options, target=Target.gpu(sm_count=132)))
    jammed = [s for s in space.schedules() if s.get("row_tiles") == 2]
    assert any(s["BLOCK_M"] == 128 and s["BLOCK_N"] == 64 and s["warps"] == 8 for s in jammed)
    assert not any(s["BLOCK_M"] == 128 and s["BLOCK_N"] == 128 for s in jammed)


@pytest.mark.parametrize("value", ["64,64,4,3,3", "64,64,4,3,2,1", "64,64,4,3,x"])
def test_flash_config_rejects_a_bad_row_tile_count(value):
    with pytest.raises(ConfigError):
        with tilefuse.config.patch(flash_config=value):
            pass


def _window(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    i = torch.arange(s.shape[-2])[:, None]
    j = torch.arange(s.shape[-1])[None, :]
    return torch.softmax(torch.where((j > i) | (j < i - 256), float("-inf"), s), dim=-1) @ v


def test_the_rules_keep_one_row_tile_where_the_first_live_key_moves_with_the_rows():
    # (a sliding window: two tiles would each visit the union of their keys, w + 2·BLOCK_M)
    bf16 = torch.bfloat16
    graph, plan, options = _flash_of(_window, *(_rand(1, 2, 1024, 128, dtype=bf16) for _ in range(3)))
    gpu = replace(options, target=Target.gpu(sm_count=132))
    assert flash.current_flash_schedule(graph, plan, gpu)["row_tiles"] == 1
    assert schedule_space(graph, plan, gpu).knobs["row_tiles"] == (1, 2)  # (the search measures them)


@pytest.mark.parametrize("backend", ["cpu", "interpret"])
def test_row_tiles_under_a_sliding_window_match_eager(backend):
    q, k, v = (_rand(1, 2, 300 if backend == "cpu" else 90, 16) for _ in range(3))
    torch._dynamo.reset()
    compiled = tilefuse.compile(_window, target=backend, fallback="error", flash_config="16,32,4,1,2")
    kernels = []
    with recorded_lowerings(kernels):
        out = compiled(q, k, v)
    assert _jammed(kernels)
    torch.testing.assert_close(out.double(), _window(q.double(), k.double(), v.double()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "interpret"])
def test_row_tiles_in_the_backward_give_eagers_gradients(backend):
    # (the search offers them to forward kernels only — measured slower in dK/dV — but a
    # flash_config asks every flash kernel of the step, the backward's included)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 77 if backend == "cpu" else 45, 32, generator=g).requires_grad_() for _ in range(3))
    grad = torch.randn(q.shape, generator=g)
    torch._dynamo.reset()
    kernels = []
    compiled = tilefuse.compile(_causal, target=backend, fallback="error", flash_config="16,16,4,1,2")
    with recorded_lowerings(kernels):
        compiled(q, k, v).backward(grad)
    assert sum(_jammed([kern]) for kern in kernels) >= 3  # the forward, dQ and dK/dV
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    _causal(*exact).backward(grad.double())
    for got, want in zip((q, k, v), exact):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-5, atol=2e-5)
