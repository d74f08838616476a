"""In-place indexed writes into inputs (`index_put_` after re-inplacing) are generated
kernels: the KV-cache update with RoPE fused into the write, negative and broadcast indices,
a cache read after the write, symbolic sizes — on the C++ backend and the Triton interpreter,
against eager (fp64 rule for the values; rows not written stay bit-identical). Writes that
need atomics or whose input's old value is read elsewhere stay ATen calls."""
import pytest
import torch

import tilefuse
from tilefuse.config import config
from backends_on_cpu import CPU_BACKENDS

BACKENDS = CPU_BACKENDS


def rotate(x, cos, sin):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rope_kv(q, k, v, cos_t, sin_t, pos, k_cache, v_cache):
    cos, sin = cos_t[pos], sin_t[pos]
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    k_cache.index_copy_(2, pos, k)
    v_cache.index_copy_(2, pos, v)
    return q


def decode_step(q, k, v, pos, k_cache, v_cache):
    """Write the new key/value, then attend over the whole updated cache."""
    k_cache[:, :, pos] = k
    v_cache[:, :, pos] = v
    s = q @ k_cache.transpose(-1, -2) / q.shape[-1] ** 0.5
    return torch.softmax(s, -1) @ v_cache


def _rope_inputs(dtype, b=2, h=3, s=5, d=8, cache=37, start=11):
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    ang = torch.rand(cache, d, generator=g) * 6.28
    pos = torch.arange(start, start + s)
    return [r(b, h, s, d), r(b, h, s, d), r(b, h, s, d), ang.cos().to(dtype), ang.sin().to(dtype), pos,
            r(b, h, cache, d), r(b, h, cache, d)]


def _run(fn, args, backend, dynamic=None):
    compiled_args = [a.clone() for a in args]
    eager_args = [a.clone() for a in args]
    ref_args = [a.double() if a.is_floating_point() else a.clone() for a in args]
    with config.patch(target=backend):
        torch._dynamo.reset()
        out = torch.compile(fn, backend="tilefuse", dynamic=dynamic)(*compiled_args)
    return out, fn(*eager_args), fn(*ref_args), compiled_args, eager_args, ref_args


def _close(c, e, r, dtype):
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    err, eager_err = ((x.double() - r).abs().max().item() for x in (c, e))
    assert c.dtype == e.dtype and c.shape == e.shape
    assert err <= 2 * eager_err + tol * (1 + r.abs().max().item()), (err, eager_err)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kv_cache_update_with_rope_is_generated_and_in_place(backend, dtype):
    args = _rope_inputs(dtype)
    with config.patch(target=backend):
        torch._dynamo.reset()
        report = tilefuse.explain(rope_kv, *[a.clone() for a in args])
    assert not report.externs, str(report)
    assert sum("in-place indexed write" in d for r in report.reports for d in r.decisions) == 2
    out, eager, ref, c_args, e_args, r_args = _run(rope_kv, args, backend)
    _close(out, eager, ref, dtype)
    for k in (6, 7):
        _close(c_args[k], e_args[k], r_args[k], dtype)
        untouched = torch.ones(args[k].shape[2], dtype=torch.bool)
        untouched[args[5]] = False
        assert torch.equal(c_args[k][:, :, untouched], args[k][:, :, untouched])  # rows not written


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_write_goes_into_the_callers_tensor(backend):
    args = _rope_inputs(torch.float32, s=3)
    cache = args[6]
    ptr = cache.data_ptr()
    expected = cache.clone()
    rope_kv(*[a.clone() if a is not cache else expected for a in args])
    with config.patch(target=backend):
        torch._dynamo.reset()
        torch.compile(rope_kv, backend="tilefuse")(*args)
    assert cache.data_ptr() == ptr
    torch.testing.assert_close(cache, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_positions_and_a_cache_read_after_the_write(backend):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 1, 16, generator=g)
    k, v = (torch.randn(2, 2, 2, 16, generator=g) for _ in range(2))
    pos = torch.tensor([-1, 4])  # the last row and row 4
    caches = [torch.randn(2, 2, 13, 16, generator=g) for _ in range(2)]
    args = [q, k, v, pos, *caches]
    with config.patch(target=backend):
        torch._dynamo.reset()
        report = tilefuse.explain(decode_step, *[a.clone() for a in args])
    assert not report.externs, str(report)
    out, eager, ref, c_args, e_args, r_args = _run(decode_step, args, backend)
    _close(out, eager, ref, torch.float32)
    for k_ in (4, 5):
        torch.testing.assert_close(c_args[k_], e_args[k_])


def test_values_broadcast_into_the_written_rows():
    def fill(x, idx, row):
        x[idx] = row  # one row broadcast to every indexed position
        return x.sum()

    g = torch.Generator().manual_seed(4)
    x, row = torch.randn(9, 6, generator=g), torch.randn(6, generator=g)
    idx = torch.tensor([[0, 7], [3, -2]])
    out, eager, ref, c_args, e_args, _ = _run(fill, [x, idx, row], "cpu")
    torch.testing.assert_close(c_args[0], e_args[0])
    torch.testing.assert_close(out, eager)


def test_symbolic_sizes_serve_several_lengths():
    with config.patch(target="cpu"):
        torch._dynamo.reset()
        fn = torch.compile(rope_kv, backend="tilefuse", dynamic=True)
        for s, start in ((3, 2), (6, 20)):
            args = _rope_inputs(torch.float32, s=s, start=start)
            expected = [a.clone() for a in args]
            out = fn(*args)
            torch.testing.assert_close(out, rope_kv(*expected), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(args[6], expected[6])
            torch.testing.assert_close(args[7], expected[7])


def test_accumulating_writes_stay_aten_calls():
    def add_rows(x, idx, v):
        x.index_put_((idx,), v, accumulate=True)
        return x * 2

    g = torch.Generator().manual_seed(5)
    x, v = torch.randn(8, 3, generator=g), torch.randn(4, 3, generator=g)
    idx = torch.tensor([1, 1, 5, 0])  # repeated: the adds must all land
    with config.patch(target="cpu"):
        torch._dynamo.reset()
        report = tilefuse.explain(add_rows, x.clone(), idx, v)
    assert any("index_put" in t for _, t, _ in report.externs), str(report)
    out, eager, _, c_args, e_args, _ = _run(add_rows, [x, idx, v], "cpu")
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(c_args[0], e_args[0])


def test_verify_mode_checks_an_in_place_write_once():
    args = _rope_inputs(torch.float32, s=4)
    expected = [a.clone() for a in args]
    out_expected = rope_kv(*expected)
    with config.patch(target="cpu", verify=True, fallback="error"):
        torch._dynamo.reset()
        out = torch.compile(rope_kv, backend="tilefuse")(*args)
    torch.testing.assert_close(out, out_expected)
    torch.testing.assert_close(args[6], expected[6])
    torch.testing.assert_close(args[7], expected[7])


def test_the_reference_interpreter_writes_like_eager():
    """`run_scatter` (the oracle of the kernels above) against index_put_ itself."""
    from irgraphs import GraphBuilder
    from tilefuse.ir import Scatter, dtypes as dt
    from tilefuse.ir.expr import Index, cast
    from tilefuse.ir.interpret import interpret

    g = GraphBuilder("g")
    x = g.input("x", (6, 4))
    idx = g.input("idx", (3,), dt.int64)
    v = g.input("v", (3, 4))
    i0, i1 = (Index(s) for s in __import__("tilefuse").ir.out_index(2))
    node = Scatter("w", dt.float32, x.shape, target="x", space=(3, 4),
                   index=(cast(idx.load((i0,)), dt.int64), i1), body=v.load((i0, i1)))
    g.graph.add(node)
    g.graph.outputs = ["w"]
    xs, vs = torch.randn(6, 4), torch.randn(3, 4)
    ids = torch.tensor([4, 0, 9])  # 9 is outside: not written
    expected = xs.clone()
    expected[ids[:2]] = vs[:2]
    (out,) = interpret(g.graph, [xs, ids, vs])
    assert out is xs  # in place
    torch.testing.assert_close(xs, expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [13, -14])
def test_a_position_outside_the_input_raises_as_eager(backend, bad):
    def write(cache, pos, v):
        cache[:, pos] = v
        return cache.sum()

    g = torch.Generator().manual_seed(6)
    cache, v = torch.randn(3, 13, generator=g), torch.randn(3, 2, generator=g)
    pos = torch.tensor([2, bad])
    with pytest.raises(IndexError):
        write(cache.clone(), pos, v)
    with config.patch(target=backend):
        torch._dynamo.reset()
        with pytest.raises(IndexError, match="out of"):
            torch.compile(write, backend="tilefuse")(cache.clone(), pos, v)


def test_positions_read_by_several_ops_are_checked_once():
    """The RoPE tables' gathers and both cache writes read the same positions against the same
    bound (tables and caches of one length): one check in the one kernel."""
    args = _rope_inputs(torch.float32, cache=37)
    args[3], args[4] = args[3][:37], args[4][:37]
    with config.patch(target="cpu"):
        torch._dynamo.reset()
        report = tilefuse.explain(rope_kv, *[a.clone() for a in args])
    (kernel,) = report.kernels
    assert kernel.tile_ir.count("check ") == 1, kernel.tile_ir
