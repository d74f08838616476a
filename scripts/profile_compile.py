"""Where a cold compile's time goes: compile benchmark workloads with tilefuse under cProfile,
with fresh tilefuse and Triton caches, and print the `compile_time` report of each graph and the
functions that took the time.

    PYTHONPATH=src python scripts/profile_compile.py --workloads nanogpt --layers 2 --out OUT_DIR

Writes `compile_<workload>.txt` (the reports and the cProfile tables) and
`compile_<workload>.pstats` (for `python -m pstats` or snakeviz) under OUT_DIR.

cProfile times the main thread by the wall clock: while the threads that serve the compile
workers hold the GIL, the main thread's time is charged to whatever it was running, so a
function can look slow that is not (`precompile_kernel` at 22 ms a kernel in one T5
profile, where making a kernel's meta buffers in a fake-tensor mode takes under a millisecond). The `compile_time` report's stages and phases are timed without the profiler's
call accounting; trust them first, and `TILEFUSE_LOGS=tune,cache` for per-compile times.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import logging
import os
import pstats
import sys
import tempfile
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="nanogpt")
    ap.add_argument("--size", default="full")
    ap.add_argument("--layers", type=int, default=None, help="models: override the layer count")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--warm", action="store_true", help="keep the caches (a warm compile)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    if not args.warm:  # fresh caches before anything imports Triton or tilefuse
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-")
        os.environ["TILEFUSE_CACHE_DIR"] = tempfile.mkdtemp(prefix="tilefuse-")
    sys.path.append(os.path.join(os.path.dirname(__file__), "..", "src"))  # (after PYTHONPATH: an A/B tree there wins)
    import torch

    import tilefuse
    from tilefuse.bench.workloads import WORKLOADS

    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    for name in args.workloads.split(","):
        w = WORKLOADS[name]
        size = w.size(args.size, args.layers)
        torch.manual_seed(0)
        inputs = w.make_inputs(tuple(size), device, dtype)
        torch._dynamo.reset()
        reports = io.StringIO()
        handler = logging.StreamHandler(reports)
        logger = logging.getLogger("tilefuse.compiler")
        logger.addHandler(handler)
        tilefuse.config.logs = "compile_time"
        fn = w.program(tilefuse.compile(w.fn, fallback="error"))
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.runcall(fn, *inputs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        logger.removeHandler(handler)
        tilefuse.config.logs = ""
        prof.dump_stats(os.path.join(args.out, f"compile_{name}.pstats"))
        text = io.StringIO()
        text.write(f"== {name} size {tuple(size)} {args.dtype} on {device}: first call {wall:.1f} s\n\n")
        text.write(reports.getvalue() + "\n")
        for order in ("cumulative", "tottime"):
            stats = pstats.Stats(prof, stream=text)
            stats.sort_stats(order).print_stats(args.top)
        with open(os.path.join(args.out, f"compile_{name}.txt"), "w") as f:
            f.write(text.getvalue())
        print(text.getvalue()[:6000])
    if device.type == "cuda":  # the compile workers hold no GPU memory: only this process is listed
        from tilefuse.backends.triton import compile_pool

        print("compile workers:", compile_pool.stats())
        os.system("nvidia-smi --query-compute-apps=pid,used_memory --format=csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
