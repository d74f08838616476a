"""Storage orders of strided tensors: the strides of a shape stored with its dims in a given
order, and the order read back off a tensor's strides. `fusion.layout` chooses orders; the
kernel families iterate in them."""
from __future__ import annotations

import sympy


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


__all__ = ["strides_for", "storage_order", "dense_order", "promised_strides"]
