"""The origin of the IR nodes one FX node lowers to: its ATen op and the user's source line.

The graphs AOTAutograd hands the backend (forward and backward alike) keep two pieces of
node metadata from tracing: `original_aten`, the ATen op the user's program called before the
core-ATen decompositions split it (`_softmax_backward_data` for the `mul`/`sum`/`sub` it
became), and `stack_trace`, the user frames Dynamo recorded (AOTAutograd traces under
`torch.fx.traceback.preserve_node_meta()`, so backward nodes carry their forward op's trace).
The op name prefers `original_aten`: it is the op the program wrote, and the shorter name.
"""
from __future__ import annotations

import functools
import os
import re

import torch.fx

from ..ir.identifiers import short_op_name
from ..ir.origin import NO_ORIGIN, Origin

#: one frame of a stack trace, its source line when the trace has one
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>[^\n]+)'
                    r'(?:\n(?!\s*File ")(?P<code>[^\n]*))?')
_TORCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(torch.fx.__file__)))
MAX_CODE = 60  # characters of the source line kept


def origin_of(node: torch.fx.Node) -> Origin:
    """The Origin of an FX call node (an empty one for other nodes)."""
    if node.op != "call_function":
        return NO_ORIGIN
    target = node.meta.get("original_aten") or node.target
    op = short_op_name(target)
    line = source_line(node.meta.get("stack_trace"))
    return Origin((op,) if op else (), (line,) if line else ())


@functools.lru_cache(maxsize=1024)  # the nodes of one line of code share its trace
def source_line(stack_trace: str | None) -> str | None:
    """`model.py:42 in forward: x = x * torch.rsqrt(...)` for the innermost frame of the user's
    code in a Dynamo stack trace (frames inside torch itself are skipped), else None."""
    if not stack_trace:
        return None
    frames = list(_FRAME.finditer(stack_trace))
    if not frames:
        return None
    user = [f for f in frames if not os.path.abspath(f["file"]).startswith(_TORCH_DIR + os.sep)]
    frame = (user or frames)[-1]
    code = (frame["code"] or "").strip()
    if len(code) > MAX_CODE:
        code = code[:MAX_CODE - 3] + "..."
    place = f"{os.path.basename(frame['file'])}:{frame['line']} in {frame['fn'].strip()}"
    return f"{place}: {code}" if code else place


def tag_new_nodes(graph, count_before: int, node: torch.fx.Node) -> None:
    """Record `node`'s origin on the IR nodes its lowering added (those after the first
    `count_before` of the graph: lowerings only ever add nodes)."""
    added = len(graph.nodes) - count_before
    if added <= 0:
        return
    origin = origin_of(node)
    if not origin:
        return
    names = reversed(graph.nodes)
    for _ in range(added):
        name = next(names)
        graph.origins[name] = graph.origins[name] | origin if name in graph.origins else origin
