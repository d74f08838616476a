"""Probe: `x[i] * 2` on the C++ backend with random in-range (negative included) indices,
as tests/e2e/test_index_checks.py draws them; on a false index error prints the indices, the
compiler, the CPU flags, and rebuilds the kernel at -O1 to tell a miscompile from a codegen bug.

    PYTHONPATH=src python scripts/probe_cpu_index_check.py OUT_DIR
"""
import os
import subprocess
import sys

import torch

import tilefuse


def advanced(x, i):
    return x[i] * 2


def trial(compiled, gen, n, m, tries=30):
    bad = []
    for _ in range(tries):
        x, i = torch.randn(n, m, generator=gen), torch.randint(-n, n, (6,), generator=gen)
        try:
            torch.testing.assert_close(compiled(x, i), advanced(x, i))
        except Exception as e:  # noqa: BLE001
            bad.append((i.tolist(), f"{type(e).__name__}: {str(e)[:160]}"))
    return bad


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    print(subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.splitlines()[0])
    flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
    print("avx512f" in flags, "avx2" in flags, next((ln.strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), ""))
    print("threads", torch.get_num_threads())
    gen = torch.Generator().manual_seed(0)
    with tilefuse.config.patch(target="cpu", fallback="error"):
        compiled = torch.compile(advanced, backend="tilefuse", dynamic=False)
        bad = trial(compiled, gen, 7, 13)
        print("native:", len(bad), "of 30 wrong;", bad[:4])
        for threads in (1, 2):
            torch.set_num_threads(threads)
            print(f"threads={threads}:", len(trial(compiled, gen, 7, 13)))
        torch.set_num_threads(os.cpu_count())
    from tilefuse.backends.cpu import toolchain
    for flags in (("-march=x86-64-v3",), ("-march=native", "-mprefer-vector-width=256")):
        toolchain.X86_64 = flags
        torch._dynamo.reset()
        with tilefuse.config.patch(target="cpu", fallback="error", cache_dir=os.path.join(out, "c" + flags[-1][-3:])):
            compiled = torch.compile(advanced, backend="tilefuse", dynamic=False)
            print(flags, len(trial(compiled, gen, 7, 13)))


if __name__ == "__main__":
    main()
