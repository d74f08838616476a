"""tilefuse: a PyTorch compiler with semantic fusion.

    import tilefuse
    fast = torch.compile(model, backend="tilefuse")   # or tilefuse.compile(model)
    print(tilefuse.explain(fn, *inputs))

Importing the package registers the "tilefuse" torch.compile backend.
"""
from ._version import __version__
from .config import Options, config
from .errors import ConfigError, ConfigWarning, IndexCheckError, TilefuseError, UnknownOptionError
from .api import compile, dynamo_backend, explain, last_compilations
from .explanation import Explanation


def _register_backend() -> None:
    try:
        from torch._dynamo.backends.registry import _BACKENDS, register_backend
    except ImportError:  # pragma: no cover - very old torch
        return
    if "tilefuse" not in _BACKENDS or _BACKENDS.get("tilefuse") is None:
        register_backend(name="tilefuse")(dynamo_backend)


_register_backend()

__all__ = ["config", "compile", "explain", "last_compilations", "Explanation", "dynamo_backend", "TilefuseError",
           "IndexCheckError", "ConfigError", "ConfigWarning", "UnknownOptionError", "Options", "__version__"]
