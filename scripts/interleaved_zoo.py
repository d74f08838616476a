"""Per-call time of whole models on a noisy host: backends alternating in one process.

    PYTHONPATH=src python scripts/interleaved_zoo.py --workloads nanogpt,resnet50 \
        --backends eager,inductor,tilefuse --rounds 10 --calls 30

A shared 2-core host's speed moves by a third or more between processes and minutes, so the
benchmark's p50s of one backend after another are not comparable there. This script compiles
every backend first, then warms each up (a later compile's Dynamo reset makes the earlier ones
compile again there), then runs `rounds` rounds; in each round every backend (in turn) makes
`calls` calls, and a backend's figure is the minimum over rounds of its round mean. Ratios
are tilefuse's time against each peer's in the same rounds. `--per-call` alternates the backends
call by call instead and reports medians. A training workload times its
whole step (forward, backward, optimizer). `--profile` adds one torch.profiler pass per
backend and prints the CPU ops and kernels with the most self time. A backend
`tilefuse[knob=value;...]` is tilefuse with those knobs (`--backends
tilefuse,tilefuse[column_tiles=0]` times a knob's effect in the same rounds).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch


def _profile(fn, inputs, calls: int, top: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn(*inputs)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def _per_call_medians(programs: dict, inputs, calls: int, sync) -> dict:
    """Each backend's median call time, the backends taking turns call by call."""
    times: dict[str, list[float]] = {b: [] for b in programs}
    for _ in range(calls):
        for backend, fn in programs.items():
            sync()
            start = time.perf_counter()
            fn(*inputs)
            sync()
            times[backend].append(time.perf_counter() - start)
    return {b: sorted(ts)[len(ts) // 2] for b, ts in times.items()}


def _register_variant(spec: str) -> None:
    """`tilefuse[knob=value,...]`: a Dynamo backend of that name, tilefuse with those knobs
    (strings, parsed as the knobs' environment variables are), to time beside plain tilefuse."""
    if not (spec.startswith("tilefuse[") and spec.endswith("]")):
        return
    import functools

    from torch._dynamo.backends.registry import register_backend

    from tilefuse.api import dynamo_backend

    options = dict(item.split("=", 1) for item in spec[len("tilefuse["):-1].split(";") if item)
    register_backend(name=spec)(functools.partial(dynamo_backend, options=options))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="nanogpt")
    ap.add_argument("--backends", default="eager,inductor,tilefuse")
    ap.add_argument("--size", default="quick")
    ap.add_argument("--layers", type=int, default=None, help="models: override the layer count")
    ap.add_argument("--shape", default=None, metavar="N,N,...",
                    help="the workload's size tuple itself (a model's: batch,sequence,layers,width), "
                         "instead of --size")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--per-call", action="store_true",
                    help="alternate the backends call by call and report each one's median call "
                         "(rounds x calls calls each): steadier than round means where the host's "
                         "speed moves within a round")
    ap.add_argument("--profile", type=int, default=0, metavar="TOP",
                    help="also print the TOP ops by self CPU time for each backend")
    args = ap.parse_args(argv)
    sys.path.append(os.path.join(os.path.dirname(__file__), "..", "src"))  # (after PYTHONPATH: an A/B tree there wins)
    from tilefuse.bench.backends import compiled_program
    import tilefuse as _tree

    print(f"tilefuse from {os.path.dirname(os.path.dirname(_tree.__file__))}", flush=True)  # (which tree an A/B ran)
    from tilefuse.bench.workload_base import DTYPES
    from tilefuse.bench.workloads import WORKLOADS

    for spec in args.backends.split(","):
        _register_variant(spec)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    backends = args.backends.split(",")
    ratios: dict[str, list[float]] = {b: [] for b in backends if b != "tilefuse"}
    for wname in args.workloads.split(","):
        w = WORKLOADS[wname]
        reason = w.unsupported(device)
        if reason:
            print(f"{wname}: n/a ({reason})")
            continue
        torch.manual_seed(0)
        size = tuple(int(v) for v in args.shape.split(",")) if args.shape else w.size(args.size, args.layers)
        inputs = w.make_inputs(tuple(size), device, DTYPES[args.dtype])
        programs = {}
        for backend in backends:
            fn = compiled_program(w, backend)
            start = time.perf_counter()
            fn(*inputs)
            sync()
            print(f"{wname}/{backend}: first call {time.perf_counter() - start:.1f} s", flush=True)
            programs[backend] = fn
        for fn in programs.values():  # (after every compile: a later one's Dynamo reset made the
            for _ in range(3):        # earlier backends compile again, here, not while timed)
                fn(*inputs)
        if args.per_call:
            best = _per_call_medians(programs, inputs, args.rounds * args.calls, sync)
        else:
            best = {b: math.inf for b in backends}
            for _ in range(args.rounds):
                for backend, fn in programs.items():
                    sync()
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        fn(*inputs)
                    sync()
                    best[backend] = min(best[backend], (time.perf_counter() - start) / args.calls)
        line = "  ".join(f"{b} {best[b] * 1e3:.3f} ms" for b in backends)
        print(f"{wname}: {line}")
        if "tilefuse" in best:
            for b in ratios:
                ratios[b].append(best[b] / best["tilefuse"])
                print(f"  tilefuse vs {b}: {best[b] / best['tilefuse']:.2f}x")
        if args.profile:
            for backend, fn in programs.items():
                print(f"\n-- {wname} / {backend}\n{_profile(fn, inputs, args.calls, args.profile)}")
    for b, rs in ratios.items():
        if rs:
            gm = math.exp(sum(math.log(r) for r in rs) / len(rs))
            print(f"geomean tilefuse vs {b}: {gm:.2f}x over {len(rs)} workloads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
