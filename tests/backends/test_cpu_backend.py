"""The CPU backend (tile IR → C++ → shared library): every expression's semantics against
eager with an fp64 reference, each kind of kernel (pointwise, persistent and looped
reductions, contractions, flash attention, split-and-merge scratch), bf16, odd and symbolic
sizes, non-contiguous inputs; the disk cache; the fallbacks (no compiler, unprintable IR)."""
import math
import warnings

import re

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from frontend.lowering_harness import assert_close_fp64, flatten, noncontig, rand, to_fp64
from tilefuse.backends import cpu
from tilefuse.backends.cpu import toolchain
from tilefuse.passes.unroll_reductions import UNROLL_MAX

#: what starts a kernel's range function (its body: the entry after it only spreads its programs)
RANGE_ATTRIBUTE = "__attribute__((noinline))"
RANGE_FUNCTION = 'extern "C" void ' + RANGE_ATTRIBUTE

pytestmark = pytest.mark.skipif(cpu.find_compiler() is None, reason="no C++ compiler")


def run_cpu(fn, *inputs, dynamic=False, **options):
    """Compile with the CPU backend, compare with eager by the fp64 rule; returns the explanation."""
    torch._dynamo.reset()
    expected = fn(*inputs)
    try:
        ref64 = fn(*to_fp64(list(inputs)))
    except RuntimeError:
        ref64 = expected
    with tilefuse.config.patch(target="cpu", fallback="error", **options):
        ex = tilefuse.explain(fn, *inputs, dynamic=dynamic)
        torch._dynamo.reset()
        actual = torch.compile(fn, backend="tilefuse", dynamic=dynamic)(*inputs)
    for k, (a, e, r) in enumerate(zip(flatten(actual), flatten(expected), flatten(ref64))):
        assert_close_fp64(a, e, r, name=f"output {k}")
    assert ex.reports and all(r.backend == "cpu" for r in ex.reports)
    for k in ex.kernels:
        assert "not printable as C++" not in " ".join(k.notes), k.notes
    return ex


# ------------------------------------------------------------------ expression semantics
SPECIAL = torch.tensor([0.0, -0.0, 1.5, -2.5, 2.5, 0.5, -0.5, float("inf"), float("-inf"), float("nan"), 3.0, -7.0,
                        1e-30, 88.5, -100.0, 1e4])


@pytest.mark.parametrize("op", [
    torch.exp, torch.exp2, torch.tanh, torch.sigmoid, torch.erf, torch.erfc, torch.log, torch.log1p, torch.expm1,
    torch.sqrt, torch.rsqrt, torch.sin, torch.cos, torch.round, torch.floor, torch.ceil, torch.trunc, torch.abs,
    torch.sign, torch.atan, torch.asinh, torch.reciprocal, torch.isnan, torch.isinf, torch.log10,
])
def test_unary_math_matches_eager(op):
    x = torch.cat([SPECIAL, rand(37, low=-6, high=6)])
    run_cpu(lambda t: op(t), x)


def test_nan_propagating_max_min_and_where():
    a = torch.tensor([1.0, float("nan"), 3.0, -1.0, float("nan")] * 7)
    b = torch.tensor([2.0, 0.0, float("nan"), -2.0, float("nan")] * 7)
    run_cpu(lambda x, y: (torch.maximum(x, y), torch.minimum(x, y), torch.where(x > y, x, y * 2)), a, b)


def test_nan_in_max_reduction_and_argmax():
    x = rand(9, 300)
    x[2, 17] = float("nan")
    x[5, 3] = float("inf")
    run_cpu(lambda t: (t.amax(-1), t.amin(-1), t.argmax(-1), t.argmin(-1)), x)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_integer_division_remainder_and_shifts(dtype):
    a = torch.randint(-50, 50, (61,), dtype=dtype)
    b = torch.randint(1, 9, (61,), dtype=dtype) * torch.where(torch.rand(61) > 0.5, 1, -1).to(dtype)
    run_cpu(lambda x, y: (torch.div(x, y, rounding_mode="floor"), torch.remainder(x, y), torch.fmod(x, y),
                          torch.div(x, y, rounding_mode="trunc"), x & y, x | y, x ^ y, ~x, x << 3, x >> 2), a, b)


def test_float_floor_divide_and_remainder():
    a, b = rand(53, low=-9, high=9), rand(53, low=-3, high=3)
    run_cpu(lambda x, y: (torch.div(x, y, rounding_mode="floor"), torch.remainder(x, y), torch.fmod(x, y),
                          torch.pow(x.abs(), y), torch.atan2(x, y), torch.copysign(x, y)), a, b)


def test_casts_round_like_eager():
    x = torch.cat([SPECIAL[:7], rand(40, low=-300, high=300)])
    fn = lambda t: (t.to(torch.int32), t.to(torch.int64), t.to(torch.bfloat16), t.to(torch.float16), t.to(torch.bool),
                    (t * 1e-3).to(torch.bfloat16).float() + 1, t.to(torch.int8).to(torch.float32))
    run_cpu(fn, x)


def test_widened_integers_convert_to_float_exactly():
    """int64 values that hold a bool or a 32-bit integer convert through int32 (`narrow_ints`):
    the extremes of int32 and of int8, and a comparison widened as `one_hot` widens it."""
    i = torch.tensor([-2**31, 2**31 - 1, -129, 127, 0, 1, -1, 16777217], dtype=torch.int32)
    b = torch.randint(-128, 128, (8,), dtype=torch.int8)
    x = rand(8)
    ex = run_cpu(lambda i, b, x: (i.long().float() * x, b.long().double() + x, (x > 0).long().float() * x,
                                  F.one_hot(i.abs().remainder(8).long(), 8).float()), i, b, x)
    assert any(re.search(r"\(float\)\(\(int32_t\)\(", k.source) for k in ex.kernels)


def _strided_window_max(x):
    p = F.pad(torch.relu(x), (1, 1, 1, 1), value=float("-inf"))
    out = p[..., 0:16:2, 0:16:2]
    for dy in range(3):
        for dx in range(3):
            out = torch.maximum(out, p[..., dy:dy + 16:2, dx:dx + 16:2])
    return out


@pytest.mark.parametrize("fn,make", [
    (_strided_window_max, lambda: (rand(2, 3, 16, 16),)),
    (lambda x: F.pad(x, (3, 2), value=-1.5)[..., ::2].sum(-1), lambda: (rand(5, 301),)),  # a peeled row reduction
    (lambda x, i: torch.where(i > 0, F.pad(x, (1, 0))[:, ::3], 0.0).amax(-1) + F.pad(x, (1, 0))[:, ::3].mean(-1),
     lambda: (rand(7, 200), torch.randint(-2, 3, (7, 67)))),
])
def test_strided_masked_loads_are_staged_and_match(fn, make):
    """A masked load read at a stride keeps GCC from vectorising its loop: it is loaded in a
    scalar pass first (`loop_plan.staged_loads`), and the results stay eager's."""
    ex = run_cpu(fn, *make())
    assert any("tf_staged_" in k.source for k in ex.kernels), [k.source for k in ex.kernels]


def test_comparisons_and_logical_ops():
    a, b = rand(5, 7), rand(5, 7)
    run_cpu(lambda x, y: ((x > y) & (x < 1), (x >= y) | (y <= 0), (x == x) ^ (y != 0), torch.logical_not(x > 0)), a, b)


# ------------------------------------------------------------------ kernels
def rmsnorm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (33, 100), (4, 4096), (3, 10000)])
def test_normalisations_and_softmax(shape, dtype):
    x, w, b = rand(*shape, dtype=dtype), rand(shape[-1], dtype=dtype), rand(shape[-1], dtype=dtype)
    ex = run_cpu(lambda t, w, b: (rmsnorm(t, w), F.layer_norm(t, (t.shape[-1],), w, b), torch.softmax(t, -1),
                                  torch.log_softmax(t.float(), -1)), x, w, b)
    # (a row of at most UNROLL_MAX elements is summed as pointwise terms: no reduction kernel)
    assert any(k.kind == "reduction" for k in ex.kernels) == (shape[-1] > UNROLL_MAX)


def test_pointwise_broadcasting_and_noncontiguous_inputs():
    x = noncontig(17, 29)
    y = noncontig(17, 29, kind="s")
    z = rand(29)
    run_cpu(lambda a, b, c: F.gelu(a) * b + c.exp(), x, y, z)


def test_broadcast_operands_at_flattened_indices():
    """Row and column broadcasts: rows of 8 elements or more are walked in tiles of rows ×
    columns (each operand read once per row or column; a row of 1000 in blocks masked at its
    end); a row of 5 is walked flat, its operands read at `mod`/`floor` of the flattened index,
    the block start's part split off and the lane's part divided in 32 bits. fp32 and bf16,
    against eager."""
    for rows, cols in ((37, 4096), (5, 6144), (9, 1000), (3, 2048 * 3 + 16), (301, 5)):
        for dtype in (torch.float32, torch.bfloat16):
            x, b, c = rand(rows, cols, dtype=dtype), rand(cols, dtype=dtype), rand(rows, 1, dtype=dtype)
            ex = run_cpu(lambda x, b, c: torch.tanh(x + b) * c, x, b, c)
            src = ex.kernels[0].source
            assert ("CBLOCK" in src) == (cols != 5), src
            assert ("(int32_t)((xindex % 5) + tf_j)" in src) == (cols == 5), src


def test_whole_blocks_run_without_their_bound_masks():
    """A program whose tile can run past the end is printed twice: for a whole block with its
    bound masks taken as true (no masked load or store), and as planned for the last block —
    a flat walk of a ragged size, a 2-D tile whose last rows and columns are masked, and a
    symbolic size (the condition reads the size argument). All against eager by the fp64 rule."""
    def function(ex):
        return ex.kernels[0].source.split('extern "C" void')[1]

    src = function(run_cpu(lambda x: torch.sigmoid(x) * 3, rand(5000)))
    head, rest = src.split("if ((xindex + XBLOCK <= 5000)) {")
    whole, last = rest.split("} else {")
    assert "(xmask" not in whole and "(true) ?" in whole, src  # no load or store reads the mask
    assert "if (xmask" in last and "(xmask1_v) ?" in last, src
    y, b = rand(37, 2053), rand(37, 1)
    src = function(run_cpu(lambda y, b: torch.tanh(y) * b, y, b))
    assert "(yindex + YBLOCK <= 37)" in src and "(cindex + CBLOCK <= 2053)" in src, src
    for n in (4099, 37):
        src = function(run_cpu(lambda x: torch.sigmoid(x) * 3, rand(n), dynamic=True))
        assert "(xindex + XBLOCK <= s" in src, src
    src = function(run_cpu(lambda x: x * 2, rand(4096)))
    assert "} else {" not in src, src  # whole blocks only: one version


def test_column_and_middle_axis_reductions():
    x = rand(6, 50, 9)
    run_cpu(lambda t: (t.sum(0), t.amax(1), t.mean(-1), t.prod(1), (t > 0).any(1), (t > -5).all(0)), x)


def test_symbolic_shapes():
    for n in (5, 37):
        x, w = rand(n, 300), rand(300)
        run_cpu(lambda t, w: torch.softmax(t * w, -1) + rmsnorm(t, w), x, w, dynamic=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_contraction_with_epilogue(dtype):
    x, w, b = rand(33, 40, dtype=dtype), rand(40, 70, dtype=dtype, low=-0.3, high=0.3), rand(70, dtype=dtype)
    ex = run_cpu(lambda a, w, b: F.gelu(a @ w + b), x, w, b, matmul="generated")
    assert [k.kind for k in ex.kernels] == ["contraction"]
    ex = run_cpu(lambda a, w, b: F.gelu(a @ w + b), x[:9, :20], w[:20, :30], b[:30])  # below the ATen rule
    assert [k.kind for k in ex.kernels] == ["contraction"]


def _split(ex):
    return [k.kind for k in ex.kernels] == ["aten-matmul", "pointwise"] * (len(ex.kernels) // 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_product_with_epilogue_runs_through_aten_then_a_pointwise_epilogue(dtype):
    """A product large enough for ATen keeps its epilogue in a generated pointwise kernel that
    reads the product rounded to its dtype, as the fused kernel did."""
    x, b = rand(67, 45, dtype=dtype), rand(71, dtype=dtype)
    w = noncontig(45, 71, dtype=dtype, low=-0.3, high=0.3)  # F.linear's transposed weight, as a view
    ex = run_cpu(lambda a, w, b: F.gelu(a @ w + b) * 2, x, w, b)
    assert _split(ex) and len(ex.kernels) == 2, [k.kind for k in ex.kernels]
    # F.linear of a 3-D input (a flattened view of the batch) with bias and an activation
    x3, wl = rand(3, 29, 45, dtype=dtype), rand(71, 45, dtype=dtype, low=-0.3, high=0.3)
    ex = run_cpu(lambda a, w, b: torch.tanh(F.linear(a, w, b)), x3, wl, b)
    # (bf16 addmm adds the bias to the fp32 product: no bf16 library product to reuse)
    assert _split(ex) == (dtype == torch.float32), [k.kind for k in ex.kernels]
    ex = run_cpu(lambda a, w, b: torch.tanh(F.linear(a, w) + b), x3, wl, b)
    assert _split(ex), [k.kind for k in ex.kernels]
    # batched, a non-contiguous operand, an epilogue with a second output
    a, c = rand(3, 40, 33, dtype=dtype), noncontig(3, 33, 50, dtype=dtype)
    ex = run_cpu(lambda a, c: (lambda p: (torch.relu(p), p.sigmoid() * 3))(torch.bmm(a, c) / 4), a, c)
    assert _split(ex), [k.kind for k in ex.kernels]


def test_mlp_epilogues_with_symbolic_sizes():
    def mlp(x, w1, b1, w2, b2):
        return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)

    for n in (37, 5):
        args = (rand(n, 40), rand(96, 40, low=-0.2, high=0.2), rand(96), rand(24, 96, low=-0.1, high=0.1), rand(24))
        ex = run_cpu(mlp, *args, dynamic=True)
        # the first product's GELU is a kernel of its own; the second is addmm, bias included
        assert [k.kind for k in ex.kernels] == ["aten-matmul", "pointwise", "aten-matmul"], ex.kernels
        assert "torch.addmm(" in ex.kernels[-1].notes[-1]


def test_batched_contraction_with_transposed_operand():
    a, b = rand(3, 64, 48), noncontig(3, 48, 96)
    run_cpu(lambda x, y: torch.relu(torch.bmm(x, y)) * 2, a, b)


def test_plain_matmul_uses_aten_above_the_size_rule():
    a, b = rand(64, 64), rand(64, 64)
    ex = run_cpu(lambda x, y: x @ y, a, b)
    assert [k.kind for k in ex.kernels] == ["aten-matmul"]
    ex = run_cpu(lambda x, y: x @ y, rand(8, 8), rand(8, 8))
    assert [k.kind for k in ex.kernels] == ["contraction"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generated_products_of_every_register_block(dtype):
    """Tiles of several shapes reach each register block of the dot micro-kernel (and the
    plain loop for the rest); fp64 rule against eager."""
    from tilefuse.backends.cpu.dot import register_block

    shapes = ((64, 64), (4, 64), (4, 32), (8, 16), (4, 16), (2, 16), (64, 8))
    assert [register_block(m, n, 32) for m, n in shapes] == [(8, 2), (4, 4), (4, 2), (8, 1), (4, 1), None, None]
    # AVX2 or NEON: at most 4 accumulators of 16 floats stay in registers
    assert [register_block(m, n, 8) for m, n in shapes] == [(4, 1), (4, 1), (4, 1), (4, 1), (4, 1), (2, 1), None]
    assert register_block(2, 32, 8) == (2, 2)
    for m, k, n in ((5, 7, 3), (16, 33, 16), (33, 20, 70), (64, 64, 64), (100, 40, 17)):
        a, b = rand(m, k, dtype=dtype), noncontig(k, n, dtype=dtype, low=-0.5, high=0.5)
        run_cpu(lambda x, y: torch.relu(x @ y), a, b, matmul="generated")


@pytest.mark.parametrize("registers", [8, 32])
def test_register_blocks_of_either_register_file_compute_the_same(monkeypatch, registers):
    """The blocks chosen for a host with AVX-512 (32 registers of 16 floats) and for one without
    (8) are both correct on this host, whichever it is (the micro-kernel computes in the
    host's own vector width either way): products and the flash kernel against eager."""
    from tilefuse.backends.cpu import toolchain

    assert toolchain.vector_registers() in (8, 32)
    monkeypatch.setattr(toolchain, "vector_registers", lambda: registers)
    for m, k, n in ((64, 48, 64), (16, 32, 32)):
        a, b = rand(m, k), noncontig(k, n, low=-0.5, high=0.5)
        run_cpu(lambda x, y: torch.relu(x @ y), a, b, matmul="generated")
    q, k, v = (rand(1, 2, 96, 32) for _ in range(3))
    run_cpu(attention, q, k, v)


def test_dots_that_start_from_zero_skip_the_fill():
    """`s = full(0); s = dot(a, b) + s` (the flash kernel's scores): the register block starts
    at 0. P·V (`acc = rebased(acc) + dot(p, v)` from a zero tile) re-bases `acc` in place and
    accumulates into it: no zero fill, no arrays for the re-based tile and the product, no
    pass adding them. The products still match eager (plain and ragged tiles)."""
    for n in (128, 100):
        q, k, v = (rand(1, 2, n, 32) for _ in range(3))
        ex = run_cpu(attention, q, k, v)
        src = next(x.source for x in ex.kernels if x.kind == "flash").split('extern "C" void')[1]
        assert src.count(", true>(") == 1, src
        dots = [line for line in src.splitlines() if "tf_dot_rb" in line]
        out = dots[1].rstrip().rsplit(", ", 1)[1].rstrip(");")
        assert len(dots) == 2 and out.startswith("acc") and ", true>" not in dots[1], dots
        assert not any(n.startswith(("rebased", "pv")) for n in _arrays(src)), _arrays(src)


@pytest.mark.parametrize("dynamic", [False, True])
def test_flash_reads_q_and_v_tiles_in_place(dynamic):
    """Unmasked fp32 Q and V tiles whose rows are contiguous are read by the dot from the
    input (its row stride the leading dimension), not copied; a ragged (masked) tile, a V
    stored transposed and symbolic strides keep the copy. All against eager by the fp64 rule."""
    q, k = rand(1, 2, 128, 32), rand(1, 2, 128, 32)
    cases = ((rand(1, 2, 128, 32), 2), (rand(1, 2, 32, 128).transpose(-1, -2), 1),
             (rand(1, 2, 128, 64)[..., :32], 2))
    for v, in_place in cases:
        ex = run_cpu(attention, q, k, v, dynamic=dynamic)
        if dynamic:
            continue
        src = next(x.source for x in ex.kernels if x.kind == "flash").split('extern "C" void')[1]
        dots = [line for line in src.splitlines() if "tf_dot_rb" in line]
        assert sum("&ptr_" in d for d in dots) == in_place, dots
    ex = run_cpu(attention, *(rand(1, 2, 100, 32) for _ in range(3)))  # ragged: masked loads, copied
    src = next(x.source for x in ex.kernels if x.kind == "flash").split('extern "C" void')[1]
    assert not any("&ptr_" in line for line in src.splitlines() if "tf_dot_rb" in line)


def test_operands_read_in_place_without_a_register_block_are_copied_from_the_buffer(monkeypatch):
    """A tile the dots read in place is never loaded into an array; a dot without a register
    block (the plain loop) copies it from the buffer instead. Flash and generated products,
    against eager."""
    from tilefuse.backends.cpu import dot

    monkeypatch.setattr(dot, "register_block", lambda m, n: None)
    ex = run_cpu(attention, *(rand(1, 2, 128, 32) for _ in range(3)))
    flash = next(x for x in ex.kernels if x.kind == "flash")
    src = flash.source.split('extern "C" void')[1]
    assert src.startswith(f" {RANGE_ATTRIBUTE} {flash.name}__programs(") and "tf_dot_ikj<" in src and "tf_dot_rb" not in src, src
    run_cpu(lambda x, y: torch.relu(x @ y), rand(128, 96), rand(96, 128), matmul="generated")


def test_generated_product_reads_operands_in_place_with_their_row_stride():
    """A generated product whose unmasked A and B tiles have rows longer than the tile reads
    them in place with that row stride (the `_ld` micro-kernel); against eager."""
    a, b = rand(128, 96), rand(96, 128)
    ex = run_cpu(lambda x, y: torch.relu(x @ y), a, b, matmul="generated")
    src = ex.kernels[0].source.split('extern "C" void')[1]
    assert "tf_dot_rb_ld<" in src or "&ptr_" in src, src


@pytest.mark.parametrize("dynamic", [False, True])
def test_flash_reads_key_tiles_by_register_transposes(dynamic):
    """Whole Kᵀ tiles (no ragged edge) read from K rows (head dim contiguous) are copied by
    16x16 register transposes; a K whose head dim is strided, or already stored transposed,
    keeps the element-wise copy. All against eager."""
    q, v = rand(1, 2, 128, 32), rand(1, 2, 128, 32)
    for k, transposes in ((rand(1, 2, 128, 32), True), (rand(1, 2, 32, 128).transpose(-1, -2), False),
                          (rand(1, 2, 128, 64)[..., ::2], False), (rand(2, 1, 128, 32).transpose(0, 1), True)):
        ex = run_cpu(attention, q, k, v, dynamic=dynamic)
        if dynamic:  # (symbolic sizes: correctness only, whichever kernels the planner chose)
            continue
        flash = [x for x in ex.kernels if x.kind == "flash"]
        assert flash and ("tf_load_t<" in flash[0].source.split('extern "C" void')[1]) == transposes


def test_large_outputs_get_the_huge_page_advice_and_keep_their_values(monkeypatch):
    from tilefuse.backends.cpu import launcher

    advised = []
    real = launcher.advise_huge_pages
    monkeypatch.setattr(launcher, "advise_huge_pages", lambda t: (advised.append(t.numel()), real(t)))
    x = rand(1030, 1100)  # 4.3 MiB
    run_cpu(lambda t: torch.softmax(t, -1) * 2, x)
    assert 1030 * 1100 in advised


@pytest.mark.parametrize("rows,cols,serial", [(7, 33, True), (64, 64, True), (600, 257, False)])
def test_kernels_with_little_work_run_on_one_thread(monkeypatch, rows, cols, serial):
    """A kernel without a dot whose buffers hold at most `SERIAL_MAX_BYTES` runs its programs on
    one thread (the general launch and the generated call's alike); larger ones keep them all.
    Fresh inputs on every call, against eager by the fp64 rule."""
    from tilefuse.backends.cpu import launcher

    spread = []
    real = launcher.CppKernel._threads_for
    monkeypatch.setattr(launcher.CppKernel, "_threads_for",
                        lambda self, b, p: (lambda n: (spread.append((p, n)), n)[1])(real(self, b, p)))
    fn = lambda x, w: F.layer_norm(x, (x.shape[-1],), w) * 2  # noqa: E731
    torch._dynamo.reset()
    with tilefuse.config.patch(target="cpu", fallback="error"):
        compiled = torch.compile(fn, backend="tilefuse")
        for k in range(4):  # the general call, then the generated one
            x, w = rand(rows, cols), rand(cols)
            assert_close_fp64(compiled(x, w), fn(x, w), fn(*to_fp64([x, w])), name=f"call {k}")
    assert spread and all(p > 1 for p, _ in spread), spread  # (a program per row)
    assert all((n == 1) == serial for _, n in spread), spread


def test_kernels_with_a_dot_keep_their_threads(monkeypatch):
    """A dot's work grows faster than its operands' bytes: a small generated product (130 rows,
    three programs, 25 KB of buffers) still spreads its programs over the threads."""
    from tilefuse.backends.cpu import launcher

    spread = []
    real = launcher.CppKernel._threads_for
    monkeypatch.setattr(launcher.CppKernel, "_threads_for",
                        lambda self, b, p: (lambda n: (spread.append((self.kernel.name, p, n)), n)[1])(real(self, b, p)))
    run_cpu(lambda a, b: torch.relu(a @ b) + 1, rand(130, 20), rand(20, 24), matmul="generated")
    products = [(p, n) for name, p, n in spread if "mm" in name]
    assert products and all(p == n > 1 for p, n in products), spread


def test_large_row_kernels_and_pointwise_kernels():
    """Rows of 4096 in over a thousand programs (outputs large enough for the huge-page
    advice), against eager by the fp64 rule."""
    x, w = rand(1031, 4096), rand(4096)
    run_cpu(lambda t, w: (torch.softmax(t, -1), rmsnorm(t, w)), x, w)
    run_cpu(lambda t: F.gelu(t) * t, x)


def attention(q, k, v, causal=False):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        i = torch.arange(s.shape[-2])[:, None]
        j = torch.arange(s.shape[-1])[None, :]
        s = torch.where(j > i, float("-inf"), s)
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention(causal, dtype):
    q, k, v = (rand(1, 2, 100, 16, dtype=dtype) for _ in range(3))
    ex = run_cpu(lambda q, k, v: attention(q, k, v, causal), q, k, v)
    assert any(k.kind == "flash" for k in ex.kernels)


def test_decode_split_and_merge_with_scratch():
    q, k, v = rand(1, 2, 1, 32), rand(1, 2, 700, 32), rand(1, 2, 700, 32)
    ex = run_cpu(attention, q, k, v, flash_split=3)
    kinds = [k.kind for k in ex.kernels]
    assert "flash" in kinds and "flash-merge" in kinds


def test_training_step_forward_and_backward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.LayerNorm(40), torch.nn.Linear(40, 5))
    x = rand(9, 24)
    eager = torch.nn.Sequential(*[m for m in __import__("copy").deepcopy(model)])
    torch._dynamo.reset()
    with tilefuse.config.patch(target="cpu", fallback="error"):
        loss = torch.compile(model, backend="tilefuse")(x).square().mean()
        loss.backward()
    ref = eager(x).square().mean()
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ toolchain, cache, fallbacks
def test_source_is_cpp_and_explain_shows_it():
    ex = run_cpu(lambda t: torch.softmax(t, -1), rand(3, 50))
    src, name = ex.kernels[0].source, ex.kernels[0].name
    assert "softmax" in name and f'extern "C" void {name}(' in src and "#pragma omp simd" in src
    assert name in ex.format(verbose=True) and ex.source(name) in str(ex.format(verbose=True))


def test_warm_cache_builds_nothing():
    fn = lambda t: torch.tanh(t) * 3 + 1
    x = rand(11, 3)
    run_cpu(fn, x)
    cache = cpu.launcher.kernel_cache()
    cpu.launcher._libraries.clear()  # as in a new process: only the disk cache remains
    builds = cache.builds
    run_cpu(fn, x)
    assert cache.builds == builds


def test_kernels_of_a_graph_build_in_parallel_and_a_failed_build_fails_the_compile(monkeypatch):
    """Builds of one graph's kernels overlap (the pool runs `compile_threads` at once); the
    compiler waits for all of them, so a failed build raises at compile time, not at the first
    launch; a failure is not remembered (the next compile builds again); a source asked for
    twice is built once."""
    import threading
    import time

    cpu.launcher._libraries.clear()
    real_build, running, most = toolchain.build, [0], [0]
    lock = threading.Lock()

    def slow_build(source, cxx):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            time.sleep(0.2)  # long enough for the next kernel's build to start
            return real_build(source, cxx)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(toolchain, "build", slow_build)
    # distinct kernels (a graph output each) with constants no other test uses: cache misses
    fn = lambda t: (torch.tanh(t) * 3.123 + 1, torch.softmax(t * 1.77, -1), (t * 2.91).amax(0))
    run_cpu(fn, rand(13, 9), compile_threads=3)
    assert most[0] >= 2

    def broken(source, cxx):
        raise toolchain.CompileError("the compiler failed on purpose")

    cpu.launcher._libraries.clear()
    monkeypatch.setattr(toolchain, "build", broken)
    fresh = lambda t: torch.sinh(t) * 4.567 - 2.25
    torch._dynamo.reset()
    with tilefuse.config.patch(target="cpu", fallback="error"):
        with pytest.raises(Exception, match="on purpose"):
            torch.compile(fresh, backend="tilefuse")(rand(7, 5))
    monkeypatch.setattr(toolchain, "build", real_build)
    run_cpu(fresh, rand(7, 5))  # built now: the failure was not kept

    calls = []
    monkeypatch.setattr(toolchain, "build", lambda s, c: calls.append(s) or real_build(s, c))
    source = 'extern "C" int tilefuse_twice(void) { return 7; }\n'
    futures = [cpu.launcher.library_future(source) for _ in range(2)]
    assert futures[0] is futures[1] and futures[0].result().tilefuse_twice() == 7
    assert len(calls) <= 1  # 0 if an earlier run left it in the disk cache


def test_cache_key_covers_compiler_flags_and_cpu():
    cxx = cpu.require_compiler()
    key = toolchain.build_key("int x;", cxx)
    old = toolchain.FLAGS
    try:
        toolchain.FLAGS = old + ("-DX",)
        assert toolchain.build_key("int x;", cxx) != key
    finally:
        toolchain.FLAGS = old
    assert toolchain.build_key("int y;", cxx) != key


def test_no_compiler_falls_back_to_eager_with_a_clear_warning(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    fn = lambda t: t.exp() + 1
    x = rand(5)
    torch._dynamo.reset()
    with tilefuse.config.patch(target="cpu", fallback="eager"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(fn, backend="tilefuse")(x)
    torch.testing.assert_close(out, fn(x))
    assert any("C++ compiler" in str(w.message) for w in caught)


def test_unprintable_kernel_runs_in_the_interpreter(monkeypatch):
    def refuse(tk):
        raise cpu.CppUnsupported("testing")

    monkeypatch.setattr(cpu, "generate", refuse)  # (the C++ target takes it when a compile starts)
    x = rand(4, 6)
    torch._dynamo.reset()
    with tilefuse.config.patch(target="cpu", fallback="error"):
        ex = tilefuse.explain(lambda t: t.sin() * 2, x)
    assert any("Triton interpreter" in n for k in ex.kernels for n in k.notes)


def test_backend_knob_is_validated():
    with pytest.raises(ValueError):
        with tilefuse.config.patch(target="cuda"):
            pass
    with tilefuse.config.patch(target="cpu"):
        assert tilefuse.config.target == "cpu"


def _ulps(actual, ref64):
    """Error of fp32 results in units of the fp32 spacing at the correctly rounded value."""
    r32 = ref64.to(torch.float32)
    tiny = torch.finfo(torch.float32).tiny
    spacing = torch.where(r32.abs() < tiny, torch.full_like(ref64, 2.0 ** -149),
                          torch.nextafter(r32.abs(), torch.tensor(math.inf)).double() - r32.abs().double())
    return ((actual.double() - ref64).abs() / spacing).nan_to_num(0.0)


@pytest.mark.parametrize("op, ulps, ranges", [
    (torch.exp, 1.0, [(-104.5, 89.0), (-88.0, -87.0), (-1.0, 1.0)]),          # subnormal results, overflow edge
    (torch.exp2, 1.0, [(-151.0, 129.0), (-127.0, -125.0), (-0.6, 0.6)]),
    (torch.erf, 1.5, [(-5.0, 5.0), (-1.0, 1.0), (0.9, 0.96), (3.8, 4.1), (1e-6, 1e-3)]),
])
def test_vector_math_within_its_ulp_bound(op, ulps, ranges):
    """The header's branch-free fp32 exp, exp2 and erf against fp64, in ulps, over dense sweeps
    (subnormal results, the overflow and branch edges, tiny arguments) plus ±inf, NaN, ±0."""
    x = torch.cat([torch.linspace(lo, hi, 20011) for lo, hi in ranges] + [SPECIAL])
    with tilefuse.config.patch(target="cpu", fallback="error"):
        torch._dynamo.reset()
        got = torch.compile(lambda t: op(t), backend="tilefuse")(x)
    ref = op(x.double())
    finite = torch.isfinite(ref.to(torch.float32))
    assert torch.equal(got[~finite].nan_to_num(0.0), ref[~finite].to(torch.float32).nan_to_num(0.0))
    assert torch.equal(got.isnan(), ref.isnan())
    err = _ulps(got[finite], ref[finite])
    assert err.max().item() <= ulps, (err.max().item(), x[finite][err.argmax()].item())
    assert torch.equal(torch.signbit(got[x == 0]), torch.signbit(ref[x == 0].float())) or op is not torch.erf


def _arrays(src: str) -> list:
    import re

    return re.findall(r"alignas\(64\) (?:float|uint8_t) (\w+)\[", src.split(RANGE_FUNCTION)[-1])


@pytest.mark.parametrize("dynamic", [False, True])
def test_cheap_row_values_are_recomputed_not_stored(dynamic):
    """A loaded row (and `x - mean`) read again by a later walk is re-read and recomputed
    there, not copied to an array; the softmax's exponentials stay stored (too costly to
    recompute). Odd, non-contiguous and symbolic sizes against eager by the fp64 rule."""
    for x in (rand(7, 300), noncontig(5, 130), rand(3, 4096)):
        w, b = rand(x.shape[-1]), rand(x.shape[-1])
        ex = run_cpu(lambda t, w, b: (F.layer_norm(t, (t.shape[-1],), w, b), rmsnorm(t, w)), x, w, b, dynamic=dynamic)
        ex2 = run_cpu(lambda t: torch.softmax(t, -1), x, dynamic=dynamic)
        if dynamic or x.shape[-1] > 1024 or not x.is_contiguous():
            continue  # (a transposed input is walked as columns: its lanes are arrays)
        for k in ex.kernels:
            assert _arrays(k.source) == [], (k.name, _arrays(k.source))
        assert len(_arrays(ex2.kernels[0].source)) == 1


@pytest.mark.parametrize("channels,size", [(8, 5), (16, 7), (64, 3)])
def test_values_per_column_read_late_run_before_the_row_walk(channels, size):
    """An inference batch norm over channels-last images reads its bias after the row's first
    values: the bias is loaded in the per-column nest before the walk over rows, which keeps
    its values in registers (no array of a whole tile between two halves of the walk). With a
    residual and odd image sizes, against eager by the fp64 rule."""
    bn = torch.nn.BatchNorm2d(channels).eval()
    with torch.no_grad():
        bn.running_mean.normal_(), bn.running_var.uniform_(0.5, 2), bn.weight.normal_(), bn.bias.normal_()
    x = rand(2, channels, size, size).to(memory_format=torch.channels_last)
    r = rand(2, channels, size, size).to(memory_format=torch.channels_last)
    with torch.no_grad():
        ex = run_cpu(lambda x, r: torch.relu(bn(x) + r), x, r)
    (kernel,) = [k for k in ex.kernels if k.kind == "pointwise"]
    src = kernel.source.split('extern "C" void')[1]
    sizes = [int(n) for n in re.findall(r"alignas\(64\) float \w+\[(\d+)\]", src)]
    assert sizes and all(n <= channels for n in sizes), src


def test_values_of_a_buffer_the_kernel_writes_are_not_recomputed():
    """A kernel that also stores into the buffer its row came from: a later walk must see
    the values the first walk loaded, so the row stays an array (the same kernel without
    that store re-reads the row)."""
    import dataclasses

    from irgraphs import GraphBuilder
    from tilefuse.backends.cpu.codegen import generate
    from tilefuse.fusion import plan_graph
    from tilefuse.ir import dtypes as dt
    from tilefuse.ir.expr import cast, unary
    from tilefuse.tile.ir import LoadTile, StoreTile
    from tilefuse.tile.lower import LoweringOptions, lower_plan_kernels
    from tilefuse.tile.target import Target

    g = GraphBuilder("rms")
    x = g.input("x", (37, 300), dt.float32, strides="contiguous")
    ss = g.ctx.reduce((37,), (300,), "sum", lambda i, r: x.load((i[0], r[0])) * x.load((i[0], r[0])), dt.float32)
    out = g.ctx.pointwise((37, 300), dt.float32, lambda i: x.load(i) * unary("rsqrt", ss.load((i[0],)) / 300.0))
    graph = g.output(out)
    (plan,) = plan_graph(graph).kernels
    (tk,) = lower_plan_kernels(graph, plan, LoweringOptions(target=Target.cpu()))
    assert _arrays(generate(tk)) == []
    store = next(s for s in tk.body if isinstance(s, StoreTile))
    load = next(s for s in tk.body if isinstance(s, LoadTile) and s.buffer == "x")
    extra = StoreTile("x", load.offset, cast(load.offset, dt.float32) * 0.0, store.mask, dt.float32)
    assert load.name in _arrays(generate(dataclasses.replace(tk, body=tk.body + [extra])))


def test_float_sizes_are_floored_in_double():
    # interpolate's output size floor(1.5 * s0) is an integer computed in floats: an integer
    # division of a double would be a double (an array index that does not compile, or a mask
    # bound half a row too long)
    import sympy
    from tilefuse.backends.cpu.exprs import ExprPrinter
    from tilefuse.backends.triton.codegen import format_sympy

    s0 = sympy.Symbol("s0", integer=True, positive=True)
    p = ExprPrinter(lambda name: name)
    assert p.index(sympy.floor(1.5 * s0)) == "((int64_t)tfm_floor((double)((1.5 * s0))))"
    assert p.index(sympy.ceiling(0.7 * s0)) == "((int64_t)tfm_ceil((double)((0.7 * s0))))"
    assert format_sympy(sympy.floor(0.7 * s0)) == "tl.floor((tl.full([], 0.7, tl.float64) * s0)).to(tl.int64)"


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_a_forked_child_compiles_with_its_own_build_pool():
    """A child forked after the parent built kernels (a DataLoader worker, say) compiles new
    graphs: the parent's pool threads do not exist in the child."""
    import os

    run_cpu(lambda t: torch.cosh(t) * 1.375, rand(5, 6))  # the parent's pool is running
    pid = os.fork()
    if pid == 0:  # child: any failure or hang shows as a nonzero exit status
        code = 1
        try:
            import signal

            signal.alarm(120)
            torch.set_num_threads(1)  # no OpenMP team in a forked child (libgomp may hang)
            x = rand(4, 7)
            with tilefuse.config.patch(target="cpu", fallback="error"):
                torch._dynamo.reset()
                out = torch.compile(lambda t: torch.atan(t) * 2.625 + 0.5, backend="tilefuse")(x)
            code = 0 if torch.allclose(out, torch.atan(x) * 2.625 + 0.5, atol=1e-6) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("rows", [1, 3])
def test_products_of_few_rows_tile_only_those_rows(rows):
    """A batched product with one (or three) rows per batch — a MoE's gathered experts, a decode
    step — gets a row tile as small as the product (a vector-matrix loop), not 16 rows of
    which all but one are masked; against eager, gathered weights included."""
    x, experts = rand(9, rows, 40), torch.randint(0, 4, (9,))
    w = rand(4, 40, 72)
    ex = run_cpu(lambda a, w, e: torch.relu(a @ w[e]), x, w, experts, matmul="generated")
    product = next(k for k in ex.kernels if k.kind == "contraction")
    assert f"constexpr int64_t BLOCK_M = {1 if rows == 1 else 4};" in product.source, product.source[:600]
    assert "constexpr int64_t BLOCK_K = 64;" in product.source  # (K = 40: as long as K allows)


def test_products_of_few_rows_take_long_k_steps():
    """A vector-matrix product walks K in steps of 128 (a 32-column B tile that stays in L1),
    with K not a multiple of the step; the schedule space holds that rule."""
    x, experts, w = rand(7, 1, 200), torch.randint(0, 4, (7,)), rand(4, 90, 200)
    ex = run_cpu(lambda a, w, e: a @ w[e].transpose(-1, -2), x, w, experts, matmul="generated")
    src = next(k for k in ex.kernels if k.kind == "contraction").source
    assert "constexpr int64_t BLOCK_K = 128;" in src and "constexpr int64_t BLOCK_N = 32;" in src, src[:600]


@pytest.mark.parametrize("transposed", [True, False])
def test_gathered_operands_read_along_their_contiguous_dim(transposed):
    """A MoE's gathered weight read as `x @ w[e].T` (its rows contiguous along K, strided along
    N): the operand tile is copied with the rows loop innermost and vectorised (contiguous
    reads), not gathered one strided element at a time; read untransposed the usual order
    stays. Against eager, with ragged tiles."""
    import re

    x, experts = rand(9, 1, 40), torch.randint(0, 4, (9,))
    w = rand(4, 72, 40) if transposed else rand(4, 40, 72)
    fn = (lambda a, w, e: torch.relu(a @ w[e].transpose(-1, -2))) if transposed else (lambda a, w, e: torch.relu(a @ w[e]))
    ex = run_cpu(fn, x, w, experts, matmul="generated")
    src = next(k for k in ex.kernels if k.kind == "contraction").source.split('extern "C" void')[1]
    rows_inner = re.search(r"for \(int64_t tf_j = 0; tf_j < \d+; \+\+tf_j\) \{\s*#pragma omp simd[^\n]*\s*"
                           r"for \(int64_t tf_i = 0;", src)
    assert (rows_inner is not None) == transposed, src[:3000]


@pytest.mark.parametrize("rows,k", [(1, 40), (3, 64), (1, 5), (2, 24), (6, 40)])
def test_gathered_weights_of_few_rows_are_stored_by_columns(rows, k):
    """The transposed gathered tile of a product with few rows is stored by columns as the
    nest reads it, and the dot takes one dot product along K per element (`tf_dot_nt`); more
    rows keep the row-major tile and the register-blocked dot. Ragged and tiny K (tiles mostly
    masked), several rows per token; against eager."""
    x, experts = rand(9, rows, k), torch.randint(0, 4, (9,))
    w = rand(4, 72, k)
    ex = run_cpu(lambda a, w, e: torch.relu(a @ w[e].transpose(-1, -2)) * 1.5, x, w, experts, matmul="generated")
    src = next(kern for kern in ex.kernels if kern.kind == "contraction").source.split('extern "C" void')[1]
    assert ("tf_dot_nt<" in src) == (rows <= 4), src[:3000]
    if rows <= 4:
        assert re.search(r"ld\d+\[tf_j \* \d+ \+ tf_i\] = ", src), src[:3000]  # stored by columns


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 128), (3, 5, 64), (2, 256)])
def test_pointwise_with_a_per_column_operand_walks_whole_rows(shape, dtype):
    """An operand broadcast over the leading dims (a bias per column) makes the pointwise kernel
    walk [rows, row] tiles: the bias is read at the inner loop's index, not gathered. Row counts
    that do not fill the last program; a transposed input (walked in its storage order) keeps
    the flat walk; a row no power of two from 64 divides walks blocks of 64 columns where the
    last one masks at most an eighth of it (1000), else flat (96, 48), as rows shorter than
    `ROW_MIN` do."""
    x, bias = rand(*shape, dtype=dtype), rand(shape[-1], dtype=dtype)
    ex = run_cpu(lambda x, b: F.gelu(x + b) * 2, x, bias)
    (k,) = ex.kernels
    assert "constexpr int64_t CBLOCK = %d;" % shape[-1] in k.source, k.source
    assert f"% {shape[-1]})" not in k.source, k.source  # no modulo by the row length per lane
    # a transposed input: its result is stored in the input's order, walked flat
    run_cpu(lambda x, b: F.gelu(x + b) * 2, noncontig(*shape, dtype=dtype), bias)
    for other, tiled in (((37, 1000), True), ((37, 96), False), ((37, 48), False), ((37, 7), False)):
        ex = run_cpu(lambda x, b: F.gelu(x + b) * 2, rand(*other, dtype=dtype), rand(other[-1], dtype=dtype))
        assert ("CBLOCK" in ex.kernels[0].source) == tiled


@pytest.mark.parametrize("fn,operand", [
    (lambda x, b: (x - b) * 3, (1, 128)),  # a [1, row] bias
    (lambda x, s: torch.sigmoid(x * s), (37, 1)),  # a value per row
])
def test_other_broadcasts_walk_whole_rows(fn, operand):
    ex = run_cpu(fn, rand(37, 128), rand(*operand))
    assert "constexpr int64_t CBLOCK = 128;" in ex.kernels[0].source


def test_rows_of_a_symbolic_count():
    bias = rand(64)
    for n in (37, 5, 64):
        run_cpu(lambda x, b: torch.relu(x - b), rand(n, 64), bias, dynamic=True)


@pytest.mark.parametrize("keys,tile", [(20, 32), (100, 64)])
def test_flash_key_tiles_are_no_wider_than_the_keys(keys, tile):
    """The flash kernel's key tile on a CPU is no wider than a static key count needs (20 keys:
    32, not 64 of which 44 are masked); causal, against eager."""
    q, k, v = rand(2, 3, keys, 16), rand(2, 3, keys, 16), rand(2, 3, keys, 16)
    mask = torch.tril(torch.ones(keys, keys, dtype=torch.bool))

    def attention(q, k, v):
        s = (q @ k.transpose(-1, -2)) * 0.25
        return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v

    ex = run_cpu(attention, q, k, v)
    flash = next(kern for kern in ex.kernels if kern.kind == "flash")
    assert f"constexpr int64_t BLOCK_N = {tile};" in flash.source, flash.source[:800]


@pytest.mark.parametrize("n,k", [(96, 64), (64, 128), (96, 40)])
def test_gathered_weights_are_read_where_they_lie(n, k):
    """A MoE's gathered weight tile (`x @ w[e].T`, the expert's rows contiguous along K) whose
    base is the same in every lane — the expert index is loaded once per tile — is read in
    place by the by-columns dot (`tf_dot_nt` with the weight's row stride), with no copy; a
    ragged K (its tile's mask differs between lanes) keeps the copy. Negative experts count
    from the end as in eager; against eager."""
    x, experts = rand(9, 1, k), torch.randint(-4, 4, (9,))
    w = rand(4, n, k)
    ex = run_cpu(lambda a, w, e: torch.relu(a @ w[e].transpose(-1, -2)) * 1.5, x, w, experts, matmul="generated")
    src = next(kern for kern in ex.kernels if kern.kind == "contraction").source.split('extern "C" void')[1]
    in_place = re.search(r"tf_dot_nt<1, \d+, \d+, \d+, (true|false), %d>\([^;]*\? &ptr_" % k, src)
    assert (in_place is not None) == (k % 64 == 0), src[:4000]


def test_an_expert_out_of_range_raises_with_weights_read_in_place():
    """Where the gathered tile's index check fails, the dot reads zeros (never memory outside the
    weights) and the call raises IndexError as eager does."""
    x, w = rand(5, 1, 64), rand(4, 96, 64)
    fn = lambda a, w, e: a @ w[e].transpose(-1, -2)  # noqa: E731
    torch._dynamo.reset()
    with tilefuse.config.patch(target="cpu", fallback="error", matmul="generated"):
        ex = tilefuse.explain(fn, x, w, torch.tensor([0, 1, 2, 3, -1]))
        src = next(k for k in ex.kernels if k.kind == "contraction").source
        assert "static const float tf_zeros" in src and "? &ptr_" in src, src[-3000:]
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="tilefuse")
        compiled(x, w, torch.tensor([0, 1, 2, 3, -1]))
        with pytest.raises(IndexError):
            compiled(x, w, torch.tensor([0, 1, 7, 3, 2]))
    with pytest.raises(IndexError):
        fn(x, w, torch.tensor([0, 1, 7, 3, 2]))


def test_pointwise_rows_ignore_unit_dims():
    """An output with a trailing dim of extent 1 (`einsum` over a top-2 router's experts, kept
    as [tokens, features, 1]) still walks [rows, row] tiles: a value per token is read once
    per row, the features contiguously; against eager."""
    y, s = rand(13, 2, 64), rand(13, 2)
    ex = run_cpu(lambda y, s: torch.einsum("tkd,tk->td", y, s / s.sum(-1, keepdim=True)), y, s)
    (kernel,) = ex.kernels
    assert kernel.kind == "pointwise" and "constexpr int64_t CBLOCK = 64;" in kernel.source, kernel.source[-3000:]


@pytest.mark.parametrize("cols", [1000, 77, 10001])
def test_a_row_a_bound_mask_cuts_runs_unmasked_up_to_its_first_masked_lane(cols):
    """A row whose tile runs past its end (1000 in a tile of 1024; every tile of a looped row of
    10001) is printed twice per nest: unmasked up to the first lane the bound mask turns off
    (a multiple of the reduction's 16 lanes), masked from there. Rows of odd lengths, max, sum
    of exp and sums of a row's values, against fp64."""
    x = rand(37, cols) * 4
    ex = run_cpu(lambda x: x.logsumexp(-1) + x.mean(-1) * 0.1, x)
    src = "\n".join(k.source.split(RANGE_FUNCTION)[-1] for k in ex.kernels)
    assert "tf_jw = tf_clamp_lanes(" in src and "tf_jo < tf_jw" in src and "tf_jo = tf_jw" in src, src[-4000:]
    unmasked = src.split("tf_jo < tf_jw")[1].split("tf_jo = tf_jw")[0]
    assert "(true) ?" in unmasked and "_v) ? (float)(ptr_" not in unmasked, unmasked
