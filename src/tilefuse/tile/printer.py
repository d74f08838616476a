"""Readable text of tile IR (`TILEFUSE_LOGS=tile`, `explain`): defined next to the IR it
prints (`tile/ir.py`), so that `str()` of a kernel needs no other module."""
from .ir import format_tile_kernel

__all__ = ["format_tile_kernel"]
