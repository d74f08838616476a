"""Record what a compile lowers: `with recorded_lowerings() as seen:` collects the
(graph, plan, lowering options) of every plan the compiler lowers inside the block, for tests
that lower a captured plan again under other options (and, given a list, the tile kernels
each lowering returned)."""
from __future__ import annotations

import contextlib

from tilefuse import compiler


@contextlib.contextmanager
def recorded_lowerings(kernels: list | None = None):
    """`kernels`, when given, also receives the tile kernels each lowering returned."""
    seen: list = []
    real = compiler._lower

    def record(graph, plan, options):
        seen.append((graph, plan, options))
        lowered = real(graph, plan, options)
        if kernels is not None:
            kernels.extend(lowered)
        return lowered

    compiler._lower = record
    try:
        yield seen
    finally:
        compiler._lower = real
