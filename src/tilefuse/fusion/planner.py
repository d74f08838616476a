"""The fusion planner: groups realised nodes into kernels.

Walking the graph in order, each realised node either joins an earlier kernel or opens one:

* a Reduce that is a contraction (sum of a product with an M-only and an N-only factor)
  opens a contraction kernel;
* another Reduce joins an earlier reduction kernel over the same parallel size and reduction
  extents (sibling reductions such as mean and variance, or dependent ones such as softmax's
  max then sum), else opens one;
* a Pointwise joins the kernel of the reductions it reads when it reads them at the kernel's
  own position — as an epilogue (`row`) or, for reduction kernels, as a `full` output indexed
  by the reduction axis too (RMSNorm) — else an earlier pointwise kernel over as many
  elements whose inputs are ready before it (horizontal fusion), else it opens a pointwise
  kernel.

A node may join kernel K only if everything else it reads is produced before K. Every choice
and every refusal is recorded for `tilefuse.explain` and `TILEFUSE_LOGS=fusion`. Kernels are
called `kernel<N>` while they are planned (the log says so) and get their final names, which
the recorded decisions then use, once every plan is complete (`fusion.naming`).
"""
from __future__ import annotations

import sympy

from .. import logs
from ..config import KNOBS
from ..ir.expr import Binary, Expr, Index, Load, count_ops, free_symbols, out_index, red_index, transform, walk
from ..ir.graph import Extern, ExternResult, Graph, Pointwise, Reduce, Scatter
from ..ir.monoid import SUM
from ..ir.rewrite import substitute_index
from ..ir.symbolic import ravel_sym, simplify_index, unravel_sym
from .inline import MAX_SHARED_OPS, Inliner
from .plan import Contraction, ExternStep, KernelPlan, PlanKind, GraphPlan, Stage, StageKind
from .flash import fuse_flash
from .recompute import fuse_recomputed_scores
from .moments import derive_moments
from .naming import name_kernels, renamer
from .repair import NoRepair, derive_rolling_update
from .schedule import schedule_passes

#: independent pointwise outputs computed by one kernel at most (a launch saved per join)
MAX_HORIZONTAL_STAGES = 4

X = sympy.Symbol("x", integer=True, nonnegative=True)
R = sympy.Symbol("r", integer=True, nonnegative=True)


def numel(shape) -> sympy.Expr:
    return sympy.Mul(*shape) if shape else sympy.Integer(1)


def _unit_dims(node: Reduce, outs, other_reads) -> list:
    """Extent-1 output dims the other factor does not read: a matrix dim of one row."""
    return [k for k, s in enumerate(outs) if node.shape[k] == 1 and s not in other_reads][-1:]


def match_contraction(node: Reduce, body: Expr) -> Contraction | None:
    """Recognise out[b.., m, n] = sum_k a(b.., m, k) * b(b.., k, n)."""
    if node.combiner != SUM or len(node.ranges) != 1:
        return None
    if not (isinstance(body, Binary) and body.op == "mul"):
        return None
    a, b = body.a, body.b
    outs = out_index(node.rank)
    (r0,) = red_index(1)
    sa, sb = free_symbols(a), free_symbols(b)
    if r0 not in sa or r0 not in sb:
        return None
    only_a = [k for k, s in enumerate(outs) if s in sa and s not in sb and node.shape[k] != 1]
    only_b = [k for k, s in enumerate(outs) if s in sb and s not in sa and node.shape[k] != 1]
    if not only_a and only_b:
        only_a = _unit_dims(node, outs, sb)  # a single row (decode's one query, a GEMV)
    elif only_a and not only_b:
        only_b = _unit_dims(node, outs, sa)
    if not only_a or not only_b:
        return None
    # the innermost dim only one factor reads is its matrix dim; any other such dim is a batch
    # dim the other factor broadcasts along (grouped-query attention's heads)
    m, n = only_a[-1], only_b[-1]
    # both factors must be loads (with casts and cheap prologues), not already products of
    # reductions over k; the dot needs floating point operands
    if not (a.dtype.is_float and b.dtype.is_float):
        return None
    batch = tuple(k for k in range(node.rank) if k not in (m, n))
    return Contraction(a=a, b=b, m_dim=m, n_dim=n, batch_dims=batch)


class Planner:
    def __init__(self, graph: Graph, persistent_reduction_limit: int, threads: int = 0):
        self.graph = graph
        self.persistent_reduction_limit = persistent_reduction_limit
        self.threads = threads
        self.inliner = Inliner(graph)
        self.steps: list = []
        self.where: dict[str, int] = {}
        self.decisions: list[str] = []
        self._reductions_by_axis: dict | None = None  # (ranges, shape) -> reductions (`_row_reductions`)

    def note(self, msg: str, kernel: KernelPlan | None = None) -> None:
        self.decisions.append(msg)
        if kernel is not None:
            kernel.notes.append(msg)
        logs.log("fusion", "%s", msg)

    # ------------------------------------------------------------------ helpers
    def deps(self, body: Expr) -> set[str]:
        return {e.buffer for e in walk(body) if isinstance(e, Load) and e.buffer in self.where}

    def loads_at_position(self, body: Expr, members: set, index_map: dict, ranges: dict) -> bool:
        """Every load of a `members` node in `body` (with the node's indices mapped by
        `index_map`) reads that node at the kernel's parallel position X."""
        body = substitute_index(body, index_map)
        for e in walk(body):
            if isinstance(e, Load) and e.buffer in members:
                if not all(isinstance(c, Index) for c in e.index):
                    return False
                src = self.graph[e.buffer]
                pos = simplify_index(ravel_sym([c.expr for c in e.index], src.shape), ranges)
                if pos != X and sympy.expand(pos - X) != 0:
                    return False
        return True

    def new_kernel(self, kind: PlanKind, parallel, reduction=()) -> KernelPlan:
        k = KernelPlan(name=f"kernel{len(self.kernels())}", kind=kind, parallel=parallel, reduction=reduction)
        self.steps.append(k)
        return k

    def kernels(self):
        return [s for s in self.steps if isinstance(s, KernelPlan)]

    def add(self, kernel: KernelPlan, stage: Stage) -> None:
        kernel.stages.append(stage)
        self.where[stage.node] = self.steps.index(kernel)

    def reachable_before(self, deps: set, k_index: int, allowed_inside: set) -> bool:
        for d in deps:
            w = self.where[d]
            if w > k_index or (w == k_index and d not in allowed_inside):
                return False
        return True

    # ------------------------------------------------------------------ main loop
    def run(self) -> GraphPlan:
        for node in self.graph.nodes.values():
            if isinstance(node, (Extern, ExternResult)):
                if isinstance(node, Extern):
                    self.steps.append(ExternStep(node.name, node.reason))
                    self.note(f"{node.name}: extern {node.target_name} ({node.reason})")
                self.where[node.name] = len(self.steps) - 1
            elif isinstance(node, Reduce):
                self.place_reduce(node)
            elif isinstance(node, Scatter):
                self.place_scatter(node)
            elif isinstance(node, Pointwise) and node.name not in self.inliner.inlined:
                self.place_pointwise(node)
        self.mark_stores()
        planned = {k.name: k.members for k in self.kernels()}
        self.steps = fuse_flash(self.steps, self.graph, set(self.graph.output_names()), self.note)
        self.steps = fuse_recomputed_scores(self.steps, self.graph, set(self.graph.output_names()), self.note,
                                            threads=self.threads)
        self.name_kernels(planned)
        for name, why in self.inliner.reasons.items():
            if why != "unused":
                self.decisions.append(f"{name}: not inlined — {why}")
        sched = GraphPlan(self.steps, self.inliner.inlined, self.decisions)
        logs.log("fusion", "schedule:\n%s", sched.describe())
        return sched

    def name_kernels(self, planned: dict) -> None:
        """Final kernel names (`fusion.naming`), in the plans and in what the decisions say."""
        rename = renamer(name_kernels(self.graph, self.steps, self.inliner.inlined, planned))
        self.decisions = [rename(d) for d in self.decisions]
        for k in self.kernels():
            k.notes = [rename(n) for n in k.notes]

    def place_reduce(self, node: Reduce) -> None:
        body = self.inliner.body(node.name)
        parallel = numel(node.shape)
        contraction = match_contraction(node, body)
        if contraction is not None and self.matvec_in_row_pass(node, contraction):
            self.note(f"{node.name}: a matrix-vector product whose matrix another reduction over the same "
                      "axis reads: reduced in that pass, not a dot")
            contraction = None
        if contraction is not None:
            k = self.new_kernel(PlanKind.CONTRACTION, parallel)
            k.contraction = contraction
            self.add(k, Stage(node.name, StageKind.CONTRACTION, body))
            self.note(f"{node.name}: contraction (m=dim {contraction.m_dim}, n=dim {contraction.n_dim}) -> {k.name}", k)
            return
        index_map = dict(zip(out_index(node.rank), (Index(e) for e in unravel_sym(X, node.shape))))
        own_body = body
        for k in reversed(self.kernels()):
            if k.kind != PlanKind.REDUCTION or k.reduction != tuple(node.ranges):
                continue
            if sympy.simplify(k.parallel - parallel) != 0:
                continue
            # a full-row output of k read here is recomputed from k's own values (`exp(s − m)`
            # summed after it was also multiplied by V: softmax normalised after the product)
            body = self.through_full_rows(own_body, k)
            deps = self.deps(body)
            kidx = self.steps.index(k)
            members = {s.node for s in k.stages if s.kind in (StageKind.REDUCE, StageKind.ROW)}
            ranges = {X: k.parallel}
            if not self.reachable_before(deps, kidx, members):
                continue
            if not self.loads_at_position(body, members, index_map, ranges):
                continue
            level = 1 + max((k.stage(d).level for d in deps & members), default=-1)
            stage = Stage(node.name, StageKind.REDUCE, body, level=level,
                          repair=self.try_repair(k, node, body, deps & members))
            self.add(k, stage)
            self.note(f"{node.name}: joins {k.name} as a reduction over the same axis (pass {level})", k)
            return
        k = self.new_kernel(PlanKind.REDUCTION, parallel, tuple(node.ranges))
        self.add(k, Stage(node.name, StageKind.REDUCE, own_body, level=0))
        self.note(f"{node.name}: reduction over {list(node.ranges)} -> {k.name}", k)

    def matvec_in_row_pass(self, node: Reduce, contraction: Contraction) -> bool:
        """Whether a matrix-vector product (one factor a single row) reads its matrix exactly as
        another reduction of its shape over the same axis does, one that is not a product
        itself: LayerNorm's backward sums dy·w and dy·w·x̂ over each row of dy. As reductions
        both run in one pass over the matrix; a dot would read it once more, in tiles padded to
        16 columns, and leave the row's other sums to a second kernel. The matrix's reads are
        compared load for load (buffer and index), so a sibling that reads another buffer, the
        matrix transposed, or only a vector both share is no reason."""
        if node.shape[contraction.m_dim] == 1:
            matrix = contraction.b
        elif node.shape[contraction.n_dim] == 1:
            matrix = contraction.a
        else:
            return False
        (r0,) = red_index(1)
        reads = {(e.buffer, e.index) for e in walk(matrix)
                 if isinstance(e, Load) and r0 in free_symbols(e)}
        if not reads:
            return False
        for other in self._row_reductions().get((tuple(node.ranges), tuple(node.shape)), ()):
            if other is node:
                continue
            body = self.inliner.body(other.name)
            if match_contraction(other, body) is not None:
                continue
            if reads & {(e.buffer, e.index) for e in walk(body) if isinstance(e, Load)}:
                return True
        return False

    def _row_reductions(self) -> dict:
        """The graph's reductions by (ranges, shape), made once per plan."""
        if self._reductions_by_axis is None:
            out: dict = {}
            for n in self.graph.nodes.values():
                if isinstance(n, Reduce):
                    out.setdefault((tuple(n.ranges), tuple(n.shape)), []).append(n)
            self._reductions_by_axis = out
        return self._reductions_by_axis

    def through_full_rows(self, body: Expr, k: KernelPlan) -> Expr:
        """`body` with the loads of k's full-row outputs replaced by their bodies (so that it
        reads what k computes, not what k stores)."""
        full = {s.node: s.body for s in k.stages if s.kind == StageKind.FULL}
        if not full:
            return body

        def inline(e):
            if isinstance(e, Load) and e.buffer in full:
                node = self.graph[e.buffer]
                return substitute_index(full[e.buffer], dict(zip(out_index(node.rank), e.index)))
            return None

        for _ in range(len(full)):  # (a full row may read another)
            if not any(isinstance(e, Load) and e.buffer in full for e in walk(body)):
                break
            body = transform(body, inline)
        return body

    def try_repair(self, k: KernelPlan, node: Reduce, body: Expr, deps: set):
        """A rolling update over the latest reduction this one reads, if one can be derived;
        failing that, a moment expansion over the results it reads."""
        repair = self.try_rolling_update(k, node, body, deps)
        return repair if repair is not None else self.try_moments(k, node, body, deps)

    def try_rolling_update(self, k: KernelPlan, node: Reduce, body: Expr, deps: set):
        reduce_deps = [d for d in deps if k.stage(d).kind == StageKind.REDUCE]
        if not reduce_deps:
            return None
        producer = max(reduce_deps, key=lambda d: k.stage(d).level)
        top = k.stage(producer).level
        if any(k.stage(d).level >= top for d in deps if d != producer):
            self.note(f"{node.name}: no rolling update: it reads several reductions of pass {top}", k)
            return None
        if not self.graph[producer].combiner.numeric:
            self.note(f"{node.name}: no rolling update over {producer} ({self.graph[producer].combiner})", k)
            return None
        try:
            repair = derive_rolling_update(body, node.combiner, producer)
        except NoRepair as why:
            self.note(f"{node.name}: no rolling update over {producer}: {why}", k)
            return None
        self.note(f"{node.name}: {repair.describe()}", k)
        return repair

    def try_moments(self, k: KernelPlan, node: Reduce, body: Expr, deps: set):
        """Moments carried in the pass that finishes the results this one reads (reductions
        of that pass and rows computed after it), when the body is polynomial in them."""
        axis = sympy.sympify(numel(k.reduction))
        if axis.is_Integer and int(axis) <= self.persistent_reduction_limit:
            return None  # a persistent row: the body reads the finished results from registers
        level, _ = schedule_passes(k, use_repairs=True)
        top = max((level[d] for d in deps), default=-1)
        if top < 0:
            return None
        producers = tuple(s.node for s in k.stages if s.node in deps and level[s.node] == top)
        try:
            repair = derive_moments(body, node.combiner, producers, node.name)
        except NoRepair as why:
            self.note(f"{node.name}: no moment expansion over {', '.join(producers)}: {why}", k)
            return None
        self.note(f"{node.name}: {repair.describe()}", k)
        return repair

    def place_pointwise(self, node: Pointwise) -> None:
        own_body = self.inliner.body(node.name)
        own_deps = self.deps(own_body)
        size = numel(node.shape)
        candidates = sorted({self.where[d] for d in own_deps}, reverse=True)
        for kidx in candidates:
            k = self.steps[kidx]
            if not isinstance(k, KernelPlan) or k.kind == PlanKind.POINTWISE:
                continue
            # a full-row output of k read here is recomputed from k's own values (the bf16 copy of
            # a norm's output that a product reads: a second store of the same row), while that
            # adds few operations: a chain of full rows, each reading the last, would grow a body
            # per link (and two reads of the last, twice over)
            body = self.through_full_rows(own_body, k) if k.kind == PlanKind.REDUCTION else own_body
            if body is not own_body:
                limit = count_ops(own_body, MAX_SHARED_OPS) + MAX_SHARED_OPS
                if count_ops(body, limit) > limit:
                    body = own_body
            deps = self.deps(body) if body is not own_body else own_deps
            anchors = {s.node for s in k.stages
                       if s.kind in (StageKind.REDUCE, StageKind.CONTRACTION, StageKind.ROW)}
            if not self.reachable_before(deps, kidx, anchors):
                self.note(f"{node.name}: cannot join {k.name}: reads a value produced after it")
                continue
            if sympy.simplify(size - k.parallel) == 0:
                index_map = dict(zip(out_index(node.rank), (Index(e) for e in unravel_sym(X, node.shape))))
                if self.loads_at_position(body, anchors, index_map, {X: k.parallel}):
                    level = max((k.stage(d).level for d in deps & anchors), default=-1)
                    self.add(k, Stage(node.name, StageKind.ROW, body, level=level))
                    self.note(f"{node.name}: epilogue of {k.name}", k)
                    return
            if k.kind == PlanKind.REDUCTION:
                rn = numel(k.reduction)
                if sympy.simplify(size - k.parallel * rn) == 0:
                    flat = X * rn + R
                    index_map = dict(zip(out_index(node.rank), (Index(e) for e in unravel_sym(flat, node.shape))))
                    ranges = {X: k.parallel, R: rn}
                    if self.loads_at_position(body, anchors, index_map, ranges):
                        level = 1 + max((k.stage(d).level for d in deps & anchors), default=-1)
                        self.add(k, Stage(node.name, StageKind.FULL, body, level=level))
                        self.note(f"{node.name}: full-row output of {k.name} (pass {level})", k)
                        return
            self.note(f"{node.name}: not fused into {k.name}: it does not read the kernel's results at the kernel's own position")
        k = self.horizontal_partner(size, own_deps)
        if k is not None:
            self.add(k, Stage(node.name, StageKind.POINTWISE, own_body))
            self.note(f"{node.name}: joins {k.name}: same iteration space, reads nothing it computes", k)
            return
        k = self.new_kernel(PlanKind.POINTWISE, size)
        self.add(k, Stage(node.name, StageKind.POINTWISE, own_body))
        self.note(f"{node.name}: pointwise -> {k.name}", k)

    def horizontal_partner(self, size, deps: set) -> KernelPlan | None:
        """An earlier pointwise kernel over as many elements whose inputs are ready before it,
        so that the node can be computed in it: independent elementwise outputs (RoPE of q and
        of k, the writes of k and v into their caches) share one launch."""
        for kidx in range(len(self.steps) - 1, -1, -1):
            k = self.steps[kidx]
            if not (isinstance(k, KernelPlan) and k.kind == PlanKind.POINTWISE):
                continue
            if len(k.stages) >= MAX_HORIZONTAL_STAGES or sympy.expand(k.parallel - size) != 0:
                continue  # (expand, not simplify: this scan runs for every pointwise node)
            if self.reachable_before(deps, kidx, set()):
                return k
        return None

    def place_scatter(self, node: Scatter) -> None:
        """An in-place indexed write is a kernel of its own over the written values, with their
        pointwise producers fused in."""
        body = self.inliner.expr(node.body)
        index = tuple(self.inliner.expr(c) for c in node.index)
        deps = self.deps(body) | {d for c in index for d in self.deps(c)}
        stage = Stage(node.name, StageKind.SCATTER, body, scatter=(node.target, index))
        k = self.horizontal_partner(numel(node.space), deps)
        if k is not None:
            self.add(k, stage)
            self.note(f"{node.name}: in-place indexed write into {node.target}, joins {k.name}: same iteration "
                      f"space, reads nothing it computes", k)
            return
        k = self.new_kernel(PlanKind.POINTWISE, numel(node.space))
        self.add(k, stage)
        self.note(f"{node.name}: in-place indexed write into {node.target} -> {k.name}", k)

    def mark_stores(self) -> None:
        """A member is written to memory if it is an output, an extern reads it, or a node in
        another kernel reads it (directly or through inlined producers)."""
        outputs = set(self.graph.output_names())
        read_elsewhere: set[str] = set()
        for step in self.steps:
            if isinstance(step, ExternStep):
                ext = self.graph[step.node]
                read_elsewhere |= ext.inputs()
                continue
            own = set(step.members)
            for st in step.stages:
                exprs = (st.body, *(st.scatter[1] if st.scatter else ()))
                read_elsewhere |= {e.buffer for x in exprs for e in walk(x) if isinstance(e, Load)} - own
        for k in self.kernels():
            for st in k.stages:
                st.store = st.node in outputs or st.node in read_elsewhere
                if st.kind in (StageKind.ROW, StageKind.FULL, StageKind.POINTWISE, StageKind.SCATTER) \
                        and not st.store:
                    st.store = True  # realised for a reason the inliner recorded


def plan_graph(graph: Graph, persistent_reduction_limit: int = KNOBS["persistent_reduction_limit"].default,
               threads: int = 0) -> GraphPlan:
    """The graph's kernel plans; rows up to `persistent_reduction_limit` elements are held whole
    in a tile (the knob's value: longer ones are walked tile by tile, with carried repairs).
    `threads`: a CPU's threads (0: a GPU), which products over recomputed scores must fill."""
    return Planner(graph, persistent_reduction_limit, threads).run()


__all__ = ["plan_graph", "match_contraction", "X", "R"]
