"""Record what a compile lowers: `with recorded_lowerings() as seen:` collects the
(graph, plan, lowering options) of every plan the compiler lowers inside the block, for tests
that lower a captured plan again under other options."""
from __future__ import annotations

import contextlib

from tilefuse import compiler


@contextlib.contextmanager
def recorded_lowerings():
    seen: list = []
    real = compiler._lower

    def record(graph, plan, options):
        seen.append((graph, plan, options))
        return real(graph, plan, options)

    compiler._lower = record
    try:
        yield seen
    finally:
        compiler._lower = real
