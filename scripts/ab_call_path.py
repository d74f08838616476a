"""A/B/C of a compiled model's call path, in one process (GPU), alternating rounds:
- `generated`: the graph's generated call per set of sizes (`runtime.straight_line`, default);
- `steps`: the general call walking the graph's steps, launches through the compiled kernel's
  own launcher (`direct_launch`);
- `runner`: the general call, launches through Triton's `[grid]` runner.
Host time per call (`time.perf_counter` over a round, synchronised at its end) and the call's
time with the GPU (CUDA events).

    PYTHONPATH=src python scripts/ab_call_path.py --workloads hf_t5,hf_bert --layers 2
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
    from tilefuse.ir.interpret import bind_from
    from tilefuse.runtime.compiled import CompiledGraph

    generated_run = CompiledGraph._run

    def steps_run(self, call_args, on_step, labels):
        return self._general(call_args, bind_from(self.symbol_sources, call_args), on_step, labels)

    direct = dl._no_launch_hooks
    ways = {"generated": (generated_run, direct), "steps": (steps_run, direct),
            "runner": (steps_run, lambda: False)}
    for name in args.workloads.split(","):
        w = WORKLOADS[name]
        size = w.size("full", args.layers)
        inputs = w.make_inputs(tuple(size), torch.device("cuda"), torch.bfloat16)
        run = tilefuse.compile(w.fn)
        with torch.no_grad():
            for _ in range(5):
                run(*inputs)
            torch.cuda.synchronize()
            rows = {way: ([], []) for way in ways}
            for _ in range(6):
                for way, (call_path, hooks) in ways.items():
                    CompiledGraph._run, dl._no_launch_hooks = call_path, hooks
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
            CompiledGraph._run, dl._no_launch_hooks = generated_run, direct
        for way, (host, gpu) in rows.items():
            print(f"{name:15s} {way:9s} host {statistics.median(host):.3f} ms per call (enqueue), "
                  f"wall {statistics.median(gpu):.3f} ms per call")
        torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
