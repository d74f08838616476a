"""How one fuzz case ends: `ok`, `mismatch`, `error` (tilefuse raised) or `skipped` (eager
or Dynamo rejected it: not ours), and how a failed compiled call is counted."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Outcome:
    status: str  # "ok" | "mismatch" | "error" | "skipped"
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.status in ("mismatch", "error")


def tilefuse_error_in(err: BaseException):
    """tilefuse's own error down `err`'s chain of causes (Dynamo wraps it), or None."""
    from ..api import TilefuseError

    seen, depth = err, 0
    while seen is not None and depth < 10:
        if isinstance(seen, TilefuseError):
            return seen
        seen = getattr(seen, "inner_exception", None) or seen.__cause__ or seen.__context__
        depth += 1
    return None


def compile_failure(err: BaseException) -> Outcome:
    """How a failed compiled call counts: tilefuse's error, or Dynamo's refusal (skipped)."""
    ours = tilefuse_error_in(err)
    if ours is not None:
        return Outcome("error", str(ours).splitlines()[0])
    if isinstance(err, torch._dynamo.exc.Unsupported):
        return Outcome("skipped", f"Dynamo: {type(err).__name__}: {str(err).splitlines()[0]}")
    return Outcome("error", f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
