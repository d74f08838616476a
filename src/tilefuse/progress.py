"""A graph compile's progress line on an interactive terminal.

A compile that lasts more than a second shows one status line on stderr, rewritten in place:
the graph, its kernel plans done out of all, how many were tuned and built, and what it is
doing now (`tuning forward_mm_3: 6 runs, best 41.2 us`). The line is erased when the graph is
done (the `compile_time` log channel keeps a plain summary line per graph for logs). Nothing is
written when stderr is not a terminal, and short compiles write nothing at all.
"""
from __future__ import annotations

import math
import sys
import time

#: seconds a compile runs before its line appears
SHOW_AFTER_S = 1.0
#: least seconds between two redraws
REDRAW_S = 0.1


class CompileProgress:
    def __init__(self, graph: str, total: int, stream=None, show_after: float = SHOW_AFTER_S):
        self.graph = graph
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.live = _interactive(self.stream)
        self.start = time.perf_counter()
        self.show_after = show_after
        self.done = self.tuned = self.built = 0
        self.doing = ""
        self._drawn = 0.0
        self._width = 0

    def plan_done(self, tuned: bool = False, built: int = 0) -> None:
        self.done += 1
        self.tuned += bool(tuned)
        self.built += built
        self.doing = ""
        self._draw()

    def now(self, doing: str) -> None:
        self.doing = doing
        self._draw()

    def tuning(self, kernel: str):
        """A tuner progress callback `(runs, total, best seconds)` for `kernel`."""
        def update(runs, total, best):
            best_us = f", best {best * 1e6:.1f} us" if best is not None and math.isfinite(best) else ""
            self.now(f"tuning {kernel}: {runs} runs{best_us}")
        return update

    def line(self) -> str:
        doing = f" — {self.doing}" if self.doing else ""
        return (f"tilefuse: compiling {self.graph}: {self.done}/{self.total} kernel plans, {self.tuned} tuned, "
                f"{self.built} built, {time.perf_counter() - self.start:.0f} s{doing}")

    def _draw(self, force: bool = False) -> None:
        if not self.live:
            return
        now = time.perf_counter()
        if not force and (now - self.start < self.show_after or now - self._drawn < REDRAW_S):
            return
        self._drawn = now
        text = self.line()
        pad = max(0, self._width - len(text))
        self._width = len(text)
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()

    def close(self) -> None:
        """Erase the line (a compile's summary goes to the `compile_time` log)."""
        if self.live and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0


def _interactive(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


__all__ = ["CompileProgress", "SHOW_AFTER_S"]
