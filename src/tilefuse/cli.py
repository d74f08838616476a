"""The `tilefuse` command: `bench`, `explain`, `cache info|clear`, `ops [--sweep]`, `fuzz`."""
from __future__ import annotations

import argparse
import json
import os
import runpy
import sys


def _cache(args) -> int:
    from .runtime.cache import DiskCache

    names = ("triton", "tune", "cpu")
    if args.action == "info":
        info = {n: DiskCache(n).info() for n in names}
        print(json.dumps(info, indent=2, default=str))
    else:
        removed = sum(DiskCache(n).clear() for n in names)
        print(f"removed {removed} cache entries")
    return 0


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[last]}"), transient=False)


def _sweep(args) -> int:
    """Run PyTorch's OpInfo samples through tilefuse and print the coverage."""
    import dataclasses

    from .check import op_sweep

    dtypes = tuple(args.dtypes.split(","))
    for d in dtypes:
        if d not in op_sweep.DTYPES:
            raise SystemExit(f"unknown dtype {d!r}: choose from {', '.join(op_sweep.DTYPES)}")
    infos = op_sweep.load_op_db()
    if args.op:
        infos = [i for i in infos if op_sweep.op_name(i) in set(args.op)]
    results = []

    def write_json(complete: bool) -> None:
        # rewritten after every op (atomically), so a stopped run leaves the results so far
        if not args.json:
            return
        tmp = f"{args.json}.tmp"
        with open(tmp, "w") as f:
            json.dump({"complete": complete, "total": len(infos) * len(dtypes),
                       "results": [dataclasses.asdict(r) for r in results]}, f, indent=1)
        os.replace(tmp, args.json)

    with _progress() as bar:
        task = bar.add_task("op_db sweep", total=len(infos) * len(dtypes), last="")
        for info in infos:
            for dtype in dtypes:
                r = op_sweep.check_op(info, dtype, args.samples)
                results.append(r)
                write_json(False)
                bar.update(task, advance=1, last=f"{r.op} {r.dtype}: {r.status}")
    write_json(True)
    print(op_sweep.format_coverage(results))
    failing = [r for r in results if r.status in ("mismatch", "error")]
    for r in sorted(failing, key=lambda r: (r.status, r.op)):
        print(f"{r.status:>9}  {r.op} [{r.dtype}]: {r.detail}")
    if args.json:
        print(f"results written to {args.json}")
    return 1 if failing else 0


def _fuzz(args) -> int:
    """Run the differential fuzzer; failing cases are shrunk and written as scripts."""
    from .check import fuzz

    out_dir = args.out
    with _progress() as bar:
        task = bar.add_task(f"fuzz (seed {args.seed})", total=args.cases, last="")

        def progress(k, outcome):
            bar.update(task, advance=1, last=f"case {k}: {outcome.status}")

        report = fuzz.run_fuzz(args.cases, seed=args.seed, max_ops=args.max_ops, out_dir=out_dir,
                               shrink_failures=not args.no_shrink, progress=progress)
    print(report.summary())
    for f in report.failures:
        print(f"case {f.case}: {f.outcome.status}: {f.outcome.detail}")
        print("  shrunk to:\n" + "\n".join("    " + line for line in f.shrunk.function_source().splitlines()))
        if f.reproducer:
            print(f"  reproducer: {f.reproducer}")
    return 1 if report.failures else 0


def _ops(args) -> int:
    if args.sweep:
        return _sweep(args)
    from .frontend import to_ir  # noqa: F401  (registers the lowerings)
    from .frontend.registry import registered_ops

    ops = registered_ops()
    for op in ops:
        print(op)
    print(f"{len(ops)} ATen ops/overloads lowered to generated code; every other op runs as an ATen extern call",
          file=sys.stderr)
    return 0


def _explain(args) -> int:
    """Run a script's `main()`-less body with tilefuse logging of every stage."""
    from .config import config

    config.logs = "graph,fusion,tile,code"
    runpy.run_path(args.script, run_name="__main__")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the benchmark parses its own options
        from .bench import main as bench_main

        return bench_main(argv[1:]) or 0
    parser = argparse.ArgumentParser(prog="tilefuse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", help="run the benchmark (tilefuse bench --help for its options)")
    c = sub.add_parser("cache", help="inspect or clear the kernel cache")
    c.add_argument("action", choices=["info", "clear"])
    o = sub.add_parser("ops", help="list the ATen ops tilefuse generates code for; --sweep runs PyTorch's OpInfo "
                                   "samples through tilefuse and prints the coverage")
    o.add_argument("--sweep", action="store_true", help="run the op_db sweep (needs the expecttest package)")
    o.add_argument("--dtypes", default="float32,bfloat16,int64", help="comma list (default: %(default)s)")
    o.add_argument("--samples", type=int, default=2, help="samples per op and dtype (default: %(default)s)")
    o.add_argument("--op", action="append", help="only this OpInfo name (repeatable)")
    o.add_argument("--json", help="write every result to this file")
    z = sub.add_parser("fuzz", help="differential fuzzing: random programs compiled and compared with eager")
    z.add_argument("--cases", type=int, default=100)
    z.add_argument("--seed", type=int, default=0)
    z.add_argument("--max-ops", type=int, default=6, help="statements per program (default: %(default)s)")
    z.add_argument("--out", default="tilefuse-fuzz", help="where reproducers are written (default: %(default)s)")
    z.add_argument("--no-shrink", action="store_true", help="do not shrink failing cases")
    e = sub.add_parser("explain", help="run a script with every compiler stage logged")
    e.add_argument("script")
    args = parser.parse_args(argv)
    if args.command == "cache":
        return _cache(args)
    if args.command == "ops":
        return _ops(args)
    if args.command == "fuzz":
        return _fuzz(args)
    return _explain(args)


if __name__ == "__main__":
    sys.exit(main())
