"""Lowerings from core ATen to graph IR, one module per op family. Importing this package
registers them all."""
from . import creation, indexing, matmul, nn, pointwise, reductions, views  # noqa: F401
from . import attention  # noqa: F401  (after the modules it builds on)
