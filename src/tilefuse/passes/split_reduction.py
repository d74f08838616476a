"""Long reductions with few outputs, split into partial reductions and a short final one.
On a CPU the same, with its threads in place of SMs.

A training step's bias gradients sum a [tokens, features] gradient over its 8192 rows into
768–3072 values. One program per block of output columns leaves most of a GPU idle (3072
columns in blocks of 64 are 48 programs for 132 SMs), each walking 8192 rows alone. As
Inductor's split reductions and ATen's reduce kernels do, the reduction is split:

    out[x] = ⊕_{r < R} f(x, r)   →   part[s, x] = ⊕_{r < R/S} f(x, s·R/S + r)
                                     out[x]     = ⊕_{s < S} part[s, x]

with S chosen so that the partial kernel has enough programs, R/S whole. A reduction over
several axes (LayerNorm's weight gradient sums over batch and time) is split along their
flattened product, each axis recovered from the flat position. The partial results
keep the accumulation dtype (no rounding in between); the final reduction keeps the node's
name, dtype and its place for every reader and epilogue. Only sums, maxima and minima of
floats over static axes are split (associative, and what the reduction tiles carry);
contractions go to the product paths, and an axis of a few thousand or less stays whole.
"""
from __future__ import annotations

import sympy

from ..ir.expr import Binary, Index, Load, free_symbols, out_index, red_index, walk
from ..ir.graph import Graph, Reduce
from ..ir.monoid import MAX, MIN, SUM
from ..ir.rewrite import substitute_index
from ..ir.symbolic import unravel_sym

MIN_LENGTH = 4096  # shorter axes are walked by one program per output block
#: a CPU's: its threads start in microseconds, not a GPU's SMs in nanoseconds (a sum of 96 × 512
#: floats split in eight took 21 µs against 16 whole, one of 1024 × 1024 58 against 87)
CPU_MIN_LENGTH = 1 << 16
PROGRAMS_PER_SM = 4  # the partial kernel's target occupancy: S·⌈X/COLUMNS⌉ ≥ this × SMs
COLUMNS = 64  # the output block one program of the partial kernel covers (a coalesced row)
MIN_CHUNK = 256  # each partial reduction walks at least this many elements


def splits_for(outputs: int, length: int, sm_count: int, columns: bool = True) -> int:
    """S for a reduction of `length` into `outputs` values on `sm_count` SMs: the smallest
    power of two that gives the partial kernel PROGRAMS_PER_SM programs per SM, keeping
    chunks of at least MIN_CHUNK that divide `length`; 1 when no split helps. `columns`: the
    reduced axis is not the innermost one read (a program then covers COLUMNS outputs to
    read whole rows of memory; otherwise one output per program). Columns that are not a
    multiple of COLUMNS stay whole once they fill the SMs: the parts, flattened into one
    output axis, would start mid-block, and the partial kernel's reads along a row would no
    longer be provably contiguous to Triton (BERT's 30522-word bias gradient read at 0.3 TB/s
    split in two; whole, a column tile reads it at the bandwidth)."""
    if sm_count <= 0 or length < MIN_LENGTH:
        return 1
    programs = -(-outputs // COLUMNS) if columns else outputs
    if columns and outputs % COLUMNS and programs >= sm_count:
        return 1  # (a part's columns would start mid-block, its reads no longer provably coalesced)
    want = -(-PROGRAMS_PER_SM * sm_count // programs)
    s = 1
    while s < want and length % (2 * s) == 0 and length // (2 * s) >= MIN_CHUNK:
        s *= 2
    return s


def _candidate(node, graph: Graph) -> bool:
    """A float sum/max/min over static axes, not a product (the product paths' own), loading
    no other reduction directly and (the caller checks) read by none: a softmax's max and its
    sum re-based on it run in one pass, which split parts would turn into two passes."""
    if not (isinstance(node, Reduce) and node.ranges and node.combiner in (SUM, MAX, MIN)
            and node.body.dtype.is_float):
        return False
    loads = [e for e in walk(node.body) if isinstance(e, Load)]
    if _product_like(node):
        return False
    return not any(isinstance(graph.nodes.get(e.buffer), Reduce) for e in loads)


def _product_like(node) -> bool:
    """A sum of a product whose factors read different output coordinates (a matrix or
    matrix-vector product); an elementwise product summed (dy · x̂) is an ordinary sum."""
    if not (isinstance(node.body, Binary) and node.body.op == "mul"):
        return False
    outs = {s for s, n in zip(out_index(node.rank), node.shape) if n != 1}  # (a unit dim is no matrix dim)
    a, b = (free_symbols(f) & outs for f in (node.body.a, node.body.b))
    return a != b


def _along_columns(node) -> bool:
    """Whether no load walks a reduced axis in its innermost index (a bias gradient's sum
    over rows reads each row's features contiguously)."""
    reduced = set(red_index(len(node.ranges)))
    for e in walk(node.body):
        if isinstance(e, Load) and e.index and isinstance(e.index[-1], Index) \
                and reduced & sympy.sympify(e.index[-1].expr).free_symbols:
            return False
    return True


def split_reductions(graph: Graph, sm_count: int, columns: bool = True) -> Graph:
    """Split every long reduction with few outputs (see the module docstring) for a device of
    `sm_count` SMs; a CPU passes its threads (a loss summed to one value over 131072 elements
    ran on one of them, 2.3 times slower than Inductor on two) and `columns=False`: its column
    tile walks whole rows contiguously, where the parts, their outputs flattened, would divide
    each lane's position and gather (`x.sum(0)` over 4096 × 64: 5 times slower split), and
    only axes of CPU_MIN_LENGTH split."""
    rewritten: dict[str, list] = {}
    users = graph.users()
    for node in list(graph.nodes.values()):
        if not _candidate(node, graph) or any(isinstance(graph[u], Reduce) for u in users[node.name]):
            continue  # (a reduction another one reads — a softmax's max — stays in their shared pass)
        length = sympy.Mul(*(sympy.sympify(r) for r in node.ranges))
        outputs = sympy.Mul(*node.shape) if node.shape else sympy.Integer(1)
        if not (length.is_Integer and sympy.sympify(outputs).is_Integer):
            continue
        along_columns = _along_columns(node)
        if not columns and (along_columns or int(length) < CPU_MIN_LENGTH):
            continue
        s = splits_for(int(outputs), int(length), sm_count, along_columns)
        if s <= 1:
            continue
        chunk = int(length) // s
        outs, (r0,) = out_index(node.rank + 1), red_index(1)
        mapping = {old: Index(new) for old, new in zip(out_index(node.rank), outs[1:])}
        # (several reduced axes: each recovered from the position in their flattened product)
        flat = unravel_sym(outs[0] * chunk + r0, node.ranges)
        mapping.update((r, Index(e)) for r, e in zip(red_index(len(node.ranges)), flat))
        acc = node.body.dtype
        part = Reduce(graph.fresh_name(f"{node.name}_part"), acc, (sympy.Integer(s), *node.shape), ranges=(chunk,),
                      combiner=node.combiner, body=substitute_index(node.body, mapping))
        final = Reduce(node.name, node.dtype, node.shape, ranges=(sympy.Integer(s),), combiner=node.combiner,
                       body=Load(part.name, (Index(r0), *(Index(i) for i in out_index(node.rank))), acc))
        rewritten[node.name] = [part, final]
    graph.expand_nodes(rewritten)  # (both halves come from the node's ops)
    return graph


__all__ = ["split_reductions", "splits_for"]
