"""Products whose weights are recomputed from small products, in registers, tile by tile.

A contraction `O[r, n] = Σⱼ W[r, j] · B[j, n]` whose weights `W` are an elementwise function
of *score products* — `S[r, j] = Σₖ X[r, k] · Y[j, k]` over a small static `k` (a head
dimension) — and of values read per row or per key, needs neither `S` nor `W` in memory: a
program holding a block of rows computes each `S` tile with a `dot`, evaluates `W` on it and
accumulates `dot(W, B)`. This is the structure of FlashAttention-2's backward, where the
planner meets it in the backward graph of an attention chain (`frontend.attention_chains`):

    dV = Pᵀ · dO          P  = exp(f(Q·Kᵀ) − lse)
    dQ = dS · K           dS = f′ ∘ P ∘ (dO·Vᵀ − D)       two score products
    dKᵀ = Qᵀ · dS

Each such product becomes a flash plan with no carried reductions (nothing to repair: the
row statistics are inputs) and one or more score stages. The kernels that computed `S`,
`dO·Vᵀ`, `P` and `dS` are dropped once no one reads what they store: the T×T intermediates
never reach memory. Nothing here is specific to attention: any product whose weights are a
pointwise function of small products and of materialised values is recomputed this way.
"""
from __future__ import annotations

from dataclasses import replace

import sympy

from ..ir.expr import Cast, Expr, Index, Load, binary, count_ops, free_symbols, out_index, red_index, \
    skip_intermediate_rounding, transform, walk, walk_unique
from ..ir.graph import Graph, Pointwise, Scatter
from ..ir.rewrite import substitute_index
from .flash import K0, MAX_HELD, FlashInfo, Sibling, _static
from .inline import explicit_conversion, is_contraction_like
from .plan import Contraction, KernelPlan, PlanKind, Stage, StageKind

MAX_WEIGHT_OPS = 160  # the recomputed weights' size (ops per score tile) at most
MAX_SCORES = 2  # score products per kernel (dS needs two: Q·Kᵀ and dO·Vᵀ)
MAX_MERGED_HELD = 128  # largest held dim of plans merged into one kernel (`merge_siblings`)
MIN_ROW_BLOCK = 16  # the fewest rows a CPU flash kernel's program takes (`tile.flash`) while they fill the threads


def fuse_recomputed_scores(steps: list, graph: Graph, outputs: set, note, threads: int = 0) -> list:
    """Products over recomputed score tiles, as flash plans; kernels left unread dropped.
    `threads` (a CPU's; 0 on a GPU): a product whose blocks of rows are fewer is left unfused."""
    by_node = {st.node: k for k in steps if isinstance(k, KernelPlan) for st in k.stages}
    merged = {}  # original kernel -> its flash plan
    reach: dict = {}  # buffer -> whether a small product is read through pointwise nodes from it
    expanded: dict = {}  # `_weights`'s memo of expanded bodies
    for k in [s for s in steps if isinstance(s, KernelPlan)]:
        if k.kind == PlanKind.CONTRACTION and k.flash is None:
            plan = _try(k, graph, by_node, note, reach, expanded, threads)
            if plan is not None:
                merged[k.name] = (k, plan)
    # recompute only where it removes the materialisation: a product whose score products
    # are still stored for another reader would compute them twice
    while merged:
        trial = [merged[s.name][1] if isinstance(s, KernelPlan) and s.name in merged else s for s in steps]
        kept = _unread(trial, graph, outputs)
        dead = {st.node for k in kept[1] for st in k.stages}
        undone = [name for name, (_, plan) in merged.items()
                  if not all(n in dead for n, *_ in plan.flash.scores)]
        if not undone:
            for _, plan in merged.values():
                _with_mask(plan)
            _store_what_is_read(kept[0], {name for name, (_, plan) in merged.items()})
            for _, plan in merged.values():
                for msg in plan.notes[-1:]:
                    note(msg)
            for k in kept[1]:
                note(f"{k.name}: dropped — what it computed is recomputed where it is read")
            return merge_siblings(kept[0], graph, note)
        for name in undone:
            del merged[name]
    return steps


def merge_siblings(steps: list, graph: Graph, note) -> list:
    """Recomputing plans over the same score tiles become one kernel: a program computes each
    score tile once and accumulates every product that reads it (FlashAttention-2's dK and dV:
    `Pᵀ·dO` and `dSᵀ·Q` from one `Q·Kᵀ`, 4 dots per tile pair instead of 2 + 3). The plans
    must share their rows, held extent, loop, batch, score products (one's a subset of the
    other's) and mask; the later plan's position takes the merged kernel when nothing between
    the two reads what the earlier one stores."""
    def oriented(first, second):
        """(primary, sibling): the plan with more score products first (its scores are the kernel's)."""
        return (first, second) if len(first.flash.scores) >= len(second.flash.scores) else (second, first)

    while True:
        plans = [s for s in steps if isinstance(s, KernelPlan) and s.kind == PlanKind.FLASH and s.flash.scores]
        found = next(((a, b, mapping) for i, a in enumerate(plans) for b in plans[i + 1:]
                      if _score_names(a) & _score_names(b) and _adjacent(steps, a, b)
                      for mapping in [_siblings(*oriented(a, b), graph)] if mapping is not None), None)
        if found is None:
            return steps
        first, second, mapping = found
        primary, sibling = oriented(first, second)
        merged = _merged(primary, sibling, mapping, graph)
        note(f"{sibling.contraction_stage.node}: one kernel with {primary.contraction_stage.node} — both products' "
             f"weights come from the same score tiles, computed once")
        steps = [merged if s is second else s for s in steps if s is not first]


def _score_names(plan: KernelPlan) -> set:
    return {name for name, *_ in plan.flash.scores}


def _siblings(a: KernelPlan, b: KernelPlan, graph: Graph) -> dict | None:
    """`b`'s output coordinates in `a`'s (`_coordinate_map`) when the two recomputing plans
    walk the same tiles — same rows, held extent, batch and loop, score products (one's within
    the other's) and mask, no siblings yet, and neither reads the other — else None."""
    fa, fb = a.flash, b.flash
    if fa.siblings or fb.siblings or fa.post is not None or fb.post is not None or a.reduction != b.reduction:
        return None
    held = _static(graph[a.contraction_stage.node].shape[a.contraction.n_dim])
    if held is None or held > MAX_MERGED_HELD:
        return None  # (two accumulators of a wider held dim, beside the score tiles, spill registers)
    mapping = _coordinate_map(a, b, graph)
    if mapping is None:
        return None
    scores_b = {(name, substitute_index(q, mapping), substitute_index(k, mapping), extent)
                for name, q, k, extent in fb.scores}
    small, large = sorted((set(fa.scores), scores_b), key=len)
    if not small <= large:
        return None
    masked_b = substitute_index(fb.masked, mapping) if fb.masked is not None else None
    if (fa.masked, fa.skippable) != (masked_b, fb.skippable):
        return None  # (an equal mask is read from the same score, which `_with_mask` put first in both)
    if (_reads(a) & _computed(b)) or (_reads(b) & _computed(a)):
        return None
    return mapping


def _coordinate_map(a: KernelPlan, b: KernelPlan, graph: Graph) -> dict | None:
    """Index symbol of `b`'s output -> `a`'s at the same (row, held, batch) position: dV is
    [batch, keys, d] and dKᵀ [batch, d, keys]; None when the extents differ."""
    ca, cb = a.contraction, b.contraction
    na, nb = graph[a.contraction_stage.node], graph[b.contraction_stage.node]
    pairs = [(cb.m_dim, ca.m_dim), (cb.n_dim, ca.n_dim), *zip(cb.batch_dims, ca.batch_dims)]
    if len(ca.batch_dims) != len(cb.batch_dims) or len(pairs) != nb.rank or nb.rank != na.rank:
        return None
    if any(sympy.simplify(nb.shape[db] - na.shape[da]) != 0 for db, da in pairs):
        return None
    if tuple(na.ranges) != tuple(nb.ranges):
        return None
    ob, oa = out_index(nb.rank), out_index(na.rank)
    return {ob[db]: Index(oa[da]) for db, da in pairs}


def _reads(plan: KernelPlan) -> set:
    """Every buffer a plan's kernel loads: its stages' bodies, and — a score stage holds the
    product's own body, whose factors may read through pointwise nodes inlined into them — the
    score factors and weights the lowering computes."""
    exprs = [st.body for st in plan.stages]
    if plan.flash is not None:
        info = plan.flash
        exprs += [info.q, info.k, info.a, info.b, *(x for _, q, k, _ in info.scores for x in (q, k)),
                  *(x for sib in info.siblings for x in (sib.a, sib.b))]
    return {e.buffer for x in exprs for e in walk(x) if isinstance(e, Load)}


def _computed(plan: KernelPlan) -> set:
    """What a plan computes apart from its score tiles (which every plan over them recomputes)."""
    return {st.node for st in plan.stages if st.kind != StageKind.SCORE}


def _adjacent(steps: list, first: KernelPlan, second: KernelPlan) -> bool:
    """Whether `first` may move to `second`'s position: no step in between reads what it
    stores (its readers come after the merged kernel then)."""
    i, j = next(n for n, s in enumerate(steps) if s is first), next(n for n, s in enumerate(steps) if s is second)
    if i > j:
        return False
    own = _computed(first)
    for s in steps[i + 1:j]:
        if isinstance(s, KernelPlan):
            if _reads(s) & own:
                return False
            if any(st.scatter for st in s.stages):
                return False  # (an in-place write the earlier plan's reads could see)
        else:
            return False  # (an extern call: its reads and writes are not tracked here)
    return True


def _merged(primary: KernelPlan, sibling: KernelPlan, mapping: dict, graph: Graph) -> KernelPlan:
    """One plan: the primary's, with the sibling's product (its weights and values, and where
    its output and epilogues are stored) in the primary's coordinates."""
    node = graph[sibling.contraction_stage.node]
    epilogues = tuple(st.node for st in sibling.stages if st.kind == StageKind.ROW)
    extra = Sibling(node.name, substitute_index(sibling.flash.a, mapping), substitute_index(sibling.flash.b, mapping),
                    index=tuple(mapping[s].expr for s in out_index(node.rank)), epilogues=epilogues)
    plan = KernelPlan(name=primary.name, kind=PlanKind.FLASH, parallel=primary.parallel,
                      reduction=primary.reduction, contraction=primary.contraction,
                      flash=replace(primary.flash, siblings=(extra,)))  # (named later, by its members)
    plan.stages = [replace(st) for st in primary.stages]
    plan.stages += [replace(st) for st in sibling.stages if st.kind != StageKind.SCORE]
    plan.notes = primary.notes + sibling.notes
    return plan


def _expand(expr: Expr, graph: Graph, depth: int = 0, memo: dict | None = None) -> Expr:
    """`expr` with every pointwise node it reads substituted by its body, recursively (`memo`:
    expanded loads, shared by the calls of one pass) — but for explicit narrowing conversions
    (`x.to(bfloat16)`: `inline.explicit_conversion`, as the forward's inliner decides), which
    stay loads for `_keep_conversions`."""
    memo = {} if memo is None else memo

    def fn(e):
        if isinstance(e, Load) and e.buffer in graph.nodes and isinstance(graph[e.buffer], Pointwise) \
                and not explicit_conversion(graph, e.buffer):
            if e not in memo:
                node = graph[e.buffer]
                body = substitute_index(node.body, dict(zip(out_index(node.rank), e.index)))
                memo[e] = _expand(body, graph, depth + 1, memo) if depth < 64 else e
            return memo[e]
        return None

    return transform(expr, fn)


def _reaches_small_product(expr: Expr, graph: Graph, reach: dict) -> bool:
    """Whether `expr` reads a score product, directly or through pointwise nodes — by names
    alone (memoised in `reach`): most products' operands do not, and are not expanded."""
    def reaches(name: str) -> bool:
        if name not in reach:
            reach[name] = False  # (a node is never its own producer: the graph is acyclic)
            node = graph.nodes.get(name)
            if node is not None and _small_product(node):
                reach[name] = True
            elif isinstance(node, Pointwise):
                reach[name] = any(reaches(e.buffer) for e in walk(node.body) if isinstance(e, Load))
        return reach[name]

    return any(reaches(e.buffer) for e in walk_unique(expr) if isinstance(e, Load))


def _small_product(node) -> bool:
    return is_contraction_like(node) and len(node.ranges) == 1 and _static(node.ranges[0]) is not None \
        and _static(node.ranges[0]) <= MAX_HELD


def _scores_in(expr: Expr, graph: Graph) -> set:
    return {e.buffer for e in walk_unique(expr) if isinstance(e, Load) and e.buffer in graph.nodes
            and _small_product(graph[e.buffer])}


def _weights(factor: Expr, graph: Graph, memo: dict) -> Expr:
    """The factor with its producers substituted; the dot's operand keeps eager's rounding
    (`float32(bfloat16(p))`: a bf16 product on tensor cores), the values inside it keep their
    compute precision (the scores never reach memory to be rounded)."""
    expanded = _expand(factor, graph, memo=memo)
    if isinstance(expanded, Cast) and isinstance(expanded.x, Cast) and expanded.x.dtype.is_low_precision:
        inner = expanded.x
        return Cast(Cast(_keep_conversions(inner.x, graph, memo), inner.dtype), expanded.dtype)
    return _keep_conversions(expanded, graph, memo)


def _keep_conversions(expanded: Expr, graph: Graph, memo: dict, depth: int = 0) -> Expr:
    """An expanded expression with the rounding between fused ops skipped and its explicit
    narrowing conversions then substituted, rounding kept: the forward's kernel rounds a bias
    written `bias.to(bfloat16)` and not the sum it is added to, and the scores recomputed here
    must be those same values (a bias of -3000 rounded in one and not in the other put
    exp(±8) into the gradients)."""
    def fn(e):
        if isinstance(e, Load) and e.buffer in graph.nodes and isinstance(graph[e.buffer], Pointwise) \
                and explicit_conversion(graph, e.buffer) and depth < 64:
            node = graph[e.buffer]
            body = substitute_index(node.body, dict(zip(out_index(node.rank), e.index)))
            inner = _keep_conversions(_expand(body.x, graph, memo=memo), graph, memo, depth + 1)
            return Cast(inner, body.dtype)
        return None

    return transform(skip_intermediate_rounding(expanded), fn)


def _try(out_k: KernelPlan, graph: Graph, by_node: dict, note, reach: dict, expanded: dict,
         threads: int = 0) -> KernelPlan | None:
    con = out_k.contraction
    o_stage = out_k.stages[0]
    o_node = graph[o_stage.node]
    if con is None or len(o_node.ranges) != 1:
        return None
    outs = out_index(o_node.rank)
    (r0,) = red_index(1)
    for side, other in (("a", "b"), ("b", "a")):
        factor = getattr(con, side)
        if not _reaches_small_product(factor, graph, reach):
            continue
        if _reaches_small_product(getattr(con, other), graph, reach):
            return None  # (the other operand would read a product the plan no longer stores)
        held = con.n_dim if side == "a" else con.m_dim
        rows = con.m_dim if side == "a" else con.n_dim
        n_sym = outs[held]
        if _static(o_node.shape[held]) is None or _static(o_node.shape[held]) > MAX_HELD:
            return None
        blocks = _row_blocks(o_node, rows, con.batch_dims)
        if blocks is not None and blocks < threads:
            note(f"{o_node.name}: weights not recomputed: {blocks} block(s) of rows for {threads} threads "
                 f"(the products unfused spread over their columns too)")
            return None
        weights = _weights(factor, graph, expanded)  # (a DAG: its walks below visit shared nodes once or stop early)
        names = sorted(_scores_in(weights, graph))
        ops = count_ops(weights, limit=MAX_WEIGHT_OPS)
        if len(names) > MAX_SCORES or ops > MAX_WEIGHT_OPS:
            many = f"over {MAX_WEIGHT_OPS}" if ops > MAX_WEIGHT_OPS else str(ops)
            note(f"{o_node.name}: weights not recomputed: {len(names)} score products, {many} ops")
            return None
        if n_sym in free_symbols(weights):
            return None
        if _reads_written(weights, graph):
            return None  # (an input written in place in the graph: read later, it may have changed)
        scores = []
        for name in names:
            found = _score_coordinates(graph, by_node, weights, name, r0, n_sym, outs[rows])
            if isinstance(found, str):
                note(f"{o_node.name}: weights not recomputed: {found}")
                return None
            scores.append(found)
        flash_con = Contraction(a=weights, b=getattr(con, other), m_dim=rows, n_dim=held, batch_dims=con.batch_dims)
        _, q, k, extent = scores[0]
        info = FlashInfo(q=q, k=k, score_extent=extent, a=weights, b=flash_con.b, reduce_bodies={},
                         scores=tuple(scores))  # (its mask: `_with_mask`, once the plan is kept)
        plan = KernelPlan(name=out_k.name, kind=PlanKind.FLASH, parallel=out_k.parallel, reduction=(o_node.ranges[0],))
        plan.contraction = flash_con
        plan.flash = info
        for name, *_ in scores:
            plan.stages.append(Stage(name, StageKind.SCORE, graph[name].body, store=False))
        plan.stages.append(Stage(o_stage.node, StageKind.CONTRACTION, binary("mul", weights, flash_con.b),
                                 store=o_stage.store))
        plan.stages.extend(out_k.stages[1:])
        what = (f"{o_node.name}: weights recomputed per tile from the score products {', '.join(names)} "
                f"(they never reach memory)")
        plan.notes = out_k.notes + [what]
        return plan
    return None


def _row_blocks(o_node, rows: int, batch_dims) -> int | None:
    """How many programs a flash plan over `o_node`'s rows runs at most: blocks of
    `MIN_ROW_BLOCK` rows times the batch (None: symbolic sizes)."""
    extents = [_static(o_node.shape[d]) for d in (rows, *batch_dims)]
    if None in extents:
        return None
    count = -(-extents[0] // MIN_ROW_BLOCK)
    for e in extents[1:]:
        count *= e
    return count


def _reads_written(expr: Expr, graph: Graph) -> bool:
    """Whether `expr` (with the score products' own factors) reads a buffer some node of the
    graph writes in place (a KV cache): recomputed at the product, it could see the write."""
    written = {n.target for n in graph.nodes.values() if isinstance(n, Scatter)}
    written |= {n.name for n in graph.nodes.values() if isinstance(n, Scatter)}
    if not written:
        return False
    seen, todo = set(), [expr]
    while todo:
        for e in walk(todo.pop()):
            if isinstance(e, Load) and e.buffer not in seen:
                seen.add(e.buffer)
                node = graph.nodes.get(e.buffer)
                if node is not None and is_contraction_like(node):
                    todo.append(node.body)
    return bool(seen & written)


def _with_mask(plan: KernelPlan) -> None:
    """The plan's mask (`_mask_of`), with the masked score product made the first (the mask's
    machinery — block summary, score bound — reads the first one's factors)."""
    info = plan.flash
    names = [name for name, *_ in info.scores]
    masked, skippable = _mask_of(info.a, names)
    scores = list(info.scores)
    if masked is not None:
        first = next(n for n in names if any(isinstance(e, Load) and e.buffer == n for e in walk(masked)))
        scores.sort(key=lambda sc: sc[0] != first)
    _, q, k, extent = scores[0]
    plan.flash = replace(info, q=q, k=k, score_extent=extent, masked=masked, skippable=skippable,
                         scores=tuple(scores))
    by_name = {st.node: st for st in plan.stages if st.kind == StageKind.SCORE}
    rest = [st for st in plan.stages if st.kind != StageKind.SCORE]
    plan.stages[:] = [by_name[name] for name, *_ in scores] + rest


def _mask_of(weights: Expr, scores: list) -> tuple:
    """(masked, skippable) as `fusion.masking.mask_facts` gives an attention plan: the
    smallest masked score expression in the weights (`where(¬keep, -inf, s·c)`), and whether
    the weights vanish wherever it is masked (then a key tile masked throughout is skipped)."""
    from ..ir.monoid import SUM
    from .masking import masked_condition, vanishes_when_masked

    found = [e for e in walk(weights) if any(isinstance(x, Load) and x.buffer in scores for x in walk(e))
             and masked_condition(e) is not None]
    if not found:
        return None, False
    masked = min(found, key=count_ops)
    return masked, vanishes_when_masked(weights, masked, SUM)


def _score_coordinates(graph: Graph, by_node: dict, weights: Expr, name: str, r0, n_sym, row_sym):
    """(name, row factor, key factor, extent) of a score product read by the weights, its
    factors in the output's coordinates (`k0` its own axis), or why it cannot be recomputed:
    the key factor must not vary along the rows (`row_sym`) nor the row factor along the keys
    (`r0`) — a product batched over experts whose rows flatten (expert, feature) reads a key
    factor per expert, which a tile of rows does not have one of — and the row factor must vary
    along the rows (a score row broadcast to every row is computed once)."""
    loads = {e.index for e in walk(weights) if isinstance(e, Load) and e.buffer == name}
    if len(loads) != 1:
        return f"{name} is read at several positions"
    (idx,) = loads
    if any(not isinstance(c, Index) for c in idx):
        return f"{name} is read through a gather"
    key_dims = [d for d, c in enumerate(idx) if r0 in c.expr.free_symbols]
    if len(key_dims) != 1 or idx[key_dims[0]].expr != r0 or any(n_sym in c.expr.free_symbols for c in idx):
        return f"the loop position does not index {name} directly"
    kernel = by_node.get(name)
    if kernel is None or kernel.contraction is None or kernel.kind != PlanKind.CONTRACTION \
            or kernel.stages[0].node != name:
        return f"{name} is not a planned product"
    sc = kernel.contraction
    node = graph[name]
    key_sym = out_index(node.rank)[key_dims[0]]
    mapping = dict(zip(out_index(node.rank), idx))
    mapping[red_index(1)[0]] = Index(K0)
    fa, fb = substitute_index(sc.a, mapping), substitute_index(sc.b, mapping)
    if _reaches_small_product(fa, graph, {}) or _reaches_small_product(fb, graph, {}):
        return f"{name}'s factors are products themselves"  # (their kernels could be dropped too)
    q, k = (fb, fa) if key_sym in free_symbols(sc.a) else (fa, fb)
    if row_sym in free_symbols(k) or r0 in free_symbols(q):
        return f"{name}'s key factor varies along the rows (or its row factor along the keys)"
    if row_sym not in free_symbols(q):
        # (one row of scores read by every row: computed once, not again per tile of rows)
        return f"{name} has one row, broadcast to every row of the output"
    return name, q, k, node.ranges[0]


def _store_what_is_read(steps: list, merged: set) -> None:
    """A value the recomputed weights read that its kernel kept in registers (a reduction
    feeding that kernel's epilogue) is now stored too."""
    reads = {e.buffer for s in steps if isinstance(s, KernelPlan) and s.name in merged
             for st in s.stages for e in walk(st.body) if isinstance(e, Load)}
    for s in steps:
        if isinstance(s, KernelPlan) and s.name not in merged:
            for st in s.stages:
                if st.node in reads and not st.store:
                    st.store = True


def _unread(steps: list, graph: Graph, outputs: set) -> tuple[list, list]:
    """(steps kept, kernels dropped): kernels none of whose values anyone reads (a value kept
    in registers and now read elsewhere is stored: `_store_what_is_read`), removed repeatedly (a dropped kernel may have been the last reader of another)."""
    from .plan import ExternStep

    dropped = []
    while True:
        read = set(outputs)
        for s in steps:
            if isinstance(s, KernelPlan):  # (a plan's own members are read in registers)
                own = set(s.members)
                read |= {e.buffer for st in s.stages for e in walk(st.body) if isinstance(e, Load)} - own
                read |= {e.buffer for st in s.stages if st.scatter for x in st.scatter[1] for e in walk(x)
                         if isinstance(e, Load)} - own
            elif isinstance(s, ExternStep):
                read |= graph[s.node].inputs()
        dead = [s for s in steps if isinstance(s, KernelPlan) and s.kind != PlanKind.FLASH
                and not any(st.node in read for st in s.stages)
                and not any(st.scatter for st in s.stages)]
        if not dead:
            return steps, dropped
        dropped += dead
        steps = [s for s in steps if not any(s is d for d in dead)]
