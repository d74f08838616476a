"""A/B of the Triton launch path on one model, in one process (GPU): the compiled kernel's
launcher called directly (`direct_launch`) against its `[grid]` runner, alternating rounds;
host time per call (`time.perf_counter` over a round, synchronised at its end) and the call's
time with the GPU (CUDA events).

    PYTHONPATH=src python scripts/ab_launch_path.py --workloads hf_t5,hf_bert --layers 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="hf_t5")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--iters", type=int, default=40)
    args = ap.parse_args(argv)
    import tilefuse
    from tilefuse.backends.triton import direct_launch as dl
    from tilefuse.bench.workloads import WORKLOADS

    direct = dl._no_launch_hooks
    for name in args.workloads.split(","):
        w = WORKLOADS[name]
        size = list(w.sizes["full"])
        if w.group == "models":
            size[2] = args.layers
        inputs = w.make_inputs(tuple(size), torch.device("cuda"), torch.bfloat16)
        run = tilefuse.compile(w.fn)
        with torch.no_grad():
            for _ in range(5):
                run(*inputs)
            torch.cuda.synchronize()
            rows = {"launcher": ([], []), "runner": ([], [])}
            for _ in range(6):
                for way, hooks in (("launcher", direct), ("runner", lambda: False)):
                    dl._no_launch_hooks = hooks
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t0 = time.perf_counter()
                    start.record()
                    for _ in range(args.iters):
                        run(*inputs)
                    end.record()
                    host = (time.perf_counter() - t0) / args.iters
                    torch.cuda.synchronize()
                    rows[way][0].append(host * 1e3)
                    rows[way][1].append(start.elapsed_time(end) / args.iters)
            dl._no_launch_hooks = direct
        for way, (host, gpu) in rows.items():
            print(f"{name:10s} {way:9s} host {statistics.median(host):.3f} ms per call (enqueue), "
                  f"wall {statistics.median(gpu):.3f} ms per call")
        torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
