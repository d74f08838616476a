"""The exceptions and warnings a user of tilefuse sees, in one place below every layer.

Each stage raises these where it finds the problem, and a user catches them by the names the
package exports (`tilefuse.TilefuseError`, `tilefuse.ConfigError`, ...; the modules that
first defined them, `tilefuse.api`, `tilefuse.config`, `tilefuse.ir.bounds`, still name
them). Errors a stage raises and handles itself (a lowering it does not support, a plan it
cannot repair) stay in that stage. This module imports nothing of tilefuse, so the foundation
(the config registry, `ir/`, the disk cache) can raise them too.
"""
from __future__ import annotations

__all__ = [
    "TilefuseError", "TilefuseFallbackWarning", "ConfigError", "ConfigWarning", "UnknownOptionError",
    "CheckError", "IndexCheckError", "OutOfRangeIndexError", "OutOfRangeRuntimeError", "DivisionByZeroError",
    "ProgramError", "CacheWarning",
]


# ------------------------------------------------------------------------------ compiling


class TilefuseError(RuntimeError):
    """A failure inside tilefuse, raised (with `TILEFUSE_FALLBACK=error`) with a message that
    names the stage, the op and a reproducer script."""


class TilefuseFallbackWarning(UserWarning):
    """A failure inside tilefuse with `TILEFUSE_FALLBACK=eager`: the graph runs eagerly."""


# ------------------------------------------------------------------------------ configuration


class ConfigError(ValueError):
    """A knob, option or mode given a value it does not take: the user's error, raised at once
    (never an eager fallback)."""


class ConfigWarning(UserWarning):
    """A knob's value that is valid but does not fit a kernel on its target (the stack of a C++
    program, a GPU's shared memory): the kernel was compiled with a smaller configuration."""


class UnknownOptionError(TypeError):
    """An option name tilefuse does not have."""


# ------------------------------------------------------------------------------ the program's own errors


class CheckError(Exception):
    """A generated kernel's check failed: the program's own error, as in eager PyTorch, not a
    tilefuse failure — it propagates to the caller unchanged."""


class IndexCheckError(CheckError):
    """An index outside its bound, found by a generated kernel's check (or the reference
    interpreter). It is the program's own error, as in eager PyTorch, not a tilefuse failure:
    it propagates to the caller unchanged. The subclasses are named after the class eager
    PyTorch raises for the op, and are instances of both `IndexError` and `RuntimeError`: the
    op a kernel sees may come from a decomposition (`nll_loss` reaches it as `gather`), and an
    `except` clause written for eager's class must still catch it."""


class OutOfRangeIndexError(IndexCheckError, IndexError, RuntimeError):
    pass


class OutOfRangeRuntimeError(IndexCheckError, RuntimeError, IndexError):
    pass


class DivisionByZeroError(CheckError, RuntimeError):
    """An integer division or remainder by zero on CPU tensors: a `RuntimeError` whose message
    is eager's, "ZeroDivisionError" (the kernel that found it is in the exception's notes)."""


class ProgramError(Exception):
    """Found while compiling: the graph does what eager PyTorch refuses when it runs (a scalar
    its tensor's type cannot hold, as in `uint8_tensor.masked_fill(m, 300)`). The graph then
    runs as written, so the caller gets eager's own error at the point eager raises it — not a
    tilefuse failure, and no fallback warning."""


# ------------------------------------------------------------------------------ the disk cache


class CacheWarning(UserWarning):
    """The disk cache could not be used (I/O error, insecure directory); compilation goes on
    without it."""
