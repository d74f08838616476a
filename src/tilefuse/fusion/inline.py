"""Which pointwise nodes are inlined into their consumers, and the inlined bodies.

Pointwise chains fuse by substitution: a consumer's load of an inlined producer is replaced
by the producer's body at the loaded index. A pointwise node is *realised* (written to
memory) instead when it is a graph output, an extern reads it, it would be recomputed by a
contraction's inner loop with a costly prologue or one reading two operand-sized buffers (a
dropout's backward: re-read per tile of output columns), it is the epilogue of one product and an
operand of another (`linear(x) + b` feeding `q @ kᵀ`: stored once, narrow, by the first
product's kernel), several consumers would recompute a large body, or it is a link of a chain
of shared bodies (a transformer's residual stream `h = h + f(norm(h))`: inlined throughout,
the norm of layer L would re-read every earlier layer's output).

A contraction's operands keep the precision eager gives them: where a low-precision producer
is inlined into a product's factor, its rounding stays (the product then runs on bf16/fp16
operands, on tensor cores), while between other fused ops intermediate rounding is skipped.

The inlined body of each node also loses the index checks that its own index ranges prove
unnecessary (a gather at `arange` positions, or at clamped ones: `ir.bounds`).
"""
from __future__ import annotations

import sympy

from ..ir.bounds import VALUES, prune_checks, stored_values
from ..ir.dtypes import float_widens
from ..ir.expr import (COMPARISONS, Binary, Cast, Expr, Index, Load, Unary, Where, count_ops, out_index, red_index,
                       skip_intermediate_rounding, transform, walk, walk_unique)
from ..ir.graph import Extern, ExternResult, Graph, Pointwise, Reduce
from ..ir.monoid import SUM
from ..ir.rewrite import substitute_index

#: unary ops that cost far more than an add (a contraction prologue of these is realised)
TRANSCENDENTAL = frozenset("exp exp2 log log2 log10 log1p expm1 sin cos tan asin acos atan sinh cosh "
                           "tanh asinh acosh atanh sigmoid erf erfc lgamma pow".split())
#: a body shared by several consumers is recomputed up to this cost (`compute_cost`: an add is
#: 1, a transcendental op TRANSCENDENTAL_COST)
MAX_SHARED_OPS = 24
#: what one transcendental op costs against an add: a C++ kernel's vector tanh or exp is a
#: polynomial of 15-25 instructions, a GPU's runs on the special-function units at a quarter
#: of the adds' rate or less (and erf, pow, lgamma are longer everywhere)
TRANSCENDENTAL_COST = 8
MAX_PROLOGUE_OPS = 3  # contraction operand prologues are recomputed once per output tile
#: a prologue reading two operand-sized buffers (`dropout_backward(g) = g * mask * 1/(1-p)`) is
#: realised where its product re-reads the operand for more than this many output columns
MAX_WIDE_PROLOGUE_COLUMNS = 128
#: a link of a chain of shared bodies is realised from this many elements on; a smaller one
#: once its body reads MAX_CHAIN_READS buffers (below that, recomputing the chain costs less
#: than the launch and the buffer realising it would add)
MIN_CHAIN_LINK_NUMEL = 1 << 16
MAX_CHAIN_READS = 6


def is_contraction_like(node) -> bool:
    return isinstance(node, Reduce) and node.combiner == SUM and isinstance(node.body, Binary) and node.body.op == "mul"


def _costly(body: Expr) -> bool:
    return any(isinstance(e, Unary) and e.op in TRANSCENDENTAL for e in walk(body))


def compute_cost(e: Expr, limit: int | None = None) -> int:
    """What computing `e` once costs, as a tree (a shared subtree counts at each use, as a
    kernel that inlines it computes it): 1 per operation, TRANSCENDENTAL_COST per
    transcendental unary one (a binary `pow` or `atan2` counts 1, as `_costly` ignores them
    too). Past `limit`, the count stops and returns more than `limit`."""
    cost = 0
    for n in walk(e):
        if isinstance(n, Unary) and n.op in TRANSCENDENTAL:
            cost += TRANSCENDENTAL_COST
        elif isinstance(n, (Unary, Binary, Where)):
            cost += 1
        else:
            continue
        if limit is not None and cost > limit:
            break
    return cost


class Inliner:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.users = graph.users()
        self.inlined: set[str] = set()
        self.reasons: dict[str, str] = {}
        self._bodies: dict[str, Expr] = {}
        self._rounded: dict[str, Expr] = {}  # bodies whose explicit narrowing conversions are still loads
        self._as_eager: dict[str, Expr] = {}  # the same with every op's own rounding kept (compared values)
        outputs = set(graph.output_names())
        costly_prologues: list[str] = []
        extern_read = set()
        for n in graph.nodes.values():
            if isinstance(n, (Extern, ExternResult)):
                extern_read |= n.inputs()
        for node in graph.nodes.values():
            if not isinstance(node, Pointwise):
                continue
            body = self.body(node.name)
            users = self.users[node.name]
            if node.name in outputs:
                self.reasons[node.name] = "graph output"
            elif node.name in extern_read:
                self.reasons[node.name] = "read by an extern call"
            elif narrowing_conversion(node) and isinstance(self.graph[node.body.x.buffer], Reduce) \
                    and len(self.users[node.body.x.buffer]) == 1 and _reads_in_order(node, self.graph):
                # bf16(acc) of a kernel's fp32 result: its producer stores it narrow (half the
                # bytes) instead of every consumer reading the fp32 result and rounding it
                self.reasons[node.name] = "narrowing conversion of a kernel result: stored by its producer"
            elif self._feeds_contraction(node.name) and (count_ops(body) > MAX_PROLOGUE_OPS or _costly(body)):
                self.reasons[node.name] = "costly prologue of a contraction: computed once, in its producer's kernel"
                costly_prologues.append(node.name)
            elif self._feeds_contraction(node.name) and self._wide_prologue(node):
                self.reasons[node.name] = ("prologue of a contraction reading several operand-sized buffers: computed "
                                           "once, in its producer's kernel, not re-read per tile of output columns")
                costly_prologues.append(node.name)
            elif self._feeds_contraction(node.name) and self._epilogue_of_contraction(node):
                self.reasons[node.name] = ("epilogue of a contraction and operand of another: stored once by its "
                                           "producer, not recomputed per tile of the second product")
            elif len(users) > 1 and compute_cost(body, MAX_SHARED_OPS) > MAX_SHARED_OPS:
                self.reasons[node.name] = (f"{len(users)} consumers would recompute {count_ops(body)} ops "
                                           f"(cost {compute_cost(body)})")
            elif not users:
                self.reasons[node.name] = "unused"
            else:
                self.inlined.add(node.name)
        self._break_shared_chains()
        self._store_rounded_products_before_reductions()
        self._store_narrow_prologues(costly_prologues)
        self._store_rounded_operands()

    def _store_rounded_products_before_reductions(self) -> None:
        """A product's rounded result — `bf16(x @ wᵀ + b)`, eager's `addmm` — that would be
        inlined into a reduction (BERT's `LayerNorm(dense(h) + h)`) is stored by the product's
        kernel instead, as eager's `addmm` stores it: inlined, the product plan stores its fp32
        sum (twice the bytes, read back by the norm) and, with bf16 operands and an fp32
        result, no library product can run it. Where the rounded value feeds a stored sum
        (a residual stream that the product's kernel writes as its epilogue) or another product
        (attention's scores, which a flash kernel keeps in registers) it stays inlined."""
        moved = False
        for node in self.graph.nodes.values():
            name = node.name
            if name not in self.inlined or not _rounded_product(node, self.graph, self.users):
                continue
            ends = self._inlined_ends(name)
            if "reduction" in ends and "product" not in ends:  # (attention's scores feed a product: flash)
                self.inlined.discard(name)
                self.reasons[name] = ("rounded result of a product read by a reduction: stored narrow by the "
                                      "product's kernel (eager's addmm), not its fp32 sum")
                moved = True
        if moved:
            self._forget_bodies()

    def _inlined_ends(self, name: str) -> set:
        """What the chains of inlined consumers of the node end in: "reduction" (one that is not
        a product), "product", or "stored" (a realised node, an extern)."""
        ends, seen, todo = set(), set(), [name]
        while todo:
            for u in self.users[todo.pop()]:
                if u in seen:
                    continue
                seen.add(u)
                user = self.graph[u]
                if isinstance(user, Reduce):  # (a variance's sum of squares is no product)
                    product = is_contraction_like(user) and user.body.a != user.body.b
                    ends.add("product" if product else "reduction")
                elif isinstance(user, Pointwise) and u in self.inlined:
                    todo.append(u)
                else:
                    ends.add("stored")
        return ends

    def _break_shared_chains(self) -> None:
        """Realise each link of a chain of shared bodies: a node read by several consumers, one
        of which is the next link (`_links_on`), whose body reads two or more full-size buffers.
        Inlined, such a chain grows by a link per layer of a residual stream
        (`h1 = h0 + a1`, `h2 = h1 + m1`, ...: each read by its norm and by the next link), and
        every norm re-reads all earlier layers' outputs; realised, each link is written once
        (by its product's kernel as an epilogue, where it reads one) and read once per
        consumer. A small link (under MIN_CHAIN_LINK_NUMEL elements) is realised only once its
        body reads MAX_CHAIN_READS buffers. Links are decided in graph order, so a realised
        link ends the next one's body."""
        realised = False
        for node in self.graph.nodes.values():
            name = node.name
            users = self.users[name]
            if name not in self.inlined or len(users) < 2 or not self._links_on(node):
                continue
            if realised:
                self._forget_bodies()
                realised = False
            size = _static_numel(node)
            reads = self._full_size_reads(name, size)
            small = size is not None and size < MIN_CHAIN_LINK_NUMEL
            if reads < 2 or (small and reads < MAX_CHAIN_READS):
                continue
            self.inlined.discard(name)
            self.reasons[name] = ("a link of a chain of shared bodies (a residual stream): realised once, "
                                  "not recomputed by every later consumer of the chain")
            realised = True
        if realised:
            self._forget_bodies()

    def _links_on(self, node) -> bool:
        """One of the node's consumers is the next link of a chain: itself an inlined shared
        body, of the node's shape, reading it element for element. A mask's bias shared by
        every layer's scores (another shape, read per head) is no link, nor is any body that
        selects a mask's fill: the attention kernel recomputes a mask from its formula to skip
        what it masks."""
        if _selects_a_fill(self.graph[node.name].body):
            return False
        own = tuple(out_index(node.rank))
        for u in self.users[node.name]:
            user = self.graph[u]
            if u not in self.inlined or len(self.users[u]) < 2 or tuple(user.shape) != tuple(node.shape):
                continue
            if any(isinstance(e, Load) and e.buffer == node.name
                   and tuple(getattr(i, "expr", None) for i in e.index) == own for e in walk(user.body)):
                return True
        return False

    def _full_size_reads(self, name: str, size, share: int = 8) -> int:
        """How many distinct buffers the node's inlined body reads that are at least a
        `share`-th of its size (by default an eighth: a bias or a norm's weight re-read costs
        little); unknown sizes count."""
        count = 0
        for buffer in {e.buffer for e in walk(self.body(name)) if isinstance(e, Load)}:
            if buffer not in self.graph.nodes:
                count += 1
                continue
            other = _static_numel(self.graph[buffer])
            if size is None or other is None or share * other >= size:
                count += 1
        return count

    def _store_narrow_prologues(self, costly_prologues: list[str]) -> None:
        """A costly prologue whose one consumer rounds it to bf16/fp16 (autocast's gradient of
        a language model's logits, before its two products; the attention probabilities a
        training forward saves in bf16): the rounded value is realised instead, by the same
        kernel — half the bytes written, and read by each product — and the wide one is
        inlined into it (when the rounded value is realised anyway, as a graph output, the
        wide one is simply not stored). The products read what they read before."""
        moved = False
        for name in costly_prologues:
            users = self.users[name]
            if len(users) != 1:
                continue
            conversion = self.graph[next(iter(users))]
            if not (narrowing_conversion(conversion) and conversion.body.x.buffer == name
                    and _reads_in_order(conversion, self.graph)):
                continue
            del self.reasons[name]
            self.inlined.add(name)
            if conversion.name in self.inlined:
                self.inlined.discard(conversion.name)
                self.reasons[conversion.name] = "narrowing conversion of a costly prologue: stored narrow by its producer"
            moved = True
        if moved:
            self._forget_bodies()

    def _store_rounded_operands(self) -> None:
        """`bf16(x)` of a realised fp32 `x` that a product reads (autocast's rounding of a
        residual stream's gradient before the products of the layer below) is stored once, by
        the reduction or product kernel that computes `x` (a norm's row pass; a product's
        epilogue), instead of being inlined into each product: a library product would convert
        it with a copy kernel of its own per call (two or three per layer), and a generated one
        re-reads the fp32 tensor once per output tile where the bf16 copy is half the bytes.
        Where no such kernel computes `x` (an input, an extern's result, a pointwise kernel's
        output) the conversion stays inlined: stored, it would be a kernel of its own. So does
        one that reorders `x` (not its kernel's epilogue)."""
        moved = False
        for node in self.graph.nodes.values():
            name = node.name
            if name not in self.inlined or not narrowing_conversion(node):
                continue
            source = node.body.x.buffer
            if (source in self.inlined or not self._in_a_reduction_kernel(source)
                    or not any(is_contraction_like(self.graph[u]) for u in self.users[name])
                    or not _reads_in_order(node, self.graph)):
                continue
            self.inlined.discard(name)
            self.reasons[name] = "rounded operand of a product: stored narrow by its source's kernel, read by each product"
            moved = True
        if moved:
            self._forget_bodies()

    def _in_a_reduction_kernel(self, name: str) -> bool:
        """Whether a reduction's or a product's kernel computes the node, so that a conversion
        of it can be one more store there: a reduction, or a pointwise node whose body reads
        one (a norm's output, stored by the row pass; a product's epilogue)."""
        node = self.graph.nodes.get(name)
        if isinstance(node, Reduce):
            return True
        return isinstance(node, Pointwise) and any(
            isinstance(e, Load) and isinstance(self.graph.nodes.get(e.buffer), Reduce) for e in walk_unique(self.body(name)))

    def _feeds_contraction(self, name: str) -> bool:
        """A contraction reads the node, directly or through conversions of it (`float32(x)` of a
        bf16 `x`: the bf16 tensor is realised, its upcast stays an exact operand of the dot)."""
        for u in self.users[name]:
            user = self.graph[u]
            if is_contraction_like(user):
                return True
            if _conversion_of(user, name) and self._feeds_contraction(u):
                return True
        return False

    def _wide_prologue(self, node) -> bool:
        """A product re-reads its operand once per tile of output columns; inlined there, a
        body that reads two or more operand-sized buffers (a dropout's backward: the gradient
        and the mask; a sum of two streams) multiplies that traffic, where stored once (narrow,
        by the kernel that computes it) each re-read is one narrow tensor. This holds however
        few operations the body has — a stored input gradient makes the dropout after it a
        three-operation body, where an inlined one makes it a costly prologue, and BERT's
        layers recomputed it in both FFN products or stored it as their neighbours had decided.
        A product with few output columns (one tile's worth; a row sum such as a softmax's
        backward has one) reads the operand about once, and keeps the prologue. Only static
        sizes are judged: with symbolic ones neither count is known, and the rule stays out."""
        size = _static_numel(node)
        if size is None or self._full_size_reads(node.name, size, share=1) < 2:
            return False
        return any(columns is not None and columns > MAX_WIDE_PROLOGUE_COLUMNS
                   for columns in self._output_columns(node))

    def _output_columns(self, node):
        """For each contraction reading the node (directly or through conversions): how many
        output elements each operand element contributes to, the product's extent on its
        other side (None: not static)."""
        size = _static_numel(node)
        for u in self.users[node.name]:
            user = self.graph[u]
            if is_contraction_like(user):
                out, k = _static_numel(user), user.reduction_numel
                yield (out * int(k) // size) if size and out is not None and getattr(k, "is_Integer", False) else None
            elif _conversion_of(user, node.name):
                yield from self._output_columns(user)

    def _epilogue_of_contraction(self, node) -> bool:
        """The node reads a contraction's result (a product's bias add, scale or activation)."""
        return any(is_contraction_like(self.graph[e.buffer]) for e in walk(node.body)
                   if isinstance(e, Load) and e.buffer in self.graph.nodes)

    def _forget_bodies(self) -> None:
        """Drop the inlined bodies worked out so far: a node realised since then ends them."""
        self._bodies.clear()
        self._rounded.clear()
        self._as_eager.clear()

    def body(self, name: str) -> Expr:
        """The node's body with every inlined producer substituted."""
        if name not in self._bodies:
            body = self._substitute_rest(self._with_rounding(name))
            ranges = _index_ranges(self.graph[name])
            for e in walk(body):  # indices an op produced lie in its range (`stored_values`)
                if isinstance(e, Load) and (VALUES, e.buffer) not in ranges and e.dtype.is_int:
                    known = stored_values(self.graph, e.buffer)
                    if known is not None:
                        ranges[(VALUES, e.buffer)] = known
            self._bodies[name] = prune_checks(body, ranges)
        return self._bodies[name]

    def expr(self, e: Expr) -> Expr:
        """Any expression a node reads (a scatter's values and positions) with every inlined
        producer substituted, as `body` does for a node's own body."""
        return self._substitute_rest(self._substitute_rounded(e))

    def _with_rounding(self, name: str) -> Expr:
        """The inlined body before explicit narrowing conversions (`x.to(bfloat16)`) are
        substituted: they stay loads while `skip_intermediate_rounding` runs, because their
        rounding is what they are for (fake quantisation, overflow checks); only the rounding
        an op applies to its own result is skipped between fused ops."""
        if name not in self._rounded:
            node = self.graph[name]
            if is_contraction_like(node):
                f = node.body
                self._rounded[name] = f.rebuild((self._factor(f.a), self._factor(f.b)))
            else:
                self._rounded[name] = self._substitute_rounded(node.body)
        return self._rounded[name]

    def _factor(self, f: Expr) -> Expr:
        """A product's factor with inlined producers substituted; the upcast of a low-precision
        producer (`float32(q)` of a bf16 `q = x + b`) keeps that producer's rounding, so the
        dot reads the operands eager reads."""
        if (isinstance(f, Cast) and isinstance(f.x, Load) and f.x.dtype.is_low_precision
                and f.x.buffer in self.inlined and not explicit_conversion(self.graph, f.x.buffer)):
            return Cast(self._substitute_rounded(f.x), f.dtype)
        return self._substitute_rounded(f)

    def _substitute_rounded(self, e: Expr) -> Expr:
        """`e` with inlined producers other than explicit narrowing conversions substituted,
        intermediate rounding skipped — except in the operands of a comparison, whose producers
        keep every rounding eager applies (`_eager_rounded`): a comparison is exact, and an
        operand computed from unrounded values may tie where eager's differ."""
        out = self._substituted(e, False, {})
        return skip_intermediate_rounding(out) if out is not e else out

    def _substituted(self, e: Expr, compared: bool, memo: dict) -> Expr:
        key = (e, compared)
        if key in memo:
            return memo[key]
        if isinstance(e, Load) and e.buffer in self.inlined and not explicit_conversion(self.graph, e.buffer):
            body = self._eager_rounded(e.buffer) if compared else self._with_rounding(e.buffer)
            out = self._at(body, e)
        else:
            inner = compared or isinstance(e, Binary) and e.op in COMPARISONS
            kids = e.children()
            new = tuple(self._substituted(k, inner, memo) for k in kids)
            out = e.rebuild(new) if kids and new != kids else e
        memo[key] = out
        return out

    def _eager_rounded(self, name: str) -> Expr:
        """The inlined body as eager computes it: each producer's own rounding kept."""
        if name not in self._as_eager:
            node = self.graph[name]
            if is_contraction_like(node):
                self._as_eager[name] = self._with_rounding(name)
            else:
                self._as_eager[name] = self._substituted(node.body, True, {})
        return self._as_eager[name]

    def _substitute_rest(self, e: Expr) -> Expr:
        """`e` with the remaining inlined producers (explicit conversions) substituted."""
        def fn(n):
            if isinstance(n, Load) and n.buffer in self.inlined:
                return self._at(self.body(n.buffer), n)
            return None

        return transform(e, fn)

    def _at(self, body: Expr, load: Load) -> Expr:
        """A producer's body at the index `load` reads it."""
        return substitute_index(body, dict(zip(out_index(self.graph[load.buffer].rank), load.index)))


def _rounded_product(node, graph: Graph, users: dict) -> bool:
    """`bf16(f(p))` of a product `p` that only this node reads, at the node's own index, and
    of smaller operands (a bias): eager's rounded `addmm` result."""
    body = node.body if isinstance(node, Pointwise) else None
    if not (isinstance(body, Cast) and body.dtype.is_low_precision and body.x.dtype.is_float):
        return False
    loads = [e for e in walk(body.x) if isinstance(e, Load)]
    products = [e for e in loads if e.buffer in graph.nodes and is_contraction_like(graph[e.buffer])]
    if len(products) != 1 or len(users[products[0].buffer]) != 1:
        return False
    product = graph[products[0].buffer]
    if not _has_a_weight(product):
        return False  # (attention's scores: both factors vary with the batch; a flash kernel keeps them)
    own = tuple(out_index(node.rank))
    if tuple(product.shape) != tuple(node.shape) or tuple(getattr(c, "expr", None) for c in products[0].index) != own:
        return False
    size = _static_numel(node)
    for e in loads:
        if e is products[0] or e.buffer == product.name:
            continue
        other = _static_numel(graph[e.buffer]) if e.buffer in graph.nodes else None
        if size is None or other is None or other * 8 > size:
            return False  # another full-size operand: not a bias
    return True


def _has_a_weight(product) -> bool:
    """One factor of the product reads the same values for every output row: a linear layer's
    weight, indexed by the reduction and the output's last dim only."""
    shared = {*red_index(len(product.ranges)), out_index(product.rank)[-1]}
    for factor in (product.body.a, product.body.b):
        indices = [e for e in walk(factor) if isinstance(e, Index)]
        if indices and any(isinstance(e, Load) for e in walk(factor)) and all(
                sympy.sympify(e.expr).free_symbols <= shared for e in indices):
            return True
    return False


def _selects_a_fill(body: Expr) -> bool:
    """The body selects -inf or a mask's finite fill somewhere (`fusion.masking`)."""
    from .masking import SOFT_FILL_LIMIT, _fill

    return any(isinstance(e, Where) and (_fill(e.a, SOFT_FILL_LIMIT) is not None
                                         or _fill(e.b, SOFT_FILL_LIMIT) is not None) for e in walk(body))


def _static_numel(node) -> int | None:
    total = 1
    for d in node.shape:
        if not getattr(d, "is_Integer", isinstance(d, int)):
            return None
        total *= int(d)
    return total


def _index_ranges(node) -> dict:
    """Each index symbol of the node's body -> its extent (for the checks `prune_checks` drops:
    an index built from these is in range for every element)."""
    ranges = dict(zip(out_index(node.rank), node.shape))
    if isinstance(node, Reduce):
        ranges.update(zip(red_index(len(node.ranges)), node.ranges))
    return ranges


def narrowing_conversion(node) -> bool:
    """A node that only converts a wider float to bfloat16/float16: `x.to(dtype)`."""
    body = node.body
    return (isinstance(node, Pointwise) and isinstance(body, Cast) and body.dtype.is_low_precision
            and isinstance(body.x, Load) and body.x.dtype.is_float and not body.x.dtype.is_low_precision)


#: the ATen ops (short names, `ir.identifiers.short_op_name`) a program converts dtypes with:
#: `x.to(bfloat16)`, `.bfloat16()`, `.type_as(y)`, autocast's casts
_CONVERSION_OPS = frozenset({"to_copy", "convert_element_type", "copy"})


def explicit_conversion(graph: Graph, name: str) -> bool:
    """A narrowing conversion the program wrote (or of unknown origin), whose rounding is what
    it is for. One a decomposition made to round an op's own result (`logsumexp` computed in
    float32 and converted back to bfloat16) is that op's rounding, skipped between fused ops
    like any other: kept, it met an unrounded operand (`x - logsumexp(x)` over one element
    gave -5e-4 where eager and fp64 give 0)."""
    if not narrowing_conversion(graph[name]):
        return False
    ops = graph.origins.get(name).ops if name in graph.origins else ()
    return not ops or any(op in _CONVERSION_OPS for op in ops)


def _conversion_of(node, name: str) -> bool:
    """A pointwise node that only converts `name` to another float dtype: at its own index, or
    an exact upcast read through a view (`float32(q.transpose(1, 2))` of a bf16 `q`, as an
    attention's decomposition reads its operands)."""
    body = node.body if isinstance(node, Pointwise) else None
    if not (isinstance(body, Cast) and body.dtype.is_float and isinstance(body.x, Load) and body.x.buffer == name
            and body.x.dtype.is_float):
        return False
    if float_widens(body.x.dtype, body.dtype) and all(isinstance(c, Index) for c in body.x.index):
        return True
    return len(body.x.index) == node.rank and all(
        isinstance(c, Index) and c.expr == s for c, s in zip(body.x.index, out_index(node.rank)))


def _reads_in_order(node, graph: Graph) -> bool:
    """`node` reads its one source element by element in the order it stores (a reshape at
    most): computed in the source's kernel, it is that kernel's epilogue."""
    from ..ir.symbolic import bounds, simplify_index

    load = node.body.x
    src = graph[load.buffer]
    if not all(isinstance(c, Index) for c in load.index):
        return False

    def flat(index, shape):
        out = sympy.Integer(0)
        for i, d in zip(index, shape):
            out = out * sympy.sympify(d) + i
        return out

    outs = out_index(node.rank)
    ranges = dict(zip(outs, (sympy.sympify(d) for d in node.shape)))
    diff = simplify_index(sympy.expand(flat([c.expr for c in load.index], src.shape) - flat(outs, node.shape)), ranges)
    if diff == 0:
        return True
    try:
        return tuple(bounds(diff, ranges)) == (0, 0)  # terms of extent-1 dims only
    except Exception:  # noqa: BLE001 - symbolic extents the bounds cannot evaluate
        return False
