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


def plans_of(fn, *args, **knobs) -> list:
    """The (graph, plan, lowering options) of every plan compiling `fn` for `args` lowers up to
    the first, captured without lowering or running anything (shapes too large to run in a
    test). The compile stops at its first lowering: tests look for the plan they need there."""
    import torch

    import tilefuse

    seen: list = []

    class Captured(Exception):
        pass

    def record(graph, plan, options):
        seen.append((graph, plan, options))
        raise Captured()

    real = compiler._lower
    compiler._lower = record
    try:
        torch._dynamo.reset()
        with tilefuse.config.patch(**{"target": "cpu", "fallback": "error", **knobs}):
            try:
                torch.compile(fn, backend="tilefuse", dynamic=False)(*args)
            except Exception:  # noqa: BLE001 - stopped at its first lowering
                pass
    finally:
        compiler._lower = real
    return seen
