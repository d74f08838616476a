"""The lowering registry: ATen op (overload or packet) → function building graph IR.

    @lowering(aten.add.Tensor, aten.add.Scalar)
    def add(ctx, a, b, alpha=1): ...

A lowering receives the `LoweringContext`, then the op's arguments with tensors replaced by
`TensorValue`s and SymInts by sympy expressions. It returns a `TensorValue` (or a tuple of
them), or raises `Unsupported(reason)` for an argument combination it does not handle; the
op then becomes an `Extern` call, visible in `tilefuse.explain`, never an error.
"""
from __future__ import annotations

from typing import Callable

LOWERINGS: dict = {}


class Unsupported(Exception):
    """Raised by a lowering that cannot handle this call; the op becomes an Extern."""


def lowering(*targets) -> Callable:
    def register(fn):
        for t in targets:
            LOWERINGS[t] = fn
            # An OpOverloadPacket registers all of its overloads.
            for name in getattr(t, "overloads", lambda: [])():
                LOWERINGS.setdefault(getattr(t, name), fn)
        return fn

    return register


def find_lowering(target):
    fn = LOWERINGS.get(target)
    if fn is None and hasattr(target, "overloadpacket"):
        fn = LOWERINGS.get(target.overloadpacket)
    return fn


def registered_ops() -> list[str]:
    return sorted({str(t) for t in LOWERINGS})
