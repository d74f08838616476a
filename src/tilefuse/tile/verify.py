"""Structural checks on tile IR: every value is defined before use, loop-carried updates
target values defined outside the loop, buffers are parameters, block sizes are powers of two.

The compiler runs `verify_tile_kernel` on every kernel it lowers; a failure names the kernel
and the statement, which is far easier to act on than a Triton compile error.
"""
from __future__ import annotations

import sympy

from .ir import (Arange, ArgReduceTile, Assign, BroadcastTile, DescriptorLoad, DotTile, For, Full, Let, LoadTile,
                 MakeDescriptor, ProgramId, ReduceTile, StoreTile, TileKernel, TransposeTile, expr_names, stmt_exprs)


class TileVerificationError(ValueError):
    pass


def verify_tile_kernel(k: TileKernel) -> TileKernel:
    params = {p.name for p in k.params}
    for name, value in k.constexprs.items():
        if name in k.exact_extents and value >= 1:
            continue
        # (GROUP_M, NUM_SMS and a reduction's RUN, `reduction_runs`, are counts, not tile extents)
        if name not in ("GROUP_M", "NUM_SMS", "RUN") and (value < 1 or value & (value - 1)):
            raise TileVerificationError(f"{k.name}: block size {name}={value} is not a power of two")
    defined = set(params) | set(k.constexprs)

    def check(stmts, scope: set, where: str) -> None:
        for s in stmts:
            exprs = stmt_exprs(s)
            if isinstance(s, (LoadTile, StoreTile, MakeDescriptor)) and s.buffer not in params:
                what = {LoadTile: "loads", StoreTile: "stores", MakeDescriptor: "describes"}[type(s)]
                raise TileVerificationError(f"{k.name}: {what} {s.buffer}, which is not a parameter")
            if isinstance(s, DescriptorLoad) and s.descriptor not in scope:
                raise TileVerificationError(f"{k.name}{where}: reads undefined descriptor {s.descriptor}")
            for e in exprs:
                missing = expr_names(e) - scope
                if missing:
                    raise TileVerificationError(f"{k.name}{where}: {type(s).__name__} uses undefined {sorted(missing)}")
            if isinstance(s, Assign) and s.name not in scope:
                raise TileVerificationError(f"{k.name}{where}: updates {s.name}, which is not defined before the loop")
            if isinstance(s, For):
                check(s.body, set(scope) | {s.var}, f" (loop over {s.var})")
            elif isinstance(s, (Let, Arange, BroadcastTile, LoadTile, ReduceTile, ArgReduceTile, Full, ProgramId,
                                MakeDescriptor, DescriptorLoad, TransposeTile)):
                scope.add(s.name)
            elif isinstance(s, DotTile):
                if s.name not in scope:
                    raise TileVerificationError(f"{k.name}{where}: dot accumulates into undefined {s.name}")

    check(k.body, defined, "")
    for g in k.grid:
        missing = {str(x) for x in sympy.sympify(g).free_symbols} - defined
        if missing:
            raise TileVerificationError(f"{k.name}: grid uses undefined {sorted(missing)}")
    return k
