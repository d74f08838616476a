"""Launching a kernel with size variants (`tile.variants`): each call runs the variant that its
actual sizes choose.

The choice costs a product of a few ints and a bisection per launch (sympy only for an extent
that is not a product of symbols); everything else stays with each variant's own launcher.
"""
from __future__ import annotations

import math

import sympy

from ..ir import symbolic


class SizeDispatch:
    """`launch(buffers, env)` over a kernel's launcher and those of its alternatives."""

    def __init__(self, variants, launcher, alternatives: list):
        self.variants = variants
        self.launcher = launcher
        self.alternatives = alternatives
        self.value = _evaluator(variants.extent)

    def __tilefuse_reduce__(self):  # a stored graph rebuilds it (`runtime.artifact`)
        return self.variants, self.launcher, self.alternatives

    def __call__(self, buffers: dict, env: dict) -> None:
        k = self.variants.index(self.value(env))
        (self.launcher if k is None else self.alternatives[k])(buffers, env)

    def inline(self, buffers: dict, env: dict):
        """The variant these sizes choose, for the compiled graph's generated call."""
        k = self.variants.index(self.value(env))
        launch = self.launcher if k is None else self.alternatives[k]
        inline = getattr(launch, "inline", None)
        return inline(buffers, env) if inline is not None else None

    def wait(self) -> "SizeDispatch":
        """Wait for every variant's build (the compiler does before it returns the graph)."""
        for launch in (self.launcher, *self.alternatives):
            wait = getattr(launch, "wait", None)
            if wait is not None:
                wait()
        return self


def _evaluator(extent):
    """env -> the extent's value: a product of symbols read straight from the env."""
    coeff, factors = sympy.sympify(extent).as_coeff_mul()
    if coeff.is_Integer and all(f.is_Symbol for f in factors):
        c, names = int(coeff), tuple(f.name for f in factors)
        return lambda env: c * math.prod(env[n] for n in names)
    return lambda env: int(symbolic.evaluate(extent, env))


__all__ = ["SizeDispatch"]
