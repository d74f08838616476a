"""Probe: which change to the C++ kernel of `x[i] * 2` (an index check in a `#pragma omp simd`
loop) stops a false index error that one compiler and CPU give; builds each variant with
tilefuse's own flags and calls it directly.

    PYTHONPATH=src python scripts/probe_cpu_index_variants.py OUT_DIR
"""
import ctypes
import glob
import os
import subprocess
import sys

import torch

import tilefuse
from tilefuse.backends.cpu import toolchain


def kernel_source(out):
    os.environ["TILEFUSE_DEBUG_DIR"] = os.path.join(out, "dbg")
    with tilefuse.config.patch(target="cpu", fallback="error", debug_dir=os.path.join(out, "dbg")):
        compiled = torch.compile(lambda x, i: x[i] * 2, backend="tilefuse", dynamic=False)
        try:
            compiled(torch.randn(7, 13), torch.tensor([0, 1, 2, 3, 4, 5]))
        except Exception as e:  # noqa: BLE001
            print("compiled call:", type(e).__name__, str(e)[:120])
    path = glob.glob(os.path.join(out, "dbg", "**", "*pw_mul_0.cpp"), recursive=True)[0]
    return open(path).read(), os.path.basename(path)[:-4]


def run(source, name, extra, out, tag):
    cxx = toolchain.find_compiler() if hasattr(toolchain, "find_compiler") else "c++"
    lib = os.path.join(out, f"{tag}.so")
    with open(lib, "wb") as f:
        f.write(toolchain.build(source, cxx, extra))
    fn = getattr(ctypes.CDLL(lib), name)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32]
    wrong = 0
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        x, i = torch.randn(7, 13, generator=gen), torch.randint(-7, 7, (6,), generator=gen)
        y = torch.empty(6, 13)
        err = (ctypes.c_int64 * 1)()
        ptrs = (ctypes.c_void_p * 4)(x.data_ptr(), i.data_ptr(), y.data_ptr(), ctypes.addressof(err))
        sizes = (ctypes.c_int64 * 8)()
        grid = (ctypes.c_int64 * 3)(1, 1, 1)
        fn(ptrs, sizes, grid, 1)
        wrong += bool(err[0]) or not torch.equal(y, x[i] * 2)
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", lib], capture_output=True, text=True).stdout
    with open(os.path.join(out, f"{tag}.s"), "w") as f:
        f.write(asm)
    print(f"{tag:14s} {wrong} of 20 wrong")


def changed(src, old, new):
    assert old in src, old
    return src.replace(old, new)


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    src, name = kernel_source(out)
    with open(os.path.join(out, "kernel.cpp"), "w") as f:
        f.write(src)
    run(src, name, (), out, "as_is")
    run(src, name, ("-O1",), out, "O1")
    run(src, name, ("-O2",), out, "O2")
    run(src, name, ("-fno-tree-vectorize", "-fno-openmp-simd"), out, "no_vectorize")
    run(changed(src, "#pragma omp simd reduction(|:tf_bad1)", ""), name, (), out, "no_simd_pragma")
    run(changed(src, "tf_bad1 |= !(chk5_v);", "if (!(chk5_v)) tf_bad1 = 1;"), name, (), out, "branchy_flag")
    run(changed(src, "tf_bad1 |= !(chk5_v);", "tf_bad1 |= (int32_t)(!(chk5_v));"), name, (), out, "int_flag")
    run(changed(src, "ptr_arg1_1[((xindex / 13) + (int64_t)((int32_t)((xindex % 13) + tf_j) / 13))]",
                    "ptr_arg1_1[((xindex + tf_j) / 13)]"), name, (), out, "plain_index")
    run(src, name, ("-mprefer-vector-width=256",), out, "width256")
    run(src, name, ("-mno-avx512f",), out, "no_avx512")


if __name__ == "__main__":
    main()
