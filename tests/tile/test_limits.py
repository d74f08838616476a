"""Target limits of tile kernels (`tile.limits`, `tile.fit`, `backends.limits`): the shared
memory a Triton kernel's dots need, the largest tile, the C++ stack a program's arrays take
and the budget the threads' stacks allow; configurations that do not fit are made smaller
(stages first for shared memory, a persistent row looped), and one that can never fit is an
error, not a kernel."""
import math
from dataclasses import replace

import pytest
import torch

from irgraphs import GraphBuilder
from lowered_plans import recorded_lowerings
from tilefuse.backends.cpu import generate
from tilefuse.backends.cpu.stack import STACK_CEILING, stack_budget, stack_bytes, thread_stacks
from tilefuse.backends.limits import H200_SHARED_MEMORY, TRITON_MAX_NUMEL, kernel_check, target_limits
from tilefuse.fusion import plan_graph
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import cast
from tilefuse.tile.fit import LimitError, current_schedule, fit_kernels
from tilefuse.tile.limits import Limits, largest_tile, shared_memory_bytes, violation
from tilefuse.tile.lower import LoweringOptions, lower_plan_kernels
from tilefuse.tile.target import Target

GPU = LoweringOptions(target=Target.gpu(sm_count=132))
H200 = target_limits("triton")


def _matmul(m, n, k, dtype=dt.bfloat16):
    g = GraphBuilder("mm")
    a = g.input("a", (m, k), dtype, strides="contiguous")
    b = g.input("b", (k, n), dtype, strides="contiguous")
    mm = g.ctx.reduce((m, n), (k,), "sum",
                      lambda i, r: cast(a.load((i[0], r[0])), dt.float32) * cast(b.load((r[0], i[1])), dt.float32),
                      dt.float32)
    graph = g.output(mm)
    (plan,) = plan_graph(graph).kernels
    return graph, plan


def _rowsum(rows, width):
    g = GraphBuilder("rows")
    x = g.input("x", (rows, width))
    s = g.ctx.reduce((rows,), (width,), "sum", lambda i, r: x.load((i[0], r[0])) * x.load((i[0], r[0])), dt.float32)
    graph = g.output(s)
    (plan,) = plan_graph(graph).kernels
    return graph, plan


def _captured(fn, *args, **knobs):
    """(graph, plan, options) of each plan compiling `fn` lowers (C++ backend)."""
    import tilefuse

    torch._dynamo.reset()
    with recorded_lowerings() as seen, tilefuse.config.patch(target="cpu", fallback="error", **knobs):
        torch.compile(fn, backend="tilefuse", dynamic=False)(*args)
    return seen


def _attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v


def _flash_plan(d=128, rows=256):
    q, k, v = (torch.randn(1, 2, rows, d) for _ in range(3))
    found = [x for x in _captured(_attention, q, k, v) if x[1].kind == "flash"]
    assert found, "attention did not compile to a flash kernel"
    return found[0]


def test_shared_memory_of_a_matmul_is_its_pipelined_operand_tiles():
    graph, plan = _matmul(1024, 1024, 1024)
    cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "warps": 8, "stages": 3}
    (tk,) = lower_plan_kernels(graph, plan, replace(GPU, schedule=cfg))
    assert shared_memory_bytes(tk) == 3 * (128 * 64 + 64 * 128) * 2
    assert violation(tk, H200) is None
    big = {**cfg, "BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 128, "stages": 5}
    (tk,) = lower_plan_kernels(graph, plan, replace(GPU, schedule=big))
    found = violation(tk, H200)
    assert found is not None and found.resource == "shared memory" and "227 KiB" in str(found)


def test_shared_memory_of_attention_counts_q_once_and_not_the_probabilities():
    graph, plan, options = _flash_plan(d=128)
    gpu = replace(options, target=Target.gpu(), schedule={"BLOCK_M": 64, "BLOCK_N": 32, "warps": 4, "stages": 3, "split": 1})
    (tk,) = lower_plan_kernels(graph, plan, gpu)
    # K and V tiles pipelined over 3 stages, the Q tile once (fp32): flash_space's own formula
    assert shared_memory_bytes(tk) == 3 * 32 * (128 + 128) * 4 + 64 * 128 * 4


def _causal(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    i = torch.arange(s.shape[-2])[:, None]
    j = torch.arange(s.shape[-1])[None, :]
    return torch.softmax(torch.where(j > i, float("-inf"), s), dim=-1) @ v


def test_sequential_key_loops_share_their_shared_memory():
    """Causal attention walks its masked and its unmasked key tiles in separate loops; Triton
    allocates shared memory by liveness, so they take what one loop takes (checked on Triton
    3.9's sm_90 compile: one, two and three such loops report the same `shared` bytes)."""
    q, k, v = (torch.randn(1, 2, 256, 128) for _ in range(3))
    graph, plan, options = next(x for x in _captured(_causal, q, k, v) if x[1].kind == "flash")
    gpu = replace(options, target=Target.gpu(), schedule={"BLOCK_M": 64, "BLOCK_N": 32, "warps": 4, "stages": 3, "split": 1})
    (tk,) = lower_plan_kernels(graph, plan, gpu)
    loops = [s for s in tk.body if type(s).__name__ == "For"]
    assert len(loops) >= 2, str(tk)
    assert shared_memory_bytes(tk) == 3 * 32 * (128 + 128) * 4 + 64 * 128 * 4


def test_fit_lowers_stages_then_halves_the_largest_block():
    graph, plan = _matmul(1024, 1024, 1024)
    big = {"BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8, "warps": 8, "stages": 5}
    options = replace(GPU, schedule=big, target=replace(GPU.target, limits=H200))
    fitted = fit_kernels(graph, plan, options, lambda tk: violation(tk, H200), lower_plan_kernels)
    assert fitted.replaced == big and fitted.violation.resource == "shared memory"
    assert fitted.schedule == {**big, "BLOCK_M": 128, "stages": 2}
    assert all(violation(tk, H200) is None for tk in fitted.kernels)
    assert "compiled with" in fitted.describe()


def test_a_tile_over_tritons_element_limit_is_halved():
    graph, plan = _rowsum(8, 1 << 16)
    wide = {"persistent": True, "RBLOCK": 1 << 16, "XBLOCK": 64, "warps": 16}
    (tk,) = lower_plan_kernels(graph, plan, replace(GPU, schedule=wide))
    assert largest_tile(tk)[1] == 1 << 22 > TRITON_MAX_NUMEL
    assert violation(tk, H200).resource == "elements"
    fitted = fit_kernels(graph, plan, replace(GPU, schedule=wide), lambda tk: violation(tk, H200), lower_plan_kernels)
    assert fitted.schedule["XBLOCK"] * fitted.schedule["RBLOCK"] <= TRITON_MAX_NUMEL
    # warps: a power of two up to 32
    (tk,) = lower_plan_kernels(graph, plan, replace(GPU, schedule={**wide, "XBLOCK": 1, "warps": 48}))
    assert violation(tk, H200).resource == "warps"


def test_a_persistent_row_over_the_stack_budget_becomes_a_looped_row():
    x = torch.randn(4, 65536)
    ((graph, plan, options),) = _captured(lambda x: torch.softmax(x * 2, -1) * x, x, persistent_reduction_limit=65536)
    assert current_schedule(graph, plan, options)["persistent"]
    small = Limits("cpu", stack_bytes=64 * 1024)
    check = kernel_check("cpu", small)
    (tk,) = lower_plan_kernels(graph, plan, options)
    assert stack_bytes(generate(tk)) >= 65536 * 4 and check(tk).resource == "stack"
    fitted = fit_kernels(graph, plan, options, check, lower_plan_kernels)
    assert fitted.replaced["persistent"] and not fitted.schedule["persistent"]
    assert check(fitted.kernels[0]) is None


def test_nothing_fits_is_a_limit_error():
    graph, plan = _rowsum(4, 4096)
    hopeless = Limits("cpu", stack_bytes=8)
    with pytest.raises(LimitError, match="no configuration fits"):
        fit_kernels(graph, plan, LoweringOptions(target=Target.cpu()), kernel_check("cpu", hopeless), lower_plan_kernels)


def test_stack_bytes_counts_the_kernels_arrays():
    source = '''
static inline void helper() { float not_counted[999]; }
extern "C" void k(void* const* tf_ptrs, const int64_t* tf_sizes, const int64_t* tf_grid, int32_t tf_threads) {
    alignas(64) float a[1024];
    alignas(64) uint8_t m[64];
        double acc_lanes[16];
    int64_t x;
}
'''
    assert stack_bytes(source) == 1024 * 4 + 64 + 16 * 8


def test_stack_budget_follows_the_smallest_thread_stack(monkeypatch):
    monkeypatch.delenv("OMP_STACKSIZE", raising=False)
    monkeypatch.delenv("GOMP_STACKSIZE", raising=False)
    monkeypatch.delenv("KMP_STACKSIZE", raising=False)
    assert stack_budget() <= STACK_CEILING and stack_budget() <= min(thread_stacks().values()) // 4
    monkeypatch.setenv("OMP_STACKSIZE", "512K")
    assert thread_stacks()["openmp"] == 512 * 1024 and stack_budget() == 128 * 1024
    monkeypatch.setenv("OMP_STACKSIZE", "64")  # no unit: KiB
    assert stack_budget() == 16 * 1024
    assert target_limits("cpu").stack_bytes == 16 * 1024


def test_gpu_limits_without_a_gpu_are_the_h200s():
    limits = target_limits("triton")
    assert limits.shared_memory == H200_SHARED_MEMORY == 227 * 1024
    assert limits.max_numel == 1 << 20 and limits.max_warps == 32
    assert target_limits("interpret").shared_memory is None


def test_default_configurations_fit():
    """The rules' own choices never trip the limits (no warning on an ordinary model)."""
    for graph, plan, options in _captured(_attention, *(torch.randn(1, 2, 256, 256) for _ in range(3))):
        for tk in lower_plan_kernels(graph, plan, options):
            assert kernel_check("cpu", target_limits("cpu"))(tk) is None
            assert violation(tk, H200) is None
    graph, plan = _matmul(4096, 4096, 4096)
    assert all(violation(tk, H200) is None for tk in lower_plan_kernels(graph, plan, GPU))
