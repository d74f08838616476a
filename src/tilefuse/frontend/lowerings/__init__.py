"""Lowerings from core ATen to graph IR, one module per op family. Importing this package
registers them all."""
from . import (attention, creation, indexing, matmul, nn, pointwise, pooling, random, reductions,  # noqa: F401
               scatter_inplace, views)
