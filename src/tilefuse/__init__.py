"""tilefuse: a PyTorch compiler with semantic fusion.

    import tilefuse
    fast = torch.compile(model, backend="tilefuse")   # or tilefuse.compile(model)
    print(tilefuse.explain(fn, *inputs))

Importing the package registers the "tilefuse" torch.compile backend.
"""
__version__ = "0.1.0"


def _prepare_triton_interpreter() -> None:
    """The Triton interpreter must be chosen before Triton is imported (its standard library
    is decorated at import time). Choose it when kernels will run on the CPU."""
    import os
    import sys

    if "triton" in sys.modules or "TRITON_INTERPRET" in os.environ:
        return
    backend = os.environ.get("TILEFUSE_BACKEND", "auto")
    if backend in ("interpret", "cpu"):  # cpu: for kernels the C++ printer hands to the interpreter
        os.environ["TRITON_INTERPRET"] = "1"
    elif backend == "auto":
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"


_prepare_triton_interpreter()

from .config import ConfigError, UnknownOptionError, config  # noqa: E402
from .api import TilefuseError, compile, dynamo_backend, explain, last_compilations  # noqa: E402
from .explanation import Explanation  # noqa: E402
from .ir.bounds import IndexCheckError  # noqa: E402


def _register_backend() -> None:
    try:
        from torch._dynamo.backends.registry import _BACKENDS, register_backend
    except ImportError:  # pragma: no cover - very old torch
        return
    if "tilefuse" not in _BACKENDS or _BACKENDS.get("tilefuse") is None:
        register_backend(name="tilefuse")(dynamo_backend)


_register_backend()

__all__ = ["config", "compile", "explain", "last_compilations", "Explanation", "dynamo_backend", "TilefuseError",
           "IndexCheckError", "ConfigError", "UnknownOptionError", "__version__"]
