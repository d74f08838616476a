"""Every configuration of one workload's first tuned kernel, timed like the benchmark (CUDA
events, L2 flushed before each call): what the tuner's short search could have found, and how
far the cost model's ranking is from the measured order.

    PYTHONPATH=src python scripts/sweep_space.py --workload rmsnorm [--out DIR]
"""
from __future__ import annotations

import argparse
import json

import torch

import tilefuse
from tilefuse.bench.timing import measure
from tilefuse.bench.workloads import WORKLOADS
from tilefuse.tile.lower import schedule_space
from tilefuse.tune import tuner
from tilefuse.tune.cost import predict


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workload", default="rmsnorm")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    w = WORKLOADS[args.workload]
    inputs = w.make_inputs(w.sizes["full"], torch.device("cuda"), torch.bfloat16)
    captured = []
    real = tuner._prepare

    def capture(graph, plan, options, level, device, aten):
        captured.append((graph, plan, options, device))
        return real(graph, plan, options, level, device, aten)

    tuner._prepare = capture
    tilefuse.compile(w.fn, autotune="0")(*inputs)
    graph, plan, options, device = captured[0]
    space = schedule_space(graph, plan, options)
    ceilings = tuner.device_ceilings(device)
    rows = []
    with tuner.real_tensors():
        bench = tuner._Bench(graph, plan, options, device)
        for cfg in space.schedules():
            row = {"config": cfg, "predicted_us": predict(space, cfg, ceilings) * 1e6}
            try:
                launchers = bench._kernels(cfg)
                row["us"] = measure(lambda: bench._run(launchers), (), "cuda", budget_s=0.15)["p50_ms"] * 1e3
            except Exception as e:  # noqa: BLE001 - a configuration that fails is a finding
                row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    rows.sort(key=lambda r: r.get("us", float("inf")))
    print("best:", json.dumps(rows[:5]))
    with open(f"{args.out}/sweep-{args.workload}.json", "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
