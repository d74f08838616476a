"""Graph breaks with Dynamo's reasons, recorded while a block runs (for `tilefuse.explain`).

Dynamo writes each graph break to its `graph_breaks` log artifact: "Graph break in user code at
file:line", "Graph Break Reason: ...", and the user's traceback. For the duration of the block a
handler of ours receives those records, on that artifact's logger only and without passing them
on, and the logger's level and propagation are put back afterwards.
"""
from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass
from typing import Iterator

_LOGGER = "torch._dynamo.symbolic_convert.__graph_breaks"
_WHERE = re.compile(r"in user code at (?P<where>\S+?:\d+)")


@dataclass
class GraphBreak:
    where: str  # "file.py:12"
    reason: str  # Dynamo's one-line reason, e.g. "Data-dependent branching"
    explanation: str  # Dynamo's explanation line, when it gives one
    text: str  # the whole record

    def __str__(self) -> str:
        return f"{self.where}  {self.reason}" + (f" — {self.explanation}" if self.explanation else "")


def parse(text: str) -> GraphBreak:
    where = _WHERE.search(text)
    reason = explanation = ""
    lines = [line.strip() for line in text.splitlines()]
    for k, line in enumerate(lines):
        if line.startswith("Graph Break Reason:"):
            reason = line.split(":", 1)[1].strip()
            # "Encountered graph break when attempting to trace CALL: ...": the type is next
            if reason.startswith("Encountered graph break") and k + 2 < len(lines):
                reason = next((x for x in lines[k + 1:] if x), reason)
        elif line.startswith("Explanation:") and not explanation:
            explanation = line.split(":", 1)[1].strip()
    return GraphBreak(where.group("where") if where else "?", reason or lines[0], explanation, text)


class _Collector(logging.Handler):
    def __init__(self, into: list):
        super().__init__(logging.DEBUG)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.into.append(parse(record.getMessage()))
        except Exception:  # noqa: BLE001 - a record we cannot read is dropped, never raised
            pass


@contextlib.contextmanager
def recorded_graph_breaks() -> Iterator[list]:
    """A list that fills with a `GraphBreak` per graph break Dynamo reports inside the block."""
    found: list = []
    log = logging.getLogger(_LOGGER)
    handler = _Collector(found)
    level, propagate = log.level, log.propagate
    log.addHandler(handler)
    if not log.isEnabledFor(logging.DEBUG):
        log.setLevel(logging.DEBUG)
        log.propagate = False  # the user did not ask to see them: only we do
    try:
        yield found
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate
