"""Row tiles: one program's rows as several independent tiles that share each key tile.

A flash kernel's loop body is a chain: score product, row max, exponentials, row sum, output
product, each step waiting for the one before. On a Hopper GPU the tensor cores then idle while
the exponentials run, and the exponential units idle during the products; FlashAttention-3
overlaps the two with warp groups that take turns. Two independent chains in one loop body give
the compiler the same freedom: while one row tile's exponentials run, the other's product is in
flight (Triton issues Hopper's products asynchronously). On an H100 at head dim 128 this took a
hand-written forward from 493 to 560 TFLOP/s (`scripts/probe_flash_hopper.py`).

`jam_rows(kernel, copies)` is that transformation on tile IR, unroll-and-jam of the rows: the
program covers `copies`·BLOCK_M rows; every statement that depends on the rows (the row range
`rm`, and transitively whatever reads it or has a BLOCK_M-sized axis) is repeated once per row
tile, its values renamed, next to its other copies; whatever does not (key ranges, K and V tile
loads) is shared. The tiles keep their shapes; the grid's row axis shrinks by `copies`.

It applies to kernels whose rows enter only through the row range. Loop bounds may read the
program id and BLOCK_M when the caller computed them for the whole program (`program_bounds`: a
causal kernel visits the union of its row tiles' live keys, and evaluates no mask only on keys
unmasked for all of them); any other value that reads them (a block summary's entry) is refused,
with the reason.
"""
from __future__ import annotations

from dataclasses import replace

import sympy

from ..ir.expr import Expr, Index, Var, transform
from .common import tile_symbol
from .ir import (Arange, BroadcastTile, For, Full, TileKernel, expr_names, statements, stmt_exprs, with_exprs)


def jam_rows(kernel: TileKernel, copies: int, row: str = "rm", block: str = "BLOCK_M",
             program: str = "pid", program_bounds: bool = False) -> tuple[TileKernel | None, str]:
    """(`kernel` with each program's rows as `copies` row tiles, "") or (None, why not).
    `program_bounds`: the loops' bounds were computed for the program's rows, all its row tiles
    together (the union of their live keys), so they may read `program` and `block` and are
    kept as they are."""
    if copies <= 1:
        return kernel, ""
    found = [s for s in kernel.body if isinstance(s, Arange) and s.name == row]
    if len(found) != 1:
        return None, f"no single row range {row!r} at the kernel's top level"
    rows = found[0]
    pid, bm = tile_symbol(program), tile_symbol(block)
    if not isinstance(rows.start, Index) or sympy.expand(rows.start.expr - pid * bm) != 0:
        return None, f"its row range starts at {rows.start}, not {program}·{block}"
    for s in statements(kernel.body):
        if s is not rows and {program, block} & _reads(s) and not (program_bounds and _index_bounds(s)):
            return None, f"{type(s).__name__} {getattr(s, 'name', '')} reads {program} or {block} itself"
    dependent = _row_dependent(kernel.body, row, block)
    for s in statements(kernel.body):
        if isinstance(s, For) and _reads(s) & dependent:
            return None, f"the bounds of the loop over {s.var} depend on the rows"
    taken = {n for s in statements(kernel.body) for n in (_defined(s), *_reads(s)) if n}
    suffixes = [""] + [f"_r{c}" for c in range(1, copies)]
    if any(n + sfx in taken for n in dependent for sfx in suffixes[1:]):
        return None, "a renamed copy would take a name the kernel already uses"
    rows_axis = sympy.sympify(kernel.grid[0])
    if bm not in rows_axis.free_symbols:
        return None, f"its grid's first axis ({rows_axis}) does not count blocks of {block}"
    starts = [Index(pid * (copies * bm) + c * bm) for c in range(copies)]
    renames = [{n: n + sfx for n in dependent} if sfx else {} for sfx in suffixes]
    body = _jam(kernel.body, rows, dependent, renames, starts)
    grid = (rows_axis.xreplace({bm: copies * bm}), *kernel.grid[1:])
    return replace(kernel, body=body, grid=grid), ""


def _index_bounds(s) -> bool:
    """A loop whose bounds are index formulas alone (no value read from memory)."""
    return isinstance(s, For) and all(isinstance(e, Index) for e in (s.start, s.stop))


def _reads(s) -> set:
    names = set()
    for e in stmt_exprs(s):
        names |= expr_names(e)
    if getattr(s, "descriptor", None):  # (a descriptor load reads its descriptor by name)
        names.add(s.descriptor)
    return names


def _defined(s) -> str | None:
    """The value a statement defines or updates (a loop: its variable)."""
    if isinstance(s, For):
        return s.var
    return getattr(s, "name", None)


def _shaped_by(s, block: str) -> bool:
    return isinstance(s, (Full, BroadcastTile)) and block in s.shape


def _row_dependent(body: list, row: str, block: str) -> set:
    """The values that differ from one row tile to another: the row range, what reads any of
    them, what has a `block`-sized axis, and a loop-carried value any of whose updates does
    (to a fixed point: a carried value is read before its update)."""
    dependent = {row}
    changed = True
    while changed:
        changed = False
        for s in statements(body):
            name = _defined(s)
            if name is None or name in dependent or isinstance(s, For):
                continue
            if _reads(s) & dependent or _shaped_by(s, block):
                dependent.add(name)
                changed = True
    return dependent


def _renamed(s, mapping: dict):
    """`s` with the values of `mapping` renamed, as definitions and as reads (tile values and
    the index symbols of `Index` leaves alike)."""
    if not mapping:
        return s

    def rename(e: Expr) -> Expr:
        def fn(node):
            if isinstance(node, Var) and node.name in mapping:
                return Var(mapping[node.name], node.dtype)
            if isinstance(node, Index):
                subs = {x: tile_symbol(mapping[x.name]) for x in sympy.sympify(node.expr).free_symbols
                        if x.name in mapping}
                if subs:
                    return Index(sympy.sympify(node.expr).xreplace(subs), node.dtype)
            return None
        return transform(e, fn)

    out = with_exprs(s, rename)
    if getattr(out, "name", None) in mapping:
        out = replace(out, name=mapping[out.name])
    if getattr(out, "descriptor", None) in mapping:
        out = replace(out, descriptor=mapping[out.descriptor])
    return out


def _jam(stmts: list, rows: Arange, dependent: set, renames: list, starts: list) -> list:
    out = []
    for s in stmts:
        if isinstance(s, For):
            out.append(replace(s, body=_jam(s.body, rows, dependent, renames, starts)))
        elif s is rows:
            out.extend(_renamed(replace(s, start=start), mapping) for start, mapping in zip(starts, renames))
        elif _defined(s) in dependent or _reads(s) & dependent:
            out.extend(_renamed(s, mapping) for mapping in renames)
        else:
            out.append(s)
    return out


__all__ = ["jam_rows"]
