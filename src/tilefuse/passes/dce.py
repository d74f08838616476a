"""Dead-code elimination: drop computed nodes that no output depends on."""
from __future__ import annotations

from ..ir.graph import Graph, Input, ScalarInput


def eliminate_dead_code(graph: Graph) -> Graph:
    live = set(graph.output_names())
    # an extern that binds a data-dependent scalar (`item()`) defines a symbol, not a buffer;
    # one that writes into an input (`copy_`, `index_put_`) has an effect, not a result
    live |= {n.name for n in graph.nodes.values()
             if getattr(n, "binds", None) is not None or getattr(n, "mutates", False)}
    for node in reversed(list(graph.nodes.values())):
        if node.name in live:
            live |= node.inputs()
    # an extern whose result is used only through ExternResult nodes stays live via them
    graph.nodes = {n: node for n, node in graph.nodes.items()
                   if n in live or isinstance(node, (Input, ScalarInput))}
    graph.origins = {n: o for n, o in graph.origins.items() if n in graph.nodes}
    return graph
