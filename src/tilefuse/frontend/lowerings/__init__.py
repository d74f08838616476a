"""Lowerings from core ATen to graph IR, one module per op family. Importing this package
registers them all."""
from . import attention, creation, indexing, matmul, nn, pointwise, random, reductions, scatter_inplace, views  # noqa: F401
