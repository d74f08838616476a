"""Attention-shaped fusion: contraction → dependent reductions → contraction, in one kernel.

The planner first builds, for `softmax(q @ kᵀ · s) @ v`, three kernels: the score contraction
S, the row reductions over the key axis (max, normaliser — already one pass thanks to the
rolling update), and the output contraction O whose operand reads the normalised scores. This
pass merges them when

* O's reduction axis is the reduction kernel's axis (the key position),
* S, the reductions and the normalised scores are read by nothing but each other and O,
* S's own contraction axis and O's output axis held whole in a tile are static and small,
* O's sum over the key axis has a rolling update over the reductions its operand reads
  (derived by `fusion.repair`, e.g. `h = t·exp(m − m')·l/l'`).

The merged plan has kind "flash": a loop over key tiles computing the S tile with a `dot`,
carrying the reductions and the O accumulator (a second `dot`) with their repairs. Nothing
here is specific to softmax: any score → row-reductions → weighted-sum chain whose repairs
derive is merged; anything else keeps its three kernels.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import sympy

from ..ir.expr import Expr, Index, Load, free_symbols, out_index, red_index, transform, walk
from ..ir.graph import Graph
from ..ir.monoid import SUM
from ..ir.rewrite import substitute_index
from .masking import mask_facts
from .plan import KernelPlan, PlanKind, Stage, StageKind
from .repair import NoRepair, derive_rolling_update
from .schedule import schedule_passes

MAX_HELD = 256  # largest head dimension held whole in a tile


def _static(e) -> int | None:
    e = sympy.sympify(e)
    return int(e) if e.is_Integer else None


def _inline(expr: Expr, graph: Graph, bodies: dict) -> Expr:
    """Substitute the bodies of `bodies` (node -> body over its own indices) into `expr`."""
    def fn(e):
        if isinstance(e, Load) and e.buffer in bodies:
            node = graph[e.buffer]
            return substitute_index(bodies[e.buffer], dict(zip(out_index(node.rank), e.index)))
        return None

    return transform(expr, fn)


def _loads_of(expr: Expr, name: str) -> set:
    return {e.index for e in walk(expr) if isinstance(e, Load) and e.buffer == name}


def fuse_flash(steps: list, graph: Graph, outputs: set, note) -> list:
    """Merge score/reduction/output kernel triples into flash kernels; returns new steps."""
    kernels = [s for s in steps if isinstance(s, KernelPlan)]
    by_node = {st.node: k for k in kernels for st in k.stages}
    loads: dict = {}  # id(a stage's body) -> (the body, the buffers it loads): `_readers` walks each once
    for out_k in kernels:
        if out_k.kind != PlanKind.CONTRACTION:
            continue
        merged = _try_merge(out_k, by_node, graph, outputs, steps, note, loads)
        if merged is None:
            continue
        score_k, red_k, flash = merged
        steps = [flash if s is out_k else s for s in steps if s is not score_k and s is not red_k]
        by_node = {st.node: k for k in steps if isinstance(k, KernelPlan) for st in k.stages}
    return steps


def _readers(steps: list, graph: Graph, loads: dict | None = None) -> dict:
    """{buffer: the nodes that read it}. `loads` memoises each stage body's loads (every layer's
    merge asks again, over steps that are mostly unchanged); it holds each body, so no id in it
    is reused while it lives."""
    readers: dict = {}
    loads = {} if loads is None else loads
    for k in steps:
        if isinstance(k, KernelPlan):
            for st in k.stages:
                found = loads.get(id(st.body))
                if found is None:
                    found = loads[id(st.body)] = (st.body, {e.buffer for e in walk(st.body) if isinstance(e, Load)})
                for name in found[1]:
                    readers.setdefault(name, set()).add(st.node)
        else:
            for name in graph[k.node].inputs():
                readers.setdefault(name, set()).add(k.node)
    return readers


def _try_merge(out_k: KernelPlan, by_node: dict, graph: Graph, outputs: set, steps: list, note, loads=None):
    o_stage = out_k.stages[0]
    o_node = graph[o_stage.node]
    con = out_k.contraction
    key_extent = o_node.ranges[0]
    # the operand reading a full-row output of a reduction kernel over the same axis
    for side in ("a", "b"):
        factor = getattr(con, side)
        for f_name in {e.buffer for e in walk(factor) if isinstance(e, Load)}:
            red_k = by_node.get(f_name)
            if red_k is None or red_k.kind != PlanKind.REDUCTION or red_k.reduction != (key_extent,):
                continue
            if red_k.stage(f_name).kind != StageKind.FULL:
                continue
            merged = _check(out_k, red_k, f_name, side, by_node, graph, outputs, steps, note, loads)
            if merged is not None:
                return merged
    return None


def _check(out_k, red_k, f_name, side, by_node, graph, outputs, steps, note, loads=None):
    con = out_k.contraction
    o_node = graph[out_k.stages[0].node]
    reduces = [s for s in red_k.stages if s.kind == StageKind.REDUCE]
    others = [s for s in red_k.stages if s.kind != StageKind.REDUCE and s.node != f_name]
    names = {s.node for s in reduces}
    if any(s.kind != StageKind.ROW or not _reads_only(s.body, names) for s in others):
        return None  # (row statistics of the reductions alone — a logsumexp — are kept: `_row_stats`)
    # one loop carries every reduction: each must run in the first pass, reading earlier
    # reductions only through a rolling update
    level, repaired = schedule_passes(red_k, use_repairs=True)
    for st in reduces:
        reads_reduce = any(_loads_of(st.body, o.node) for o in reduces if o is not st)
        if level[st.node] != 0 or (reads_reduce and st.node not in repaired):
            note(f"{out_k.stages[0].node}: no attention fusion: {st.node} needs a finished reduction")
            return None
    reads = {e.buffer for st in red_k.stages for e in walk(st.body) if isinstance(e, Load)}
    score_names = [n for n in reads if n in by_node and by_node[n].kind == PlanKind.CONTRACTION
                   and len(by_node[n].stages) == 1]
    if len(score_names) != 1:
        return None
    s_name = score_names[0]
    score_k = by_node[s_name]
    readers = _readers(steps, graph, loads)
    internal = {st.node for st in red_k.stages} | {s_name, out_k.stages[0].node}
    # may read the finished reductions (`(e @ v) / e.sum(-1)`), as may the row statistics (`others`)
    epilogue = {st.node for st in out_k.stages[1:]}
    later = _read_after(steps, out_k, graph)
    stored = []  # reductions read outside the chain (a training forward saves the row max)
    for name in [s_name, f_name] + [s.node for s in reduces]:
        allowed = internal | epilogue if name not in (s_name, f_name) else internal
        if name in outputs or not readers.get(name, set()) <= allowed:
            if name not in (s_name, f_name) and readers.get(name, set()) - allowed <= later:
                stored.append(name)  # stored once per row by the flash kernel, after its loop
                continue
            note(f"{out_k.stages[0].node}: no attention fusion: {name} is needed outside the chain")
            return None
    held_n = o_node.shape[con.n_dim if side == "a" else con.m_dim]
    s_node = graph[s_name]
    if _static(held_n) is None or _static(held_n) > MAX_HELD or _static(s_node.ranges[0]) is None \
            or _static(s_node.ranges[0]) > MAX_HELD:
        note(f"{out_k.stages[0].node}: no attention fusion: head dimensions must be static and at most {MAX_HELD}")
        return None
    if side != "a":
        return None  # the weights must be the left operand (P @ V); V @ Pᵀ is left alone
    # the output's term with the normalised scores inlined: it must have a rolling update
    f_body = red_k.stage(f_name).body
    term = _inline(out_k.stages[0].body, graph, {f_name: f_body})
    producers = tuple(s.node for s in reduces if _loads_of(term, s.node))
    if not producers:
        return None
    info = _coordinates(graph, out_k, score_k, reduces, term, f_name, f_body, s_name)
    if isinstance(info, str):
        note(f"{out_k.stages[0].node}: no attention fusion: {info}")
        return None
    values = _inline(info.b, graph, {f_name: f_body})
    if any(_loads_of(values, name) for name in [s_name, f_name] + [s.node for s in reduces + others]):
        # (`softmax(s) @ s` with `s = a @ b`, `p @ p`: the kernel holds score tiles by query
        # row, the values are read by key row; the scores go to memory instead)
        note(f"{out_k.stages[0].node}: no attention fusion: the values read the scores")
        return None
    if not _epilogue_reads_own_rows(graph, out_k, info, reduces, term):
        note(f"{out_k.stages[0].node}: no attention fusion: the epilogue reads a reduction at another row")
        return None
    if any(not readers.get(st.node, set()) <= later | internal for st in others):
        note(f"{out_k.stages[0].node}: no attention fusion: a statistic of the rows is read before the output")
        return None
    stats = _row_stats(graph, others, reduces, term, o_node, stored)
    if stats is None:
        note(f"{out_k.stages[0].node}: no attention fusion: a statistic of the rows reads a reduction at another row")
        return None
    deferred = _defer(info, term, producers, o_node, con)
    extra = []
    if deferred is not None:
        info, repair = deferred
        extra.append(f"{out_k.stages[0].node}: factor {info.post} taken out of the sum: applied once after the loop"
                     + (f"; rows where {', '.join(str(g) for g in info.guards)} give 0" if info.guards else ""))
        note(extra[-1])
    else:
        try:
            repair = derive_rolling_update(term, SUM, producers)
        except NoRepair as why:
            note(f"{out_k.stages[0].node}: no attention fusion: {why}")
            return None
    flash = KernelPlan(name=out_k.name, kind=PlanKind.FLASH, parallel=out_k.parallel, reduction=(o_node.ranges[0],))
    flash.contraction = con
    masked, skippable = mask_facts({s.node: info.reduce_bodies[s.node] for s in reduces}, info.a, graph)
    flash.flash = info = replace(info, masked=masked, skippable=skippable,
                                 row_stats={name: index for name, (_, index) in stats.items()})
    flash.stages.append(Stage(s_name, StageKind.SCORE, score_k.stages[0].body, store=False))
    flash.stages.extend(Stage(s.node, StageKind.REDUCE, info.reduce_bodies[s.node], level=0, store=s.node in stored,
                              repair=s.repair) for s in reduces)
    flash.stages.append(Stage(out_k.stages[0].node, StageKind.CONTRACTION, term, store=out_k.stages[0].store,
                              repair=repair))
    flash.stages.extend(out_k.stages[1:])
    flash.stages.extend(Stage(name, StageKind.ROW, body) for name, (body, _) in stats.items() if name not in stored)
    fused = (f"{out_k.stages[0].node}: attention fusion of the scores {s_name}, their reductions "
             f"{', '.join(s.node for s in reduces)} and the output product (the scores never reach memory)")
    repaired = f"{out_k.stages[0].node}: {repair.describe()}"
    flash.notes = score_k.notes + red_k.notes + out_k.notes + [fused, repaired] + extra
    note(fused)
    note(repaired)
    return score_k, red_k, flash


K0 = sympy.Symbol("k0", integer=True, nonnegative=True)  # the score contraction's own axis


@dataclass
class FlashInfo:
    """Every member re-expressed in the output contraction's coordinates (its index symbols
    i0.. and its reduction symbol r0, the key position)."""

    q: Expr  # score factor read along (query rows, k0)
    k: Expr  # score factor read along (k0, key positions)
    score_extent: object  # extent of k0
    a: Expr  # output operand over (query rows, key positions): the weights, inlined
    b: Expr  # output operand over (key positions, held dim): the values
    reduce_bodies: dict  # reduction node -> body in output coordinates
    post: Expr | None = None  # row factor applied after the loop (deferred normalisation)
    guards: tuple = ()  # row conditions under which the output is 0 (PyTorch's masked-row rule)
    #: the score expression the running max reduces, -inf where the program masks (None: no max),
    #: and whether key tiles masked throughout may be skipped (`fusion.masking.mask_facts`)
    masked: Expr | None = None
    skippable: bool = False
    #: values stored once per query row after the loop: outputs computed from the finished
    #: reductions alone (a logsumexp; their stages, of kind `row`, hold the bodies in these
    #: coordinates) and reductions read outside the chain (a training forward's saved max;
    #: their `reduce` stages are stored): name -> its index in these coordinates
    row_stats: dict = field(default_factory=dict)
    #: products whose weights are recomputed from score products (`fusion.recompute`): each
    #: score as (name, row factor, key factor, extent of k0); empty for attention plans, whose
    #: one score is (`q`, `k`, `score_extent`)
    scores: tuple = ()
    #: further products of a recomputing plan over the same score tiles (`fusion.recompute.
    #: merge_siblings`): each accumulated beside the plan's own, in the same coordinates
    siblings: tuple = ()


@dataclass(frozen=True)
class Sibling:
    """A second product of a flash plan: its node, weights and values in the plan's
    coordinates, the node's index in them (its own output dims may be ordered otherwise: dKᵀ
    beside dV), and its epilogue stages (computed at that index)."""

    node: str
    a: Expr
    b: Expr
    index: tuple = ()
    epilogues: tuple = ()


def _coordinates(graph, out_k, score_k, reduces, term, f_name, f_body, s_name):
    con = out_k.contraction
    o_node = graph[out_k.stages[0].node]
    (r0,) = red_index(1)
    outs = out_index(o_node.rank)
    n_sym = outs[con.n_dim]
    a_inl = _inline(con.a, graph, {f_name: f_body})
    s_loads = _loads_of(a_inl, s_name)
    if len(s_loads) != 1:
        return "the weights read the scores at several positions"
    (s_idx,) = s_loads
    if any(not isinstance(c, Index) for c in s_idx):
        return "the scores are read through a gather"
    s_node = graph[s_name]
    key_dims = [d for d, c in enumerate(s_idx) if r0 in c.expr.free_symbols]
    if len(key_dims) != 1 or s_idx[key_dims[0]].expr != r0:
        return "the key position does not index the scores directly"
    if any(n_sym in c.expr.free_symbols for c in s_idx):
        return "the scores depend on the held output dimension"
    bodies = {}
    read = {st.node: _loads_of(term, st.node) for st in reduces}
    template = next((st.node for st in reduces if len(read[st.node]) == 1), None)
    for st in reduces:
        loads = read[st.node]
        if not loads and template is not None:  # read after the loop only (`(e @ v) / e.sum(-1)`)
            loads = _same_row(graph, template, next(iter(read[template])), st.node)
        if len(loads) != 1:
            return f"{st.node} is read at several positions"
        (idx,) = loads
        if any(not isinstance(c, Index) or (c.expr.free_symbols & {r0, n_sym}) for c in idx):
            return f"{st.node} is not read once per query row"
        node = graph[st.node]
        mapping = dict(zip(out_index(node.rank), idx))
        mapping[red_index(1)[0]] = Index(r0)
        body = substitute_index(st.body, mapping)
        if not _loads_of(body, s_name) <= {s_idx}:
            return f"{st.node} reads the scores at other positions than the weights do"
        bodies[st.node] = body
    sc = score_k.contraction
    if sc is None or len(s_node.ranges) != 1:
        return "the scores are not a plain contraction"
    key_sym = out_index(s_node.rank)[key_dims[0]]
    s_map = dict(zip(out_index(s_node.rank), s_idx))
    s_map[red_index(1)[0]] = Index(K0)
    fa, fb = substitute_index(sc.a, s_map), substitute_index(sc.b, s_map)
    a_reads_key = key_sym in free_symbols(sc.a)
    q, k = (fb, fa) if a_reads_key else (fa, fb)
    return FlashInfo(q=q, k=k, score_extent=s_node.ranges[0], a=a_inl, b=con.b, reduce_bodies=bodies)


def _reads_only(body: Expr, names: set) -> bool:
    return all(e.buffer in names for e in walk(body) if isinstance(e, Load))


def _read_after(steps: list, out_k, graph) -> set:
    """The nodes of the steps after `out_k` (where the flash kernel will run)."""
    after = steps[next(i for i, s in enumerate(steps) if s is out_k) + 1:]
    found = set()
    for s in after:
        if isinstance(s, KernelPlan):
            found |= {st.node for st in s.stages}
        else:
            found.add(s.node)
    return found


def _row_stats(graph, stages, reduces, term, o_node, stored=()) -> dict | None:
    """{name: (body, index)} of row statistics — outputs that read nothing but the finished
    reductions, each at its own row (`where(m == -inf, 0, m + log(l))`), and the reductions
    `stored` themselves (body None) — in the output contraction's coordinates; None when one
    reads a reduction at another row."""
    names = {st.node for st in reduces}
    template = next((n for n in names if len(_loads_of(term, n)) == 1), None)
    stats = {}
    for name in stored:
        at = _same_row(graph, template, next(iter(_loads_of(term, template))), name) if template else set()
        if len(at) != 1:
            return None
        stats[name] = (None, next(iter(at)))
    for st in stages:
        if template is None:
            return None
        (t_idx,) = _loads_of(term, template)
        at = _same_row(graph, template, t_idx, st.node)
        if len(at) != 1:
            return None
        (index,) = at
        node = graph[st.node]
        body = substitute_index(st.body, dict(zip(out_index(node.rank), index)))
        ranges = dict(zip(out_index(o_node.rank), o_node.shape))
        for n in names:
            for idx in _loads_of(body, n):
                want = _same_row(graph, template, t_idx, n)
                if len(want) != 1 or not _same_position(idx, next(iter(want)), graph[n].shape, ranges):
                    return None
        stats[st.node] = (body, index)
    return stats


def _same_row(graph, template: str, idx: tuple, name: str) -> set:
    """{index of `name` at the row where `template` is read at `idx`}, for reductions of one
    kernel whose shapes differ only in dims of size 1 (`keepdim`); empty otherwise."""
    def real(shape):
        return [d for d, n in enumerate(shape) if sympy.sympify(n) != 1]

    t_shape, shape = graph[template].shape, graph[name].shape
    t_dims, dims = real(t_shape), real(shape)
    if len(t_dims) != len(dims) or any(sympy.sympify(t_shape[a] - shape[b]) != 0 for a, b in zip(t_dims, dims)):
        return set()
    out = [Index(sympy.Integer(0))] * len(shape)
    for a, b in zip(t_dims, dims):
        out[b] = idx[a]
    return {tuple(out)}


def _epilogue_reads_own_rows(graph, out_k, info: "FlashInfo", reduces, term) -> bool:
    """Whether the output's epilogue reads each reduction at the row of the output element it
    computes (the flash kernel holds only that row's value): each is read where the output's
    own read, mapped through the reductions' row (`_same_row`), says."""
    o_name = out_k.stages[0].node
    names = {st.node for st in reduces}
    template = next((n for n in names if len(_loads_of(term, n)) == 1), None)
    for st in out_k.stages[1:]:
        reads = {n: _loads_of(st.body, n) for n in names}
        if not any(reads.values()):
            continue
        o_reads = _loads_of(st.body, o_name)
        if template is None or len(o_reads) != 1:
            return False
        (o_idx,) = o_reads
        at = dict(zip(out_index(graph[o_name].rank), o_idx))
        (t_idx,) = _loads_of(term, template)
        t_at = tuple(substitute_index(c, at) for c in t_idx)
        ranges = dict(zip(out_index(graph[st.node].rank), graph[st.node].shape))
        for n, loads in reads.items():
            for idx in loads:
                want = _same_row(graph, template, t_at, n)
                if len(want) != 1 or not _same_position(idx, next(iter(want)), graph[n].shape, ranges):
                    return False
    return True


def _same_position(a: tuple, b: tuple, shape, ranges: dict) -> bool:
    from ..ir.symbolic import simplify_index

    if any(not isinstance(c, Index) for c in (*a, *b)):
        return False
    flat = [sympy.Integer(0), sympy.Integer(0)]
    for k, (x, y) in enumerate(zip(a, b)):
        stride = sympy.Mul(*shape[k + 1:]) if k + 1 < len(shape) else sympy.Integer(1)
        flat[0] += x.expr * stride
        flat[1] += y.expr * stride
    ones = {sym: 0 for sym, n in ranges.items() if sympy.sympify(n) == 1}  # (a dim of size 1 is index 0)
    diff = simplify_index(flat[0].subs(ones), ranges) - simplify_index(flat[1].subs(ones), ranges)
    return sympy.expand(diff) == 0


def _defer(info: FlashInfo, term: Expr, producers: tuple, o_node, con):
    """Pull factors that depend only on the row reductions (1/l) out of the weighted sum:
    the loop then accumulates Σ exp(s − m)·v re-based by exp(m − m') alone."""
    from .repair import defer_row_factors

    # the weights' own rounding to the output dtype is dropped with the factor (as
    # FlashAttention does): the unnormalised weights are rounded for the dot instead
    split = defer_row_factors(term, producers)
    if split is None:
        return None
    n_sym = out_index(o_node.rank)[con.n_dim]
    a_parts = [f for f in split.factors if n_sym not in free_symbols(f)]
    b_parts = [f for f in split.factors if n_sym in free_symbols(f)]
    if not a_parts or not b_parts:
        return None
    a, b = a_parts[0], b_parts[0]
    for f in a_parts[1:]:
        a = a * f
    for f in b_parts[1:]:
        b = b * f
    rest_producers = tuple(p for p in producers if _loads_of(a, p) or _loads_of(b, p))
    try:
        repair = derive_rolling_update(a * b, SUM, rest_producers)
    except NoRepair:
        return None
    return FlashInfo(q=info.q, k=info.k, score_extent=info.score_extent, a=a, b=b,
                     reduce_bodies=info.reduce_bodies, post=split.post, guards=split.guards), repair
