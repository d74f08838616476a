"""Storage orders of strided tensors: the strides of a shape stored with its dims in a given
order, and the order read back off a tensor's strides. `fusion.layout` chooses orders; the
kernel families iterate in them. Also rows padded to 16 bytes (`fusion.row_padding` pads a
library product's output so; `runtime.aten_matmul` writes such rows)."""
from __future__ import annotations

import sympy

from .symbolic import contiguous_strides


def strides_for(shape, order) -> tuple:
    """Contiguous strides of `shape` stored in `order` (outermost dim first)."""
    strides = [sympy.Integer(0)] * len(shape)
    acc = sympy.Integer(1)
    for d in reversed(order):
        strides[d] = acc
        acc = acc * sympy.sympify(shape[d])
    return tuple(strides)


def storage_order(shape, strides) -> tuple | None:
    """The order of `shape`'s dims from outermost to innermost in memory, read off `strides`
    (dims of extent 1 stay beside their logical neighbour); None when the strides do not
    decide it (two dims with the same stride: a broadcast; a symbolic comparison sympy cannot
    settle)."""
    if strides is None or len(strides) != len(shape):
        return None
    unit = [d for d, n in enumerate(shape) if sympy.sympify(n) == 1]
    spread = [d for d in range(len(shape)) if d not in unit]
    strides = [sympy.sympify(st) for st in strides]
    if any(strides[d] == 0 for d in spread):
        return None  # an expanded dim: every order reads it the same
    order: list[int] = []
    for d in spread:  # insertion by decreasing stride: dims are few
        k = 0
        while k < len(order):
            bigger = sympy.Gt(strides[order[k]], strides[d])
            if bigger not in (sympy.true, sympy.false):
                return None
            if bigger is sympy.false:
                if sympy.Eq(strides[order[k]], strides[d]) is not sympy.false:
                    return None
                break
            k += 1
        order.insert(k, d)
    for d in unit:
        order.insert(order.index(d - 1) + 1 if d else 0, d)
    return tuple(order)


def dense_order(shape, strides) -> tuple | None:
    """`storage_order` when `strides` are exactly the contiguous strides of `shape` stored in
    that order (no padding, no gaps), else None."""
    order = storage_order(shape, strides)
    if order is None:
        return None
    dense = strides_for(shape, order)
    for n, st, want in zip(shape, strides, dense):
        if sympy.sympify(n) != 1 and sympy.expand(sympy.sympify(st) - want) != 0:
            return None
    return order


def promised_strides(node) -> tuple | None:
    """The strides an ATen call's result (`Extern`, `ExternResult`) is compiled against: the
    traced strides when they are plain integers (dims of extent 1 as 0, since any stride
    serves them), else None (read at run time). The runtime makes a result that comes back in
    another layout conform (`runtime.compiled`), as Inductor asserts its extern calls' strides."""
    strides = getattr(node, "strides", None)
    if strides is None or len(strides) != len(node.shape):
        return None
    if not all(isinstance(sympy.sympify(st), sympy.Integer) for st in strides):
        return None
    if not all(isinstance(sympy.sympify(n), sympy.Integer) for n in node.shape):
        return None
    return tuple(sympy.Integer(0) if sympy.sympify(n) == 1 else sympy.Integer(st)
                 for n, st in zip(node.shape, strides))


#: the alignment cuBLAS wants of every leading dimension, in bytes
ROW_ALIGNMENT = 16
#: rows shorter than this are not padded (the padding would be a large share of the buffer,
#: and such products are not where the library's kernel choice matters)
MIN_PADDED_ROW = 256


def padded_row(n, itemsize: int):
    """The row length (in elements) a row of `n` elements is padded to, or None when it
    needs no padding (aligned already, symbolic, or short)."""
    n = sympy.sympify(n)
    if not n.is_Integer or int(n) < MIN_PADDED_ROW or (int(n) * itemsize) % ROW_ALIGNMENT == 0:
        return None
    per = ROW_ALIGNMENT // itemsize if ROW_ALIGNMENT % itemsize == 0 else None
    if per is None:
        return None
    return -(-int(n) // per) * per


def row_padded_strides(shape, row) -> tuple:
    """Strides of `shape` stored row-major with its last dim in rows of `row` elements."""
    return tuple(contiguous_strides((*shape[:-1], row))[:-1]) + (sympy.Integer(1),)


def is_row_padded(shape, strides) -> bool:
    """`strides` store `shape` row-major, its rows possibly padded (contiguous is a case)."""
    if strides is None or len(strides) != len(shape) or not shape:
        return False
    if len(shape) == 1:
        return sympy.sympify(strides[0]) == 1 or sympy.sympify(shape[0]) == 1
    row = sympy.sympify(strides[-2])
    want = row_padded_strides(shape, row)
    return all(sympy.sympify(n) == 1 or sympy.expand(sympy.sympify(st) - w) == 0
               for n, st, w in zip(shape, strides, want)) and sympy.Ge(row, shape[-1]) is sympy.true


__all__ = ["strides_for", "storage_order", "dense_order", "promised_strides", "padded_row", "row_padded_strides",
           "is_row_padded", "ROW_ALIGNMENT", "MIN_PADDED_ROW"]
