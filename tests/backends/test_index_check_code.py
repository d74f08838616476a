"""How each backend prints an index check: C++ ORs failures into a simd-reduced flag per loop
nest (scalar checks test directly) and records the check's number; Triton prints
`tl.device_assert` and launches kernels with checks in debug mode with the overflow sanitiser
off; kernels without checks are unchanged."""
import pytest
import torch

import tilefuse
from tilefuse import compiler
from tilefuse.backends import cpu
from tilefuse.backends.triton import generate
from tilefuse.backends.triton.launcher import TritonKernel
from tilefuse.ir.bounds import IndexCheckError
from tilefuse.tile.ir import checks_of


def _tile_kernels(fn, *args, backend="cpu"):
    """The tile kernels compiling `fn` produces (and the compiled function's result)."""
    seen = []

    def record(tk):
        seen.append(tk)
        return real(tk)

    real = compiler.verify_tile_kernel
    compiler.verify_tile_kernel = record
    torch._dynamo.reset()
    try:
        with tilefuse.config.patch(target=backend, fallback="error"):
            out = torch.compile(fn, backend="tilefuse", dynamic=False)(*args)
    finally:
        compiler.verify_tile_kernel = real
    return seen, out


def _embedding(w, i):
    return torch.nn.functional.embedding(i, w) * 3


@pytest.mark.skipif(cpu.find_compiler() is None, reason="no C++ compiler")
def test_cpp_check_is_a_simd_reduction_reported_after_the_nest():
    w, i = torch.randn(11, 37), torch.randint(0, 11, (5, 3))
    (tk,), out = _tile_kernels(_embedding, w, i)
    torch.testing.assert_close(out, _embedding(w, i))
    src = cpu.generate(tk)
    assert "reduction(|:tf_bad1)" in src and "if (tf_bad1) tf_fail(tf_err, 1);" in src
    assert "int64_t* tf_err = (int64_t*)tf_ptrs[3];" in src  # after the three buffers
    (plain,), _ = _tile_kernels(lambda x: x * 2, w)
    assert not checks_of(plain.body) and "tf_err" not in cpu.generate(plain)


@pytest.mark.skipif(cpu.find_compiler() is None, reason="no C++ compiler")
@pytest.mark.parametrize("fn,args,bad,printed", [
    # a gather feeding a row reduction (the lanes loop of a reduction nest)
    (lambda x, i: x.index_select(0, i).sum(-1), (torch.randn(9, 70), torch.randint(0, 9, (6,))), (1, 9),
     "reduction(|:tf_bad"),
    # one index for the whole output: a scalar check outside any loop nest
    (lambda x, i: x.index_select(0, i) * 2, (torch.randn(5, 16), torch.tensor([3])), (0, -1),
     "if (!(inb"),
])
def test_cpp_checks_in_reduction_and_scalar_positions(fn, args, bad, printed):
    kernels, out = _tile_kernels(fn, *args)
    torch.testing.assert_close(out, fn(*args))
    assert any(printed in cpu.generate(tk) for tk in kernels if checks_of(tk.body))
    pos, value = bad
    idx = args[1].clone()
    idx[pos] = value
    with pytest.raises(IndexCheckError):
        _tile_kernels(fn, args[0], idx)


def test_triton_prints_device_asserts_and_launches_them_in_debug_mode():
    w, i = torch.randn(11, 37), torch.randint(0, 11, (5, 3))
    (tk,), _ = _tile_kernels(_embedding, w, i, backend="interpret")
    src = generate(tk, interpret=False)
    assert "tl.device_assert(" in src and "embedding: index out of range" in src
    assert TritonKernel(tk, src, interpret=False).debug == {"debug": True, "sanitize_overflow": False}
    (plain,), _ = _tile_kernels(lambda x: x * 2, w, backend="interpret")
    plain_src = generate(plain, interpret=False)
    assert "device_assert" not in plain_src
    assert TritonKernel(plain, plain_src, interpret=False).debug == {}
