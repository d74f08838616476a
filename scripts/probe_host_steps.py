"""Where a host-bound compiled graph's call time goes, step by step (GPU): each step of every
tilefuse graph is timed on the host (`time.perf_counter`, no synchronisation), summed by kind
(kernel launch, ATen call by op, the rest of the call), over `--iters` calls.

    PYTHONPATH=src python scripts/probe_host_steps.py --workloads resnet50 --iters 50
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="resnet50")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)
    sys.path.append(os.path.join(os.path.dirname(__file__), "..", "src"))  # (after PYTHONPATH: an A/B tree there wins)
    import tilefuse
    from tilefuse.bench.workloads import WORKLOADS
    from tilefuse.runtime import compiled as rc

    totals: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    step, extern = rc.CompiledGraph._step, rc.CompiledGraph._extern
    copies = [0]
    conform = rc.CompiledGraph._conform

    def timed_step(self, s, buffers, env):
        t = time.perf_counter()
        step(self, s, buffers, env)
        kind = "kernel" if isinstance(s, rc.KernelStep) else f"aten {self.graph[s.name].target_name}"
        totals[kind] += time.perf_counter() - t
        counts[kind] += 1

    def counted_conform(self, name, value):
        out = conform(self, name, value)
        copies[0] += out is not value
        return out

    rc.CompiledGraph._conform = counted_conform
    for wname in args.workloads.split(","):
        w = WORKLOADS[wname]
        size = w.size("full", args.layers)
        inputs = w.make_inputs(tuple(size), torch.device("cuda"), torch.bfloat16)
        torch._dynamo.reset()
        fn = w.program(tilefuse.compile(w.fn, fallback="error"))
        for _ in range(3):
            fn(*inputs)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.iters):
            fn(*inputs)
        plain = (time.perf_counter() - t) / args.iters
        torch.cuda.synchronize()
        # every step through `_step` (the profiled path's body, without the profiler ranges)
        rc.CompiledGraph._run_plain = rc.CompiledGraph._run
        rc.CompiledGraph._run = lambda self, a, on_step, labels: rc.CompiledGraph._run_plain(self, a, on_step, [None] * len(self.steps))
        import contextlib
        rc.profiled = lambda label: contextlib.nullcontext()
        rc.CompiledGraph._step = timed_step
        totals.clear(), counts.clear()
        copies[0] = 0
        t = time.perf_counter()
        for _ in range(args.iters):
            fn(*inputs)
        timed = (time.perf_counter() - t) / args.iters
        torch.cuda.synchronize()
        rc.CompiledGraph._step, rc.CompiledGraph._run = step, rc.CompiledGraph._run_plain
        print(f"\n== {wname}: host {plain * 1e3:.2f} ms per call untimed, {timed * 1e3:.2f} ms timed; "
              f"{copies[0] / args.iters:.1f} layout copies per call")
        for kind, total in totals.most_common():
            n = counts[kind] / args.iters
            print(f"  {kind:45s} {n:5.1f} per call  {total / args.iters * 1e3:7.3f} ms  "
                  f"{total / counts[kind] * 1e6:6.1f} µs each")
        rest = timed - sum(totals.values()) / args.iters
        print(f"  {'the rest (binding, allocation, guards)':45s}             {rest * 1e3:7.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
