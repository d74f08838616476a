"""Per-kernel GPU time of benchmark workloads, for tilefuse and its peers, in one process.

    PYTHONPATH=src python scripts/profile_workload.py --workloads llama_block,rope_kv_cache \
        --backends tilefuse,inductor --out OUT_DIR

For each (workload, backend): compile on the workload's full size (bf16), warm up, then record
`--iters` calls under `torch.profiler` and sum the device time of every kernel by name. Prints
one table per pair (kernel, calls, total µs per call, share) and writes `profile.json`; for
tilefuse also `explain_<workload>.txt` (plans, chosen schedules and kernel sources), for an
Inductor backend (`inductor`, `inductor-max-autotune-no-cudagraphs`, ... as in the benchmark)
its output code `<backend>_<workload>.py`, so each slow kernel can be read next to its time.
Each table ends with the GPU's idle time between kernels per call and the kernels that most
often wait before they start (a host-bound stretch or a sync shows there).
With `--host`, also the host side: `iters` calls under cProfile, the functions with the most
time of their own in `host_<workload>_<backend>.txt` (where a host-bound call's time goes).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def _device_time(evt) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(evt, attr):
            return float(getattr(evt, attr))
    return 0.0


def profile(fn, inputs, iters: int) -> tuple[list, float, dict]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(3):
        fn(*inputs)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(*inputs)
    end.record()
    torch.cuda.synchronize()
    wall_ms = start.elapsed_time(end) / iters
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn(*inputs)
        torch.cuda.synchronize()
    rows = []
    gaps = _idle_gaps(prof, iters)
    for evt in prof.key_averages():
        t = _device_time(evt)
        if t > 0 and evt.device_type.name == "CUDA":
            rows.append({"kernel": evt.key, "calls": evt.count / iters, "us": t / iters})
    rows.sort(key=lambda r: -r["us"])
    return rows, wall_ms, gaps


def _idle_gaps(prof, iters: int) -> dict:
    """Where the GPU waits between kernels: the idle time from the first kernel to the last,
    per call (the gaps between calls included), and the kernels that most often start after a
    gap (a host-bound stretch, a sync), with the idle µs per call before each."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    if not spans:
        return {"idle_us": 0.0, "before": []}
    idle, before, reach = 0.0, {}, spans[0][1]
    for start, end, name in spans[1:]:
        if start > reach:
            idle += start - reach
            before[name] = before.get(name, 0.0) + start - reach
        reach = max(reach, end)
    top = sorted(before.items(), key=lambda kv: -kv[1])[:8]
    return {"idle_us": idle / iters, "before": [{"kernel": k, "us": v / iters} for k, v in top]}


def profile_host(fn, inputs, iters: int, path: str) -> None:
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn(*inputs)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    with open(path, "w") as f:
        f.write(f"{iters} calls\n{text.getvalue()}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="llama_block")
    ap.add_argument("--backends", default="tilefuse,inductor")
    ap.add_argument("--size", default="full")
    ap.add_argument("--layers", type=int, default=None, help="models: override the layer count")
    ap.add_argument("--shape", default=None, metavar="N,N,...",
                    help="the workload's size tuple itself (a model's: batch,sequence,layers,width), "
                         "instead of --size")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=".")
    ap.add_argument("--host", action="store_true", help="also profile the host side of a call (cProfile)")
    args = ap.parse_args(argv)
    sys.path.append(os.path.join(os.path.dirname(__file__), "..", "src"))  # (after PYTHONPATH: an A/B tree there wins)
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    import tilefuse
    from tilefuse.bench.backends import compiled_program
    import tilefuse as _tree

    print(f"tilefuse from {os.path.dirname(os.path.dirname(_tree.__file__))}", flush=True)  # (which tree an A/B ran)
    from tilefuse.bench.workloads import WORKLOADS as by_name

    os.makedirs(args.out, exist_ok=True)
    results = {}
    for wname in args.workloads.split(","):
        w = by_name[wname]
        torch.manual_seed(0)
        size = tuple(int(v) for v in args.shape.split(",")) if args.shape else w.size(args.size, args.layers)
        inputs = w.make_inputs(tuple(size), torch.device("cuda"), torch.bfloat16)
        for backend in args.backends.split(","):
            fn = compiled_program(w, backend)
            sources: list[str] = []
            with mock.patch.object(GraphLowering, "save_output_code", sources.append):
                fn(*[t.clone() if isinstance(t, torch.Tensor) else t for t in inputs])
            if sources:
                with open(os.path.join(args.out, f"{backend}_{wname}.py"), "w") as f:
                    f.write("\n\n".join(sources))
            rows, wall, gaps = profile(fn, inputs, args.iters)
            results[f"{wname}/{backend}"] = {"wall_ms": wall, "kernels": rows, "gaps": gaps}
            if args.host:
                profile_host(fn, inputs, args.iters, os.path.join(args.out, f"host_{wname}_{backend}.txt"))
            total = sum(r["us"] for r in rows)
            print(f"\n== {wname} / {backend}: {wall * 1e3:.0f} µs per call (events), "
                  f"kernels {total:.0f} µs")
            for r in rows[:25]:
                print(f"  {r['us']:9.1f} µs  {r['calls']:4.1f}×  {100 * r['us'] / total:5.1f}%  {r['kernel'][:90]}")
            print(f"  GPU idle between kernels: {gaps['idle_us']:.0f} µs per call; most before:")
            for g in gaps["before"][:5]:
                print(f"    {g['us']:7.1f} µs  {g['kernel'][:90]}")
            if backend == "tilefuse":
                torch._dynamo.reset()
                # a training step autocasts around the compiled function: so does its explanation
                autocast = getattr(inputs[0], "_bench_autocast", None)
                with torch.autocast("cuda", dtype=autocast or torch.float32, enabled=autocast is not None):
                    report = tilefuse.explain(w.fn, *inputs, verbose=True)
                with open(os.path.join(args.out, f"explain_{wname}.txt"), "w") as f:
                    f.write(str(report))
    with open(os.path.join(args.out, "profile.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
