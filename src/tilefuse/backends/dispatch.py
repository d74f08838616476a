"""One handler per node type, for the printers of both backends.

A printer declares a table `{node class: handler}`; `handler(table, node, error)` finds the
handler of the node's class (or of the nearest base class that has one) and otherwise raises
`error(...)` naming the type, so an IR node a printer does not know fails clearly instead of
falling through a chain of `isinstance` tests.
"""
from __future__ import annotations

from typing import Callable


def handler(table: dict, node, error: Callable[[str], Exception], what: str = "cannot print {}") -> Callable:
    """The handler in `table` for `node`'s type; `error(what.format(type name))` if none."""
    for cls in type(node).__mro__:
        h = table.get(cls)
        if h is not None:
            return h
    raise error(what.format(type(node).__name__))
