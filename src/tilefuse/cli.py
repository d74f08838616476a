"""The `tilefuse` command: `bench`, `explain`, `cache info|clear`, `ops`."""
from __future__ import annotations

import argparse
import json
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


def _ops(args) -> int:
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
    sub.add_parser("ops", help="list the ATen ops tilefuse generates code for")
    e = sub.add_parser("explain", help="run a script with every compiler stage logged")
    e.add_argument("script")
    args = parser.parse_args(argv)
    if args.command == "cache":
        return _cache(args)
    if args.command == "ops":
        return _ops(args)
    return _explain(args)


if __name__ == "__main__":
    sys.exit(main())
