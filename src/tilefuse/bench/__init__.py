"""The unified benchmark: workloads × backends × metrics, reports.

`python -m tilefuse.bench` or `tilefuse bench`; programmatic use:
`tilefuse.bench.runner.run(BenchOptions(...))`. Importing this package is cheap: the
runner (and torch) are imported only when `main` runs.
"""
from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark CLI with `argv` (default sys.argv[1:]); returns the exit code."""
    from .__main__ import main as _main

    return _main(argv)


__all__ = ["main"]
