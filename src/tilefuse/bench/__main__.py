"""`python -m tilefuse.bench` (and `tilefuse bench`): benchmark workloads × backends on this
machine's default device and print a table; `--out DIR` also writes results.json,
report.md and PNG plots (speedup.png, roofline.png) — results.json is rewritten after every
measured pair, so an interrupted run keeps what it measured; `--merge` combines the results of
several runs (parts of one benchmark) into one report. Exits 0 even when a backend is n/a for
some workload (the table says why); 2 on bad arguments, checked before anything is measured (an
unknown workload or backend name among them); 1 with `--strict` if a backend disagrees with the
fp64 reference.
"""
from __future__ import annotations

import argparse
import os
import sys


def _csv(text: str) -> list[str]:
    return list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


#: options of a measurement, which --merge (measuring nothing) does not take
_MEASURING = {"workloads": "--workloads", "group": "--group", "layers": "--layers",
              "backends": "--backends", "sizes": "--sizes", "dtype": "--dtype",
              "device": "--device", "budget": "--budget", "flush_l2": "--no-flush-l2",
              "compile_latency": "--compile-latency", "compile_latency_only": "--compile-latency-only",
              "sweep": "--no-sweep", "memory": "--no-memory", "seed": "--seed"}


def build_parser() -> argparse.ArgumentParser:
    from .backends import DEFAULT_BACKENDS, MODEL_BACKENDS
    from .runner import DTYPES, GROUPS
    from .workloads import WORKLOADS

    p = argparse.ArgumentParser(
        prog="tilefuse bench",
        description="Benchmark small PyTorch workloads across compiler backends.")
    p.add_argument("--workloads", type=_csv, default=None,
                   help=f"comma-separated, default all: {','.join(WORKLOADS)}")
    p.add_argument("--group", choices=list(GROUPS), default=None,
                   help="which workloads when --workloads is not given: kernels (default), "
                        "models (whole models: nanoGPT, gpt-fast, Hugging Face, ResNet-50) "
                        "or all")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="models: run with N layers instead of the size's (quick iteration)")
    p.add_argument("--backends", type=_csv, default=None,
                   help="comma-separated: eager, inductor, inductor-max-autotune, "
                        "inductor-max-autotune-no-cudagraphs, inductor-reduce-overhead (GPU), tilefuse, "
                        "tilefuse-reduce-overhead, tilefuse-max-autotune, tilefuse-max-autotune-no-cudagraphs (GPU), jax, "
                        "or any registered Dynamo backend name "
                        f"(default {','.join(DEFAULT_BACKENDS)}; for --group models "
                        f"{','.join(MODEL_BACKENDS)})")
    p.add_argument("--sizes", choices=["quick", "full"], default=None,
                   help="default: full on CUDA, quick on CPU")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda if available, else cpu")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write results.json, report.md and PNG plots into DIR")
    p.add_argument("--budget", type=_seconds, default=None, metavar="SECONDS",
                   help="timing budget per measurement (default 0.3 on CUDA, 0.2 on CPU)")
    p.add_argument("--no-flush-l2", dest="flush_l2", action="store_false",
                   help="CUDA: keep the L2 cache warm between timed calls")
    p.add_argument("--compile-latency", action="store_true",
                   help="also measure cold and warm compile latency, each in a fresh process "
                        "(empty cache directories, then the same ones), and artifact sizes")
    p.add_argument("--compile-latency-only", action="store_true",
                   help="measure only cold and warm compile latency and artifact sizes (no "
                        "timing, memory or sweep): a part of a run, combined with --merge")
    p.add_argument("--no-sweep", dest="sweep", action="store_false",
                   help="skip the dynamic-shape sweep (recompiles, coverage)")
    p.add_argument("--no-memory", dest="memory", action="store_false",
                   help="skip the peak-memory measurement")
    p.add_argument("--seed", type=int, default=0, help="seed for the random inputs")
    p.add_argument("--quiet", action="store_true", help="no progress, only the table")
    p.add_argument("--merge", nargs="+", default=None, metavar="RESULTS_JSON",
                   help="measure nothing: merge the results.json of several runs (parts of one "
                        "benchmark on the same device) into one table, report and plots (--out)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 if any backend's output disagrees with the fp64 reference")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.out and os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out!r} exists and is not a directory")
    if args.merge:
        given = [flag for dest, flag in _MEASURING.items() if getattr(args, dest) != parser.get_default(dest)]
        if given:
            parser.error(f"--merge measures nothing, so it takes none of {', '.join(given)}")

    from . import report
    from .runner import BenchOptions, run

    if args.merge:
        import json

        try:
            result = report.merge_reports([json.loads(open(p).read()) for p in args.merge])
        except (OSError, ValueError) as e:
            parser.error(f"--merge: {e}")
        return _finish(result, args)
    from .backends import DEFAULT_BACKENDS, MODEL_BACKENDS

    backends = args.backends or list(MODEL_BACKENDS if args.group == "models"
                                     else DEFAULT_BACKENDS)
    opts = BenchOptions(workloads=args.workloads, group=args.group, layers=args.layers,
                        backends=backends, sizes=args.sizes,
                        dtype=args.dtype, device=args.device, budget_s=args.budget,
                        flush_l2=args.flush_l2, seed=args.seed, quiet=args.quiet,
                        sweep=args.sweep, compile_latency=args.compile_latency,
                        compile_latency_only=args.compile_latency_only,
                        memory=args.memory)
    try:
        opts = opts.resolved()
    except ValueError as e:
        parser.error(str(e))
    on_result = (lambda partial: report.write_json(partial, args.out)) if args.out else None
    result = run(opts, on_result=on_result)
    return _finish(result, args)


def _finish(result: dict, args) -> int:
    from rich.console import Console

    from . import report

    console = Console()
    if not console.is_terminal:  # logs and pipes: do not squeeze the table into 80 columns
        console = Console(width=200)
    console.print(report.render_table(result))
    if args.out:
        json_path, md_path, plots = report.write_outputs(result, args.out)
        Console(stderr=True).print(
            f"wrote {', '.join(str(p) for p in (json_path, md_path, *plots))}")
    mismatches = [r for r in result["results"] if r["status"] == "ok" and r.get("correct") is False]
    return 1 if args.strict and mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
