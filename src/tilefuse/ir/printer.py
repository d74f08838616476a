"""Readable text for expressions and graphs (what `str(graph)` and `explain` show): defined
next to what they print, so that `str()` of an expression or a graph needs no other module."""
from .expr import format_expr
from .graph import format_graph, format_node, format_type

__all__ = ["format_expr", "format_graph", "format_node", "format_type"]
