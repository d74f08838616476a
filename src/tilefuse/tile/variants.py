"""Size variants: one kernel plan tiled for several ranges of a symbolic extent.

A tile's shape is fixed when its kernel is compiled, so a kernel tiled for the worst case of a
symbolic extent pays for that case at every size (a reduction over 3 elements walking a
4096-wide tile). A `TileKernel` may carry `SizeVariants`: alternatives, each valid while the
extent is at most its bound (a row held whole in that many lanes), smallest bound first. The
kernel itself, valid at every size, serves the sizes beyond the last bound. The launch picks
from the actual sizes the first alternative whose bound holds (`index`), so a launch's work
follows the actual extent and the choice is correct at every size.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import sympy


@dataclass
class SizeVariants:
    extent: sympy.Expr  # over size symbols: the extent the choice depends on
    bounds: tuple  # increasing ints: kernels[k] serves extent <= bounds[k]
    kernels: tuple  # TileKernel per bound

    def index(self, value: int) -> int | None:
        """The alternative serving `extent == value`; None: the kernel that carries them."""
        k = bisect.bisect_left(self.bounds, value)
        return k if k < len(self.bounds) else None

    def chosen(self, kernel, env: dict):
        """The kernel that runs for the sizes in `env`: `kernel` or one of its alternatives."""
        from ..ir import symbolic

        k = self.index(int(symbolic.evaluate(self.extent, env)))
        return kernel if k is None else self.kernels[k]


def all_kernels(kernel) -> list:
    """A kernel and its size variants (what a backend prints and loads together)."""
    return [kernel, *(kernel.variants.kernels if kernel.variants is not None else ())]


__all__ = ["SizeVariants", "all_kernels"]
