"""Every configuration of one workload's first tuned kernel, timed like the benchmark (CUDA
events, L2 flushed before each call): what the tuner's short search could have found, and how
far the cost model's ranking is from the measured order.

    PYTHONPATH=src python scripts/sweep_space.py --workload rmsnorm [--out DIR]

`sweep_first_plan` does it for any function (scripts/probe_skinny_products.py).
"""
from __future__ import annotations

import argparse
import json

import torch

import tilefuse
from tilefuse.bench.timing import measure
from tilefuse.config import config
from tilefuse.bench.workloads import WORKLOADS
from tilefuse.tile.lower import schedule_space
from tilefuse.tune import tuner
from tilefuse.tune.cost import predict


def sweep_first_plan(fn, inputs, label: str, out: str, keep=None, cublas=None) -> list[dict]:
    """Compile `fn` with tilefuse, then time every schedule of its first tuned plan (those
    `keep(schedule)` accepts), compiled side by side first in the compile workers; `cublas`, a
    callable, is timed beside them as the library's figure. Writes `sweep-<label>.json`."""
    captured = []
    real = tuner._prepare

    def capture(graph, plan, options, level, device, aten):
        captured.append((graph, plan, options, device))
        return real(graph, plan, options, level, device, aten)

    tuner._prepare = capture
    try:
        with config.patch(graph_cache=False):  # (a stored graph is not planned again)
            tilefuse.compile(fn, autotune="0")(*inputs)
    finally:
        tuner._prepare = real
    graph, plan, options, device = captured[0]
    space = schedule_space(graph, plan, options)
    ceilings = tuner.device_ceilings(device)
    schedules = [cfg for cfg in space.schedules() if keep is None or keep(cfg)]
    rows = []
    with tuner.real_tensors():
        bench = tuner._Bench(graph, plan, options, device)
        bench.precompile(schedules)
        for cfg in schedules:
            row = {"config": dict(cfg), "predicted_us": predict(space, cfg, ceilings) * 1e6}
            try:
                launchers = bench._kernels(cfg)
                row["us"] = measure(lambda: bench._run(launchers), (), "cuda", budget_s=0.15)["p50_ms"] * 1e3
            except Exception as e:  # noqa: BLE001 - a configuration that fails is a finding
                row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
            rows.append(row)
    if cublas is not None:
        rows.append({"config": "library", "us": measure(cublas, (), "cuda", budget_s=0.3)["p50_ms"] * 1e3})
    # the model's first: ties broken by the space's order, as `tune.cost.rank` breaks them (before
    # the rows are sorted by their measured times)
    by_model = sorted((r for r in rows if "predicted_us" in r and "us" in r), key=lambda r: r["predicted_us"])
    rows.sort(key=lambda r: r.get("us", float("inf")))
    print(f"== {label}: {len(rows)} measured; best {json.dumps(rows[:3])}")
    if by_model:
        print(f"   the model's first: {json.dumps(by_model[0])}")
    with open(f"{out}/sweep-{label}.json", "w") as f:
        json.dump(rows, f, indent=1)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workload", default="rmsnorm")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    w = WORKLOADS[args.workload]
    inputs = w.make_inputs(w.sizes["full"], torch.device("cuda"), torch.bfloat16)
    sweep_first_plan(w.fn, inputs, args.workload, args.out)


if __name__ == "__main__":
    main()
