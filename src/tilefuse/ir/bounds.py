"""Index bounds and divisors: the errors a generated kernel's checks raise (an out-of-range
data-dependent index, an integer division by zero), and the range analysis that proves an
index in range or a divisor non-zero so that its check can be dropped.

Lowerings of gathers wrap each index read from tensor data in a `CheckedIndex` (see
`ir.expr`). After inlining, `prune_checks` looks at the index expression with the consumer's
own index ranges: an index built from iota values (`arange`), clamped (`clamp(t, 0, n - 1)`),
taken modulo the size, or read from a narrow integer type that fits, is in range for every
element, and its check disappears. What remains becomes a check statement in the tile IR that
both backends print (a `tl.device_assert` in Triton, an error record in C++); the reference
interpreter checks the same bounds. An integer division or remainder by a divisor not proven
non-zero (`provably_nonzero`) gets a check in the tile IR on CPU tensors, where eager raises
`RuntimeError('ZeroDivisionError')`; eager CUDA does not raise (the quotient is garbage), and
neither do kernels for CUDA tensors.
"""
from __future__ import annotations

import math

import sympy

from ..errors import CheckError, DivisionByZeroError, IndexCheckError, OutOfRangeIndexError, OutOfRangeRuntimeError
from . import dtypes as dt
from .expr import Binary, Cast, CheckedIndex, Const, Expr, Index, Load, Unary, Where, binary, const, transform

_OO = sympy.oo


#: the `error` of a divisor's check, and eager's message
ZERO_DIVISION = "ZeroDivisionError"


def index_error(error: str, message: str) -> CheckError:
    """The exception for a failed check: `error` is the class eager raises ("IndexError" or
    "RuntimeError"), or `ZERO_DIVISION` for a divisor's check (`message` then starts with
    eager's message; the rest, the kernel, becomes a note)."""
    if error == ZERO_DIVISION:
        err = DivisionByZeroError(ZERO_DIVISION)
        detail = message[len(ZERO_DIVISION):].strip() if message.startswith(ZERO_DIVISION) else message
        if detail and hasattr(err, "add_note"):
            err.add_note(f"found by tilefuse's check of the divisor {detail}")
        return err
    return (OutOfRangeRuntimeError if error == "RuntimeError" else OutOfRangeIndexError)(message)


def check_message(c: CheckedIndex, size=None) -> str:
    """What a failed check says: the op, the dimension and the bound (`size`: its value at run
    time, or the size expression when not known)."""
    n = c.size if size is None else size
    allowed = f"[-{n}, {n})" if c.wrap else f"[0, {n})"
    return f"{c.op}: index out of range for dimension {c.dim} with size {n} (an index is outside {allowed})"


# ------------------------------------------------------------------------------ ranges


def _add(a, b):
    if (a == _OO and b == -_OO) or (a == -_OO and b == _OO):
        return None
    return a + b


def _scale(lo, hi, c):
    """c·[lo, hi] for a number c."""
    if c == 0:
        return sympy.Integer(0), sympy.Integer(0)
    x, y = lo * c, hi * c
    return (x, y) if c > 0 else (y, x)


def _nonneg(e) -> bool:
    e = sympy.expand(sympy.sympify(e))
    return bool(e.is_nonnegative) or (e.is_number and bool(e >= 0))


def _le(a, b) -> bool:
    """a <= b provably (sympy values, ±oo included)."""
    if a == -_OO or b == _OO:
        return True
    if a == _OO or b == -_OO:
        return False
    return _nonneg(b - a)


def index_range(expr, ranges: dict) -> tuple:
    """Inclusive (lo, hi) of an integer sympy expression, as sympy values (±oo when unknown);
    `ranges[sym] = extent` means 0 <= sym < extent. Size symbols are positive."""
    e = sympy.sympify(expr)
    if e.is_Integer:
        return e, e
    if e.is_Symbol:
        if e in ranges:
            return sympy.Integer(0), sympy.sympify(ranges[e]) - 1
        if e.is_positive:
            return sympy.Integer(1), _OO
        return (sympy.Integer(0), _OO) if e.is_nonnegative else (-_OO, _OO)
    if e.is_Add:
        lo = hi = sympy.Integer(0)
        for t in e.args:
            a, b = index_range(t, ranges)
            lo, hi = _add(lo, a), _add(hi, b)
            if lo is None or hi is None:
                return -_OO, _OO
        return lo, hi
    if e.is_Mul:
        coeff, rest = e.as_coeff_Mul()
        if coeff != 1 and coeff.is_Number:
            return _scale(*index_range(rest, ranges), coeff)
        lo, hi = sympy.Integer(1), sympy.Integer(1)
        for t in e.args:  # a product of non-negative factors
            a, b = index_range(t, ranges)
            if not (_le(0, a) and _le(0, lo)):
                return -_OO, _OO
            lo, hi = lo * a, (hi * b if _OO not in (hi, b) else _OO)
        return lo, hi
    if isinstance(e, sympy.floor):
        num, den = e.args[0].as_numer_denom()
        if den.is_Integer and int(den) > 0:
            a, b = index_range(num, ranges)
            return (a if a == -_OO else sympy.floor(a / den)), (b if b == _OO else sympy.floor(b / den))
    if isinstance(e, sympy.Mod):
        m = e.args[1]
        if m.is_positive:
            return sympy.Integer(0), m - 1
    if isinstance(e, (sympy.Min, sympy.Max)):
        parts = [index_range(a, ranges) for a in e.args]
        pick = sympy.Min if isinstance(e, sympy.Min) else sympy.Max
        return pick(*[p[0] for p in parts]), pick(*[p[1] for p in parts])
    return -_OO, _OO


_INT_RANGE = {"bool": (0, 1), "uint8": (0, 255), "int8": (-128, 127), "int16": (-2**15, 2**15 - 1),
              "int32": (-2**31, 2**31 - 1), "uint16": (0, 2**16 - 1), "uint32": (0, 2**32 - 1)}


def value_range(e: Expr, ranges: dict) -> tuple:
    """Inclusive (lo, hi) of an integer expression's values for every index in `ranges`
    (sympy values, ±oo when unknown)."""
    unknown = (-_OO, _OO)
    if isinstance(e, Const):
        if e.dtype.is_int or e.dtype.is_bool:
            v = sympy.Integer(int(e.value))
            return v, v
        return unknown
    if isinstance(e, Index):
        return index_range(e.expr, ranges) if e.dtype.is_int else unknown
    if isinstance(e, CheckedIndex):  # in range once checked (a failing check stops the program)
        return sympy.Integer(0), sympy.sympify(e.size) - 1
    if isinstance(e, Load):
        known = ranges.get((VALUES, e.buffer))  # (`stored_values`: an index an op produced)
        if known is not None:
            return known
        lo, hi = _INT_RANGE.get(e.dtype.name, (None, None))
        return (sympy.Integer(lo), sympy.Integer(hi)) if lo is not None else unknown
    if isinstance(e, Cast):
        if e.dtype.is_bool:
            return sympy.Integer(0), sympy.Integer(1)
        if e.dtype.is_int and e.x.dtype.is_float:  # truncation of a bounded float (interpolation's indices)
            f = _float_range(e.x, ranges)
            if f is None:
                return unknown
            lo, hi = sympy.Integer(math.trunc(f[0])), sympy.Integer(math.trunc(f[1]))
        elif not (e.dtype.is_int and (e.x.dtype.is_int or e.x.dtype.is_bool)):
            return unknown
        else:
            lo, hi = value_range(e.x, ranges)
        limits = _INT_RANGE.get(e.dtype.name)
        if limits is not None and not (_le(limits[0], lo) and _le(hi, limits[1])):
            return unknown  # a narrowing cast may wrap
        return lo, hi
    if isinstance(e, Where):
        (a, b), (c, d) = value_range(e.a, ranges), value_range(e.b, ranges)
        return sympy.Min(a, c), sympy.Max(b, d)
    if isinstance(e, Unary) and e.op == "neg":
        lo, hi = value_range(e.x, ranges)
        return -hi, -lo
    if isinstance(e, Unary) and e.op in ("floor", "ceil", "round", "trunc") and e.dtype.is_int:
        return value_range(e.x, ranges)
    if isinstance(e, Binary) and e.dtype.is_int:
        return _within_dtype(_binary_range(e, ranges), e.dtype)
    return unknown


#: the key `(VALUES, buffer)` of a ranges dict holds the inclusive range of that buffer's elements
VALUES = "values"

#: ATen ops whose result `item` holds indices along dim argument `dim_at` of their first argument
#: (`dim` when passed by name; -1 or None as the default): (item, position of dim, default dim)
_INDEX_RESULTS = {
    "topk": (1, 2, -1), "sort": (1, 1, -1), "kthvalue": (1, 2, -1), "mode": (1, 1, -1),
    "max": (1, 1, None), "min": (1, 1, None), "median": (1, 1, None), "nanmedian": (1, 1, None),
    "cummax": (1, 1, None), "cummin": (1, 1, None), "argsort": (0, 1, -1), "argmax": (0, 1, None),
    "argmin": (0, 1, None),
}


def stored_values(graph, name: str):
    """The inclusive (lo, hi) of an integer buffer's elements where the op that made it fixes
    them, else None: the indices of `topk`, `sort`, `max(dim)`, `argmax` and their kin lie in
    [0, n) for the dim they search (the whole tensor for `argmax` without a dim), and so do
    the indices of an arg-reduction the graph computes itself. A gather reading such an index
    needs no check."""
    from .graph import Extern, ExternResult, Reduce, TensorArg

    node = graph.nodes.get(name)
    if node is None or not node.dtype.is_int:
        return None
    if isinstance(node, Reduce):  # (over nothing, a compiled arg-reduction gives 0: not in [0, 0))
        if node.combiner.arg and _le(1, node.reduction_numel):
            return sympy.Integer(0), node.reduction_numel - 1
        return None
    item = 0
    if isinstance(node, ExternResult):
        item, node = node.item, graph.nodes.get(node.extern)
    if not isinstance(node, Extern):
        return None
    parts = node.target_name.split(".")
    op = parts[1] if len(parts) > 2 and parts[0] == "aten" else None
    spec = _INDEX_RESULTS.get(op)
    if spec is None or spec[0] != item or not node.args or not isinstance(node.args[0], TensorArg):
        return None
    if op in ("max", "min", "median", "nanmedian") and len(node.args) < 2 and "dim" not in node.kwargs:
        return None  # (the reduction to one value: no index)
    source = graph.nodes.get(node.args[0].name)
    if source is None:
        return None
    dim = node.kwargs.get("dim", node.args[spec[1]] if len(node.args) > spec[1] else spec[2])
    if isinstance(dim, sympy.Integer):
        dim = int(dim)
    if dim is None:
        n = sympy.Mul(*source.shape) if source.shape else sympy.Integer(1)
    elif isinstance(dim, int) and -max(source.rank, 1) <= dim < max(source.rank, 1):
        n = source.shape[dim] if source.rank else sympy.Integer(1)
    else:
        return None
    return sympy.Integer(0), sympy.sympify(n) - 1


def _within_dtype(r: tuple, dtype) -> tuple:
    """`r`, or unknown when the dtype cannot hold it all (the arithmetic may wrap)."""
    limits = _INT_RANGE.get(dtype.name)
    if limits is not None and not (_le(limits[0], r[0]) and _le(r[1], limits[1])):
        return -_OO, _OO
    return r


def _binary_range(e: Binary, ranges: dict) -> tuple:
    unknown = (-_OO, _OO)
    (a, b), (c, d) = value_range(e.a, ranges), value_range(e.b, ranges)
    if e.op == "add":
        lo, hi = _add(a, c), _add(b, d)
        return (lo, hi) if lo is not None and hi is not None else unknown
    if e.op == "sub":
        lo, hi = _add(a, -d), _add(b, -c)
        return (lo, hi) if lo is not None and hi is not None else unknown
    if e.op == "minimum":
        return sympy.Min(a, c), sympy.Min(b, d)
    if e.op == "maximum":
        return sympy.Max(a, c), sympy.Max(b, d)
    if e.op == "mod" and c == d and _le(1, c):  # Python remainder by a positive constant
        return sympy.Integer(0), c - 1
    if e.op == "mul" and c == d and c.is_Number:
        return _scale(a, b, c)
    return unknown


def provably_nonzero(e: Expr, ranges: dict) -> bool:
    """An integer divisor that is non-zero for every index in `ranges` (a constant, a size, an
    index shifted past 0, a value clamped away from 0, ...): its division needs no check."""
    lo, hi = value_range(e, ranges)
    return _le(1, lo) or _le(hi, -1)


def _float_range(e: Expr, ranges: dict):
    """(lo, hi) as finite Python floats bounding a float expression built from integer indices
    and constants (+, -, ×, ÷ by a constant, min, max, floor/ceil/trunc, where), widened at
    every step by more than its rounding error; None when unknown (loads, NaN-prone math)."""
    eps = 1e-2 if e.dtype.is_low_precision else 1e-6

    def widen(lo, hi):
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return None
        return lo - eps * (1 + abs(lo)), hi + eps * (1 + abs(hi))

    if isinstance(e, Const):
        return None if e.value == "nan" else widen(float(e.value), float(e.value))
    if isinstance(e, Cast) and (e.x.dtype.is_int or e.x.dtype.is_bool):
        lo, hi = value_range(e.x, ranges)
        if not (lo.is_Integer and hi.is_Integer and -2**24 <= lo and hi <= 2**24):
            return None
        return widen(float(lo), float(hi))
    if isinstance(e, Cast) and e.x.dtype.is_float:
        r = _float_range(e.x, ranges)
        return widen(*r) if r is not None else None
    if isinstance(e, Unary) and e.op in ("floor", "ceil", "trunc", "neg"):
        r = _float_range(e.x, ranges)
        if r is None:
            return None
        fn = {"floor": math.floor, "ceil": math.ceil, "trunc": math.trunc, "neg": lambda v: -v}[e.op]
        a, b = fn(r[0]), fn(r[1])
        return widen(min(a, b), max(a, b))
    if isinstance(e, Where):
        a, b = _float_range(e.a, ranges), _float_range(e.b, ranges)
        return widen(min(a[0], b[0]), max(a[1], b[1])) if a is not None and b is not None else None
    if isinstance(e, Binary) and e.op in ("add", "sub", "mul", "truediv", "minimum", "maximum"):
        a, b = _float_range(e.a, ranges), _float_range(e.b, ranges)
        if a is None or b is None:
            return None
        if e.op == "add":
            return widen(a[0] + b[0], a[1] + b[1])
        if e.op == "sub":
            return widen(a[0] - b[1], a[1] - b[0])
        if e.op == "minimum":
            return widen(min(a[0], b[0]), min(a[1], b[1]))
        if e.op == "maximum":
            return widen(max(a[0], b[0]), max(a[1], b[1]))
        if e.op == "truediv":
            if b[0] <= 0 <= b[1]:
                return None
            b = (1 / b[1], 1 / b[0])
        corners = [x * y for x in a for y in b]
        return widen(min(corners), max(corners))
    return None


def provably_in_range(c: CheckedIndex, ranges: dict) -> tuple[bool, bool]:
    """(in range without wrapping, in range after wrapping) for every index in `ranges`."""
    lo, hi = value_range(c.x, ranges)
    n = sympy.sympify(c.size)
    below = _le(hi, n - 1)
    return below and _le(0, lo), below and c.wrap and _le(-n, lo)


def unchecked(c: CheckedIndex) -> Expr:
    """The index without its check (wrapped where negative, when the op wraps)."""
    if not c.wrap:
        return c.x
    n = Index(sympy.sympify(c.size))
    return Where(Binary("lt", c.x, const(0), dt.bool_), binary("add", c.x, n), c.x, dt.int64)


def prune_checks(e: Expr, ranges: dict) -> Expr:
    """`e` with the checks of indices that are in range for every index in `ranges` removed."""

    def fn(node):
        if isinstance(node, CheckedIndex):
            plain, wrapped = provably_in_range(node, ranges)
            if plain:
                return node.x
            if wrapped:
                return unchecked(node)
        return None

    return transform(e, fn)


def has_checks(e: Expr) -> bool:
    from .expr import walk

    return any(isinstance(n, CheckedIndex) for n in walk(e))


__all__ = ["CheckError", "IndexCheckError", "OutOfRangeIndexError", "OutOfRangeRuntimeError", "DivisionByZeroError",
           "ZERO_DIVISION", "index_error", "check_message", "index_range", "value_range", "provably_in_range",
           "stored_values", "VALUES",
           "provably_nonzero", "prune_checks", "unchecked", "has_checks"]
