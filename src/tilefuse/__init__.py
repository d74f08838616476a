"""tilefuse: a PyTorch compiler with semantic fusion.

    import tilefuse
    fast = torch.compile(model, backend="tilefuse")   # or tilefuse.compile(model)
    print(tilefuse.explain(fn, *inputs))

Importing the package registers the "tilefuse" torch.compile backend.
"""
__version__ = "0.1.0"


from .config import config  # noqa: E402
from .api import TilefuseError, compile, dynamo_backend, explain  # noqa: E402
from .ir.bounds import IndexCheckError  # noqa: E402


def _register_backend() -> None:
    try:
        from torch._dynamo.backends.registry import _BACKENDS, register_backend
    except ImportError:  # pragma: no cover - very old torch
        return
    if "tilefuse" not in _BACKENDS or _BACKENDS.get("tilefuse") is None:
        register_backend(name="tilefuse")(dynamo_backend)


_register_backend()

__all__ = ["config", "compile", "explain", "dynamo_backend", "TilefuseError", "IndexCheckError", "__version__"]
