"""What one kernel launch costs the host, by way of launching (GPU): a small Triton kernel
launched through `JITFunction[grid]`, through the compiled kernel's `[grid]` runner, through
its launcher (`CompiledKernel.run`) with tensors or with their addresses, and for comparison
`torch.empty` / `torch.empty_strided` and an ATen add. Host time per call, best of 5 rounds
of `--iters` calls (`time.perf_counter`, no synchronisation inside a round).

    PYTHONPATH=src python scripts/probe_launch_path.py [--iters 2000]
"""
from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _axpy(x_ptr, y_ptr, out_ptr, n, a, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, a * tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)


def _time(fn, iters: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters)
        torch.cuda.synchronize()
    return best * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args(argv)
    from triton.runtime import driver

    n = 4096
    x, y, out = (torch.randn(n, device="cuda") for _ in range(3))
    grid = (triton.cdiv(n, 1024),)
    compiled = _axpy[grid](x, y, out, n, 2.0, BLOCK=1024)
    runner = compiled[grid + (1, 1)]
    dev = driver.active.get_current_device()
    get_stream = driver.active.get_current_stream
    ptrs = (x.data_ptr(), y.data_ptr(), out.data_ptr())

    def run_tensors():
        compiled.run(grid[0], 1, 1, get_stream(dev), compiled.function, compiled.packed_metadata, None, None, None,
                     x, y, out, n, 2.0, 1024)

    def run_ints():
        compiled.run(grid[0], 1, 1, get_stream(dev), compiled.function, compiled.packed_metadata, None, None, None,
                     *ptrs, n, 2.0, 1024)

    rows = {
        "JITFunction[grid](...)": lambda: _axpy[grid](x, y, out, n, 2.0, BLOCK=1024),
        # (the compiled kernel's launcher takes the constexprs too, after the other arguments)
        "CompiledKernel[grid](...)": lambda: compiled[grid + (1, 1)](x, y, out, n, 2.0, 1024),
        "kept runner(...)": lambda: runner(x, y, out, n, 2.0, 1024),
        "CompiledKernel.run, tensors": run_tensors,
        "CompiledKernel.run, addresses": run_ints,
        "get_current_stream": lambda: get_stream(dev),
        "torch.empty(4096)": lambda: torch.empty(n, device="cuda"),
        "torch.empty_strided": lambda: torch.empty_strided((n,), (1,), device="cuda"),
        "torch.add (ATen)": lambda: torch.add(x, y),
        "x.data_ptr() x3": lambda: (x.data_ptr(), y.data_ptr(), out.data_ptr()),
    }
    try:
        from torch._inductor.runtime.static_cuda_launcher import StaticallyLaunchedCudaKernel

        static = StaticallyLaunchedCudaKernel(compiled)
        static.load_kernel(x.device.index or 0)
        stream = get_stream(dev)
        rows["Inductor's static launcher (reference)"] = lambda: static.run(grid[0], 1, 1, stream, *ptrs, n, 2.0)
    except Exception as err:  # noqa: BLE001 - a reference only
        print(f"(Inductor's static launcher not measured: {type(err).__name__}: {err})")
    for name, fn in rows.items():
        try:
            print(f"{name:42s} {_time(fn, args.iters):7.2f} µs")
        except Exception as err:  # noqa: BLE001 - one way that does not work here is a row
            print(f"{name:42s} failed: {type(err).__name__}: {err}")
    torch.testing.assert_close(out, 2.0 * x + y)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
