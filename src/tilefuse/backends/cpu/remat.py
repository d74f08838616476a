"""Recomputing cheap tile values where they are read, instead of keeping them in arrays.

A value defined in one loop nest and read by a later nest of the same block is, by default,
stored to an array of the tile's shape and loaded back. When the value is cheap — a load of
a buffer the kernel never writes, a constant, or at most `MAX_OPS` plain arithmetic
operations over such values, scalars and arrays that stay as they are — the later nest
recomputes it instead (as Inductor's C++ backend re-reads a softmax row instead of copying
it). The row copy of a normalisation (`ld = x[row]` kept for the second walk) or the scaled
scores of a flash kernel (`s * c`, read once by the exponential) then never touch memory; a
value no nest reads any more is not computed at all.

Only values that cannot change between the two nests qualify: no loop-carried state
(`Assign` targets), no buffer this kernel stores to, and the reader in the same statement
list (not inside a deeper loop, where the recomputation would repeat every iteration).
"""
from __future__ import annotations

from ...ir.expr import Binary, Cast, Const, Expr, Index, Unary, Var, Where
from ...tile.ir import Assign, BroadcastTile, Full, Let, LoadTile, StoreTile, expr_names, statements
from .shapes import reads, written as stmt_written  # (`written` is a local name below)

MAX_OPS = 2
#: unary ops cheap enough to recompute (one vector instruction or none)
_CHEAP_UNARY = {"neg", "abs"}
_CHEAP_BINARY = {"add", "sub", "mul", "maximum", "minimum", "lt", "le", "gt", "ge", "eq", "ne", "logical_and", "logical_or"}


def _ops(e: Expr) -> int | None:
    """Arithmetic operations of an expression, or None if it is not cheap."""
    if isinstance(e, (Var, Const, Index)):
        return 0
    if isinstance(e, Cast):
        n = _ops(e.x)
        return None if n is None or not (e.dtype.is_float and e.x.dtype.is_float) else n
    if isinstance(e, Unary):
        n = _ops(e.x)
        return None if n is None or e.op not in _CHEAP_UNARY else n + 1
    if isinstance(e, Binary):
        a, b = _ops(e.a), _ops(e.b)
        return None if a is None or b is None or e.op not in _CHEAP_BINARY else a + b + 1
    if isinstance(e, Where):
        parts = [_ops(e.cond), _ops(e.a), _ops(e.b)]
        return None if None in parts else sum(parts) + 1
    return None


def plan_remat(kernel, items, sh, group_type) -> dict:
    """{id(group): [statements to recompute at the top of its loop body, in order]} for the
    plan `items` (groups, single statements, ("for", stmt, body items))."""
    assigned = {s.name for s in statements(kernel.body) if isinstance(s, Assign)}
    stored = {s.buffer for s in statements(kernel.body) if isinstance(s, StoreTile)}
    out: dict = {}

    def walk(items):
        cand: dict = {}  # name -> (statement, ops including recomputed operands, every name it needs)

        def kill(written: set) -> None:
            for name in [n for n, (_, _, deps) in cand.items() if n in written or deps & written]:
                del cand[name]

        for it in items:
            if isinstance(it, tuple):
                walk(it[2])
                kill(stmt_written(it[1]))
                continue
            if not isinstance(it, group_type):
                kill(stmt_written(it))
                continue
            written = set()
            for s in it.stmts:
                written |= stmt_written(s)
            chosen: list = []
            for s in it.stmts:
                for name in sorted(reads(s)):
                    if name in cand and name not in written and sh.shape.get(name) == it.shape \
                            and not (cand[name][2] & written):
                        _take(name, cand, chosen)
            if chosen:
                out[id(it)] = chosen
            kill(written)
            for s in it.stmts:  # this nest's cheap definitions: candidates for later nests
                c = _candidate(s, it, cand, assigned, stored, sh)
                if c is not None:
                    cand[s.name] = c

    walk(items)
    return out


def _exprs(s) -> list:
    if isinstance(s, LoadTile):
        return [s.offset] + ([s.mask] if s.mask is not None else [])
    if isinstance(s, Full):
        return []
    return [s.value]


def _candidate(s, group, cand, assigned, stored, sh):
    if not isinstance(s, (Let, LoadTile, Full, BroadcastTile)) or s.name in assigned:
        return None
    if sh.shape.get(s.name) != group.shape or s.name in group.reduced:
        return None
    if isinstance(s, LoadTile):
        if s.buffer in stored:
            return None
        ops = 0
    elif isinstance(s, Full):
        ops = 0
    else:
        ops = _ops(s.value)
        if ops is None:
            return None
    deps = set()
    for e in _exprs(s):
        for name in expr_names(e):
            if name in assigned:
                return None
            deps.add(name)
            if name in cand:
                ops += cand[name][1]
                deps |= cand[name][2]
            elif name in group.defined:  # a value of this nest that may not outlive it
                return None
    if ops > MAX_OPS:
        return None
    return (s, ops, deps)


def _take(name, cand, chosen) -> None:
    s = cand[name][0]
    if any(c is s for c in chosen):
        return
    for e in _exprs(s):
        for dep in sorted(expr_names(e)):
            if dep in cand:
                _take(dep, cand, chosen)
    chosen.append(s)
