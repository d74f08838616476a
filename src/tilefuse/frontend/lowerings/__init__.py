"""Lowerings from core ATen to graph IR, one module per op family. Importing this package
registers them all."""
from . import pointwise  # noqa: F401
