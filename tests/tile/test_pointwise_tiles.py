"""Pointwise kernels with an operand broadcast along the rows or the columns walk 2-D tiles
(`tile.pointwise._row_tiles`): a block of rows × a block of columns per program, a value per
row loaded (and index-checked) once per row, a bias per column read at the column index; a
row may span several innermost dims (a batch norm's H·W). Run through the Triton interpreter
(GPU tiles) and the C++ backend against eager with an fp64 reference."""
import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.tile import pointwise
from tilefuse.tile.pointwise import _column_block

pytest.importorskip("triton")


def _run(fn, *args, dynamic=False):
    torch._dynamo.reset()
    report = tilefuse.explain(fn, *args, options={"target": "interpret"})
    torch._dynamo.reset()
    out = torch.compile(fn, backend="tilefuse", dynamic=dynamic, options={"target": "interpret"})(*args)
    return report, out


def _pointwise_source(report) -> str:
    (kernel,) = [k for k in report.kernels if k.kind == "pointwise"]
    return kernel.source


def cross_entropy_grad(x, lse, target, g):
    """Cross-entropy's backward as the one-hot collapse leaves it: softmax minus the target's
    one-hot, times the upstream gradient, rounded to the logits' dtype."""
    classes = torch.arange(x.shape[-1], device=x.device)
    onehot = (classes[None] == target[:, None]).float()
    return ((torch.exp(x.float() - lse[:, None]) - onehot) * g).to(x.dtype)


@pytest.mark.parametrize("rows,classes", [(37, 1000), (5, 4099), (64, 256)])
def test_a_value_per_row_is_read_once_per_row(rows, classes):
    """Rows of any length from 256 (1000, a prime-ish 4099): the row's log-sum-exp and target
    are loaded as [rows, 1] tiles (no division of the flat index by the row length), the
    columns of the last block are masked."""
    x = torch.randn(rows, classes, dtype=torch.bfloat16)
    lse = torch.randn(rows) + 5
    target = torch.randint(0, classes, (rows,))
    report, out = _run(cross_entropy_grad, x, lse, target, torch.tensor(0.7))
    src = _pointwise_source(report)
    assert "CBLOCK" in src, src
    assert f"// {classes})" not in src and f"% {classes})" not in src, src  # no index division per lane
    ref = cross_entropy_grad(x.double(), lse.double(), target, torch.tensor(0.7, dtype=torch.float64))
    eager_err = (cross_entropy_grad(x, lse, target, torch.tensor(0.7)).double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * eager_err + 1e-6


def test_an_out_of_range_target_is_still_an_error():
    """A gathered index read once per row is still checked (the check runs per row)."""
    x = torch.randn(9, 300)
    idx = torch.randint(0, 300, (9,))

    def fn(x, idx):
        return x - x.gather(1, idx[:, None])

    report, out = _run(fn, x, idx)
    assert "CBLOCK" in _pointwise_source(report)
    torch.testing.assert_close(out, fn(x, idx))
    bad = idx.clone()
    bad[4] = 300
    torch._dynamo.reset()
    with pytest.raises((RuntimeError, IndexError)):
        torch.compile(fn, backend="tilefuse", options={"target": "interpret"})(x, bad)


@pytest.mark.parametrize("shape", [(3, 7, 384), (2, 1536)])
def test_a_bias_per_column_and_leading_dims(shape):
    """A bias per column over rank-3 rows (the leading dims unravelled per row only), and a
    row wider than one program's columns."""
    x, bias = torch.randn(*shape), torch.randn(shape[-1])
    report, out = _run(lambda x, b: F.gelu(x + b) * 2, x, bias)
    assert "CBLOCK" in _pointwise_source(report)
    ref = F.gelu(x.double() + bias.double()) * 2
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_short_rows_and_transposed_inputs_keep_the_flat_walk():
    """Rows shorter than 256 pack better flat; a result stored in another order (a transposed
    input's) is walked in that order."""
    x, b = torch.randn(40, 100), torch.randn(100)
    report, out = _run(lambda x, b: x * b, x, b)
    assert "CBLOCK" not in _pointwise_source(report)
    torch.testing.assert_close(out, x * b)
    xt, b = torch.randn(512, 33).t(), torch.randn(512)
    report, out = _run(lambda x, b: torch.relu(x - b), xt, b)
    assert "CBLOCK" not in _pointwise_source(report)
    torch.testing.assert_close(out, torch.relu(xt - b))


def test_rows_of_a_symbolic_count():
    """The row count is a size symbol: the row mask bounds the last block of rows."""
    bias = torch.randn(300)
    for n in (37, 5, 64):
        torch._dynamo.reset()
        x = torch.randn(n, 300)
        out = torch.compile(lambda x, b: torch.sigmoid(x) * b, backend="tilefuse", dynamic=True,
                            options={"target": "interpret"})(x, bias)
        torch.testing.assert_close(out, torch.sigmoid(x) * bias)


@pytest.mark.parametrize("row,block,expected", [(50304, 1024, 128), (1000, 1024, 1024), (768, 1024, 256),
                                                (4096, 1024, 1024), (300, 256, 64)])
def test_the_column_block_wastes_the_fewest_lanes(row, block, expected):
    """50304 = 393 · 128: no masked lane with 128 columns (1024 would mask 448 of each row)."""
    assert _column_block(row, block) == expected


def batch_norm_relu(x, mean, var, w, b):
    return torch.relu(F.batch_norm(x, mean, var, w, b, training=False))


@pytest.mark.parametrize("target", ["interpret", "cpu"])
@pytest.mark.parametrize("shape", [(2, 8, 32, 32), (3, 5, 16, 20), (2, 3, 7, 7)])
def test_a_value_per_channel_over_nchw_makes_rows_of_h_times_w(target, shape):
    """Inference batch norm over NCHW: the per-channel statistics are uniform over H and W, so
    a row is H·W long (the GPU tiles take any length from 256, the CPU's powers of two from
    `ROW_MIN` whole and planes of other sizes from `CPU_PLANE_MIN` in blocks of 64 columns:
    16×20, 7×7 in one masked block — walked flat, each lane divided its index twice) and the
    statistics are read once per row."""
    c = shape[1]
    x = torch.randn(shape)
    stats = (torch.randn(c), torch.rand(c) + 0.5, torch.randn(c), torch.randn(c))
    torch._dynamo.reset()
    report = tilefuse.explain(batch_norm_relu, x, *stats, options={"target": target})
    src = _pointwise_source(report)
    row = shape[2] * shape[3]
    tiled = row >= 256 if target == "interpret" else row >= pointwise.ROW_MIN
    assert ("CBLOCK" in src) == tiled, src
    torch._dynamo.reset()
    out = torch.compile(batch_norm_relu, backend="tilefuse", options={"target": target})(x, *stats)
    ref = batch_norm_relu(x.double(), *(t.double() for t in stats))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_an_operand_reading_part_of_the_trailing_dims_bounds_the_row():
    """`x * s[:, :, :, None]` (a value per (n, c, h)) makes rows of W only; `x * t[None, :, None, :]`
    reads W and C but not H: its row is W too — never H·W, which would split its reads."""
    x = torch.randn(2, 3, 5, 300)
    s, t = torch.randn(2, 3, 5), torch.randn(3, 300)
    for fn, arg in ((lambda x, s: x * s[..., None], s), (lambda x, t: x * t[None, :, None, :], t)):
        report, out = _run(fn, x, arg)
        src = _pointwise_source(report)
        assert "(cindex + (300 * yindex))" in src, src  # x read at row·W + column
        torch.testing.assert_close(out, fn(x, arg))


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_a_fill_of_another_shape_beside_a_row_tiled_stage(target):
    """An embedding's gradient starts from zeros of the table's shape, which the planner fuses
    beside cross-entropy's backward over the logits (same size, another shape): the logits'
    rows still decide the tiles (the per-row log-sum-exp read once per row) and the zeros are
    written at the tile's flat positions. Gradients against eager with an fp64 reference."""
    vocab, dim = 256, 32
    table = torch.randn(vocab, dim, requires_grad=True)
    head = torch.randn(vocab, dim, requires_grad=True)
    tokens, targets = torch.randint(0, vocab, (2, 16)), torch.randint(0, vocab, (2, 16))
    targets[0, 3] = -1  # an ignored position

    def step(table, head, tokens, targets):
        logits = torch.nn.functional.embedding(tokens, table) @ head.t()
        return torch.nn.functional.cross_entropy(logits.view(-1, vocab), targets.view(-1), ignore_index=-1)

    torch._dynamo.reset()
    report = tilefuse.explain(step, table, head, tokens, targets, options={"target": target})
    pointwise = [k.source for k in report.kernels if k.kind == "pointwise" and "nll_loss_backward" in k.name]
    assert pointwise and all("CBLOCK" in src for src in pointwise), pointwise
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="tilefuse", options={"target": target})
    grads = torch.autograd.grad(compiled(table, head, tokens, targets), (table, head))
    t64, h64 = table.detach().double().requires_grad_(), head.detach().double().requires_grad_()
    ref = torch.autograd.grad(step(t64, h64, tokens, targets), (t64, h64))
    eager = torch.autograd.grad(step(table, head, tokens, targets), (table, head))
    for g, r, e in zip(grads, ref, eager):
        assert (g.double() - r).abs().max().item() <= 2 * (e.double() - r).abs().max().item() + 1e-6


def _bias_gelu(x, b):
    return F.gelu(x + b)


def _log_softmax_backward_like(x, lse, target, g):
    """A cross-entropy backward as the decomposition spells it: values per row (the log-sum-exp,
    the target class), read across a vocabulary's row."""
    onehot = F.one_hot(target, x.shape[1]).to(x.dtype)
    return (torch.exp(x - lse[:, None]) - onehot) * g


@pytest.mark.parametrize("row,tiled", [(768, True), (4160, True), (2053, True), (1000, True), (196, False), (7, False)])
def test_cpu_rows_in_blocks_of_columns(row, tiled):
    """On the CPU a row that is not a power of two is walked in blocks of columns when a power
    of two from 64 divides it (768 = 3·256, 4160 = 65·64) or it is longer than a block (2053),
    else in blocks of 64 where the last one masks at most an eighth of the row (1000 = 8·125);
    196 (60 of 256 lanes masked) and a row shorter than `ROW_MIN` (7) stay flat. The per-row
    values are read once per row in the tiles, and every form matches."""
    x, lse = torch.randn(37, row), torch.randn(37)
    target, g = torch.randint(0, row, (37,)), torch.tensor(0.7)
    args = (x, lse, target, g)
    torch._dynamo.reset()
    report = tilefuse.explain(_log_softmax_backward_like, *args, options={"target": "cpu"})
    assert ("CBLOCK" in _pointwise_source(report)) == tiled
    torch._dynamo.reset()
    out = torch.compile(_log_softmax_backward_like, backend="tilefuse", options={"target": "cpu"})(*args)
    ref = _log_softmax_backward_like(x.double(), lse.double(), target, g.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("row", [100, 197, 7])
def test_a_flat_walk_divides_by_its_row_in_32_bits(row):
    """A row of one dim that blocks of 64 would mask much of, or shorter than `ROW_MIN`, is
    walked flat; a
    broadcast operand's index `(x + j) / row` is the block start's quotient plus the lane's part
    divided in 32 bits (vectorisable), and matches at odd sizes."""
    x, b = torch.randn(53, row), torch.randn(row)
    torch._dynamo.reset()
    report = tilefuse.explain(_bias_gelu, x, b, options={"target": "cpu"})
    src = _pointwise_source(report)
    assert f"(int32_t)((xindex % {row}) + " in src and f"(xindex + tf_j) / {row}" not in src, src
    torch._dynamo.reset()
    out = torch.compile(_bias_gelu, backend="tilefuse", options={"target": "cpu"})(x, b)
    torch.testing.assert_close(out.double(), _bias_gelu(x.double(), b.double()), atol=1e-5, rtol=1e-5)


def _padded_affine(x):
    return F.pad(x, (1, 2, 2, 1)) * 2 + 1


def _shifted_sum(x):
    return x[..., 1:, :-1] + x[..., :-1, 1:]


def _upsampled(x):
    return F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False) - 0.5


@pytest.mark.parametrize("fn,shape", [(_padded_affine, (3, 5, 29, 30)), (_shifted_sum, (2, 7, 33, 40)),
                                      (_upsampled, (2, 3, 13, 9))])
def test_cpu_reads_at_other_positions_walk_rows_of_the_innermost_dim(fn, shape):
    """On the CPU, a pointwise kernel reading an operand at other positions than its own (a
    padded read, shifted windows, an interpolation's gathers) walks rows of its innermost dim:
    the row's coordinates are computed once per row, the read is affine along it (no division
    of each lane's flat position into coordinates). Odd sizes, checked against fp64."""
    x = torch.randn(shape)
    torch._dynamo.reset()
    report = tilefuse.explain(fn, x, options={"target": "cpu"})
    assert all("CBLOCK" in k.source for k in report.kernels if k.kind == "pointwise"), str(report)
    torch._dynamo.reset()
    out = torch.compile(fn, backend="tilefuse", options={"target": "cpu"})(x)
    torch.testing.assert_close(out.double(), fn(x.double()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,cols,copied", [(48, 80, True), (64, 256, True), (37, 80, False), (48, 70, False)])
def test_cpu_transposed_reads_walk_tiles_copied_by_register_transposes(rows, cols, copied):
    """A read along another of the operand's dims than its innermost one (`a + b.t()`) walks
    16 × 64 tiles (16 × 16 for a row of 80) whose transposed operand is copied by register
    transposes before the loop (`tf_load_t`), not gathered lane by lane; where the tile
    would be masked (37 rows) the copy is not made, and a row no multiple of 16 stays flat.
    Every form matches."""
    a, b = torch.randn(rows, cols), torch.randn(cols, rows)
    fn = lambda a, b: (a + b.t()).relu() * 2  # noqa: E731
    torch._dynamo.reset()
    report = tilefuse.explain(fn, a, b, options={"target": "cpu"})
    src = _pointwise_source(report)
    assert ("tf_load_t<" in src.split('void __attribute__((noinline))')[-1]) == copied, src[-3000:]
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fn, backend="tilefuse", options={"target": "cpu"})(a, b), fn(a, b))


@pytest.mark.parametrize("shape,tiled", [((3, 5, 28, 28), True), ((2, 7, 7, 7), True), ((4, 6, 3, 3), False),
                                         ((3, 4, 5, 5), True)])
def test_cpu_planes_of_any_size_from_16_walk_tiles(shape, tiled):
    """A value per channel over NCHW planes that no power of two from 64 divides: from
    `CPU_PLANE_MIN` elements the plane walks blocks of 64 columns (flat, the channel was
    `floor(floor(x / W) / H) % C` per lane); a 3×3 plane stays flat. Against fp64."""
    x, b = torch.randn(shape), torch.randn(shape[1])
    fn = lambda x, b: F.silu(x + b[:, None, None])  # noqa: E731
    torch._dynamo.reset()
    report = tilefuse.explain(fn, x, b, options={"target": "cpu"})
    assert ("CBLOCK" in _pointwise_source(report)) == tiled
    torch._dynamo.reset()
    out = torch.compile(fn, backend="tilefuse", options={"target": "cpu"})(x, b)
    torch.testing.assert_close(out.double(), fn(x.double(), b.double()), atol=1e-5, rtol=1e-5)
