"""A cProfile of one compile: `compile_profile(fn, *args)` compiles and runs `fn` once (as
`tilefuse.explain` does) under cProfile and returns the explanation with the top functions —
to find where compile time goes, and for tests that check a compile's shape, not its speed."""
from __future__ import annotations

from dataclasses import dataclass

from ..compile_profile import cprofile


@dataclass
class CompileProfile:
    explanation: object  # tilefuse.Explanation of the graphs compiled
    functions: list  # [(file:line(function), calls, own seconds, cumulative seconds)], slowest first

    def calls(self, name: str) -> int:
        """How often functions whose description contains `name` ran (among the top ones)."""
        return sum(c for f, c, _, _ in self.functions if name in f)


def compile_profile(fn, *args, top: int | None = 40, sort: str = "cumulative", **kwargs) -> CompileProfile:
    """`top`: how many functions to keep, slowest first (None: all)."""
    from ..api import explain

    explanation, functions = cprofile(explain, fn, *args, top=top, sort=sort, **kwargs)
    return CompileProfile(explanation, functions)


__all__ = ["compile_profile", "CompileProfile"]
