"""The scoped Triton interpreter (backends/triton/interpreter.py): a kernel calling Triton's
compiled-mode standard library (free and member style) and a jit helper runs interpreted
without TRITON_INTERPRET; Triton is left exactly as it was after the launch, also after
launches from several threads at once."""
import inspect
import threading

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

import tilefuse  # noqa: E402
from tilefuse.backends.triton import interpreter  # noqa: E402

N, M = 8, 16


@triton.jit
def _bigger(a, b):
    return tl.where(a > b, a, b)


@triton.jit
def _stdlib_kernel(x_ptr, out_ptr, N: tl.constexpr, M: tl.constexpr):
    rows = tl.arange(0, N)
    x = tl.load(x_ptr + rows[:, None] * M + tl.arange(0, M)[None, :])
    tl.store(out_ptr + rows, tl.sum(x, 1))
    tl.store(out_ptr + N + rows, x.max(1))  # member style: a bare JITFunction on tl.tensor
    tl.store(out_ptr + 2 * N + rows, tl.argmax(x, 1).to(tl.float32))
    tl.store(out_ptr + 3 * N + rows, tl.sum(tl.sigmoid(x), 1))
    tl.store(out_ptr + 4 * N + rows, tl.sum(tl.cumsum(x, 1), 1))
    tl.store(out_ptr + 5 * N + rows, tl.max(_bigger(x, 0.0), 1) + tl.cdiv(M, 3))


def _expected(x):
    return torch.stack([x.sum(1), x.amax(1), x.argmax(1).float(), torch.sigmoid(x).sum(1),
                        x.cumsum(1).sum(1), x.clamp(min=0).amax(1) + (M + 2) // 3])


def _launch(x):
    out = torch.empty(6, N)
    with interpreter.running():
        interpreter.launchable(_stdlib_kernel)[(1,)](x, out, N=N, M=M)
    return out


def _state():
    """Everything the scoped interpreter touches, by identity (attributes as looked up: the
    interpreter's own restore may turn an inherited attribute into an equal own one)."""
    from triton.runtime.jit import JITFunction

    spaces = {"tl": tl, "tl.core": tl.core, "tl.math": tl.math, "tl.tensor": tl.tensor,
              "tl.standard": tl.standard, "JITFunction": JITFunction}
    return {(name, key): id(inspect.getattr_static(space, key)) for name, space in spaces.items()
            for key in dir(space) if key != "__annotations__"}  # made on first access


def _assert_restored(before):
    if interpreter.stdlib_interpreted():
        return  # TRITON_INTERPRET=1: Triton's own device-function calls leave tl.core patched
    after = _state()
    assert {k: v for k, v in after.items() if k in before} == before  # nothing left patched
    # what may appear: a submodule imported, and the names the interpreter's source rewriter
    # adds to the globals of the standard library's functions (as under TRITON_INTERPRET=1)
    new = {k for k in set(after) - set(before) if k[0] != "tl.standard"}
    assert all(inspect.ismodule(getattr(tl, key)) for _, key in new), new


def test_stdlib_runs_interpreted_without_the_environment_variable():
    before = _state()
    x = torch.randn(N, M)
    torch.testing.assert_close(_launch(x), _expected(x))
    _assert_restored(before)


def test_launches_from_several_threads():
    before = _state()
    inputs = [torch.randn(N, M) for _ in range(4)]
    errors = []

    def work(x):
        try:
            for _ in range(3):
                torch.testing.assert_close(_launch(x), _expected(x))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(x,)) for x in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    _assert_restored(before)


def test_a_compiled_mode_kernel_is_untouched():
    from triton.runtime.jit import JITFunction

    _launch(torch.randn(N, M))
    if isinstance(_bigger, JITFunction):  # TRITON_INTERPRET unset: still compilable
        assert isinstance(_stdlib_kernel.cache_key, str)
        with pytest.raises(RuntimeError, match="outside of the scope of a kernel"):
            _bigger(1, 2)


def test_a_triton_without_the_internals_gets_a_clear_error(monkeypatch):
    import triton.runtime.interpreter as triton_interpreter

    monkeypatch.delattr(triton_interpreter, "_patch_lang")
    interpreter._triton.cache_clear()
    try:
        with pytest.raises(interpreter.InterpreterUnavailable, match="TRITON_INTERPRET=1"):
            interpreter.launchable(_stdlib_kernel)
    finally:
        monkeypatch.undo()
        interpreter._triton.cache_clear()
    _launch(torch.randn(N, M))  # and all is well again


def test_fp64_products_accumulate_and_return_in_fp64():
    """`tl.dot` returns fp32 unless told: on a GPU an fp64 accumulator without
    `out_dtype=tl.float64` is a compile error (the interpreter does not check it), so the
    source must say it, for a flash kernel and a product alike."""
    def attention(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.3, -1) @ v

    def product(a, b):
        return a @ b

    q, k, v = (torch.randn(1, 2, 40, 16, dtype=torch.float64) for _ in range(3))
    a, b = torch.randn(33, 20, dtype=torch.float64), torch.randn(20, 17, dtype=torch.float64)
    for fn, args in ((attention, (q, k, v)), (product, (a, b))):
        options = {"target": "interpret", "matmul": "generated"}
        torch._dynamo.reset()
        report = tilefuse.explain(fn, *args, options=options)
        dots = [line for kernel in report.kernels for line in (kernel.source or "").splitlines()
                if "tl.dot(" in line]
        assert dots and all("out_dtype=tl.float64" in line for line in dots), dots
        torch._dynamo.reset()
        out = torch.compile(fn, backend="tilefuse", options=options)(*args)
        torch.testing.assert_close(out, fn(*args), rtol=1e-12, atol=1e-12)
