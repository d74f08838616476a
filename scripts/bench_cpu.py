"""CPU benchmark of the C++ backend against eager and Inductor's C++ backend, in one run.

    python scripts/bench_cpu.py [--quick] [--thp-alloc] [--rounds 3] [--threads N] [--out docs/bench_cpu.json]

Workloads (fp32, plain PyTorch): RMSNorm, LayerNorm, softmax and gelu(x)*x on 4096x4096,
naive attention (1, 8, 1024, 64), and a small MLP (512 tokens, 1024 -> 4096 -> 1024 with
GELU). Each compiler gets fresh inputs and its own cold kernel cache; the table gives the
median time of each, the speed-up over eager, tilefuse's first-compile time per generated
kernel (C++ build included) and whether a warm cache built anything.

`--thp-alloc` sets `THP_MEM_ALLOC_ENABLE=1` before PyTorch loads (its allocator then asks
for transparent huge pages on every large tensor, as tilefuse's launcher does on the
buffers its kernels write): the equal-footing comparison. The variable's value, the THP mode
and the load average before and after each workload are recorded. Timing runs in `--rounds`
rounds that alternate eager, Inductor and tilefuse (a burst of load from another process
hits all three alike); the speed-ups are the median of the per-round ratios.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time

if "--thp-alloc" in sys.argv[1:] and os.environ.get("THP_MEM_ALLOC_ENABLE") != "1":
    # read by PyTorch's allocator once, at its first allocation: set it before torch loads
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch
import torch.nn.functional as F


def rmsnorm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def layernorm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-6)


def softmax(x):
    return torch.softmax(x, -1)


def gelu_mul(x):
    return F.gelu(x) * x


def attention(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(s, dim=-1) @ v


def mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def workloads(quick: bool):
    n = 1024 if quick else 4096
    seq = 256 if quick else 1024
    r = torch.randn
    return {
        "rmsnorm": (rmsnorm, lambda: (r(n, n), r(n))),
        "layernorm": (layernorm, lambda: (r(n, n), r(n), r(n))),
        "softmax": (softmax, lambda: (r(n, n) * 2,)),
        "gelu_mul": (gelu_mul, lambda: (r(n, n),)),
        "attention": (attention, lambda: tuple(r(1, 8, seq, 64) for _ in range(3))),
        "mlp": (mlp, lambda: (r(512, 1024), r(4096, 1024) / 32, r(4096) / 10, r(1024, 4096) / 64, r(1024) / 10)),
    }


def timeit(fn, args, budget=1.0, min_runs=5, warmup=2):
    for _ in range(warmup):
        fn(*args)
    times = []
    t_end = time.perf_counter() + budget
    while len(times) < min_runs or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return statistics.median(times)


def load_average() -> list:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "n/a"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    ap.add_argument("--only", default="", help="comma list of workloads")
    ap.add_argument("--out", default="", help="write the results as JSON")
    ap.add_argument("--thp-alloc", action="store_true",
                    help="THP_MEM_ALLOC_ENABLE=1 for PyTorch's allocator too (the equal-footing comparison)")
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds alternating the three compilers")
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timing per compiler and round")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads for every compiler (0: PyTorch's default); one thread is the "
                         "comparison least disturbed by other processes on a shared machine")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TILEFUSE_CACHE_DIR", tempfile.mkdtemp(prefix="tilefuse-bench-cpu-"))
    import tilefuse
    from tilefuse.backends.cpu import launcher

    torch.manual_seed(0)
    rows = []
    chosen = [w for w in args.only.split(",") if w] or list(workloads(args.quick))
    for name, (fn, make) in workloads(args.quick).items():
        if name not in chosen:
            continue
        inputs = make()
        ref = fn(*[t.double() for t in inputs])
        row = {"workload": name, "load_before": load_average()}
        # Inductor (torch.compile's default backend: C++/OpenMP on CPU)
        torch._dynamo.reset()
        t0 = time.perf_counter()
        ind = torch.compile(fn)
        out = ind(*inputs)
        row["inductor_compile_s"] = time.perf_counter() - t0
        row["inductor_err"] = (out.double() - ref).abs().max().item()
        # tilefuse (cpu backend), cold cache
        torch._dynamo.reset()
        cache = launcher.kernel_cache()
        builds = cache.builds
        ex = tilefuse.explain(fn, *inputs)
        kernels = [k for k in ex.kernels if k.kind not in ("aten-matmul", "empty")]
        load = sum(r.stage_seconds.get("load", 0.0) for r in ex.reports)
        row["tilefuse_kernels"] = len(kernels)
        row["tilefuse_kinds"] = [k.kind for k in ex.kernels]
        row["tilefuse_builds"] = cache.builds - builds
        row["tilefuse_compile_per_kernel_s"] = load / max(1, len(kernels))
        torch._dynamo.reset()
        tf = torch.compile(fn, backend="tilefuse")
        launcher._libraries.clear()
        builds = cache.builds
        out = tf(*inputs)
        row["tilefuse_warm_builds"] = cache.builds - builds
        row["tilefuse_err"] = (out.double() - ref).abs().max().item()
        row["eager_err"] = (fn(*inputs).double() - ref).abs().max().item()
        rounds = {"eager": [], "inductor": [], "tilefuse": []}
        for _ in range(max(1, args.rounds)):
            for key, f in (("eager", fn), ("inductor", ind), ("tilefuse", tf)):
                rounds[key].append(timeit(f, inputs, budget=args.budget) * 1e3)
        for key, ts in rounds.items():
            row[f"{key}_ms"] = statistics.median(ts)
            row[f"{key}_rounds_ms"] = ts
        row["vs_eager"] = statistics.median(e / t for e, t in zip(rounds["eager"], rounds["tilefuse"]))
        row["vs_inductor"] = statistics.median(i / t for i, t in zip(rounds["inductor"], rounds["tilefuse"]))
        row["load_after"] = load_average()
        rows.append(row)
        print(f"{name:10s} eager {row['eager_ms']:8.2f} ms  inductor {row['inductor_ms']:8.2f} ms  "
              f"tilefuse {row['tilefuse_ms']:8.2f} ms  x{row['vs_eager']:.2f} eager  x{row['vs_inductor']:.2f} inductor  "
              f"compile/kernel {row['tilefuse_compile_per_kernel_s']:.2f} s ({row['tilefuse_kernels']} kernels: "
              f"{','.join(row['tilefuse_kinds'])}), warm builds {row['tilefuse_warm_builds']}, "
              f"load {row['load_before'][:1]} -> {row['load_after'][:1]}", flush=True)
    if rows:
        ge = math.exp(statistics.fmean(math.log(r["vs_eager"]) for r in rows))
        gi = math.exp(statistics.fmean(math.log(r["vs_inductor"]) for r in rows))
        print(f"geometric mean: x{ge:.2f} eager, x{gi:.2f} inductor")
    if args.out:
        meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                "threads": torch.get_num_threads(), "command": " ".join(sys.argv),
                "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", ""), "thp_mode": thp_mode(),
                "rounds": args.rounds, "budget_s": args.budget, "load_end": load_average()}
        if rows:
            meta["geomean_vs_eager"], meta["geomean_vs_inductor"] = ge, gi
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
