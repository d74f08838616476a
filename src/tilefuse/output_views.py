"""Outputs that are views: found in the graph, compiled as their bases, rebuilt after the call.

A graph may return views: of an input, of another output, or of an intermediate value (a
training forward returns the transposed weights and activations its backward multiplies by).
AOTAutograd rebuilds views of inputs and outputs from their base after the call, replaying the
view — or, when the view has symbolic arguments (`x.narrow(-1, 1, x.shape[-1] - 1)` under
`dynamic=True`), by `base.as_strided(out.size(), out.stride(), out.storage_offset())` of the
compiled output. The compiled graph returns fresh buffers, so these outputs must be given back
as the views they are; and a kernel that copies what a view gives for free is wasted work.

`find` lists them, `compiled_as_bases` is the graph to compile (each such output returns its
base), a `Rebuilder` makes the views after each call.
"""
from __future__ import annotations

import functools
import operator
from typing import Any, NamedTuple

import torch

from .frontend.context import dense_layout
from .runtime.aten_matmul import REINTERPRETS_AS_NEW, _reinterpret

aten = torch.ops.aten

#: ops whose result is a view of their first argument, with strides derived from its strides
VIEW_OPS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.alias.default, aten.permute.default, aten.t.default,
    aten.transpose.int, aten.expand.default, aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.slice.Tensor, aten.select.int,
})


#: ops whose pieces (`operator.getitem` of the result) are views of their first argument
SPLIT_OPS = frozenset({aten.split.Tensor, aten.split_with_sizes.default})


class OutputView(NamedTuple):
    """Output `index` is `base`'s storage viewed with `sizes`, `strides`, `offset` (sympy). `kind`:
    "input" (base: a placeholder's position) or "output" (base: an output's position — the
    output itself when the graph returns an intermediate value's view: then `base_node` is
    that value, which the compiled graph returns in the view's place)."""
    index: int
    kind: str
    base: int
    sizes: tuple
    strides: tuple
    offset: Any
    base_node: str | None = None
    #: the view ops to replay on the base, when the view was found as a chain of them (the
    #: base's layout at run time may differ from the traced one: padded rows), else ()
    replay: tuple = ()
    #: the compiled graph returns the base in the view's place (not when the view's sizes depend
    #: on data: then the graph computes the view itself, an ATen call returning it)
    as_base: bool = True
    #: the base's strides as traced (sympy): `sizes`/`strides`/`offset` are relative to them
    #: (views made by strides; replayed ones need none)
    base_strides: tuple = ()


def _storage(val):
    from torch.multiprocessing.reductions import StorageWeakRef

    try:
        return StorageWeakRef(val.untyped_storage()) if isinstance(val, torch.Tensor) else None
    except Exception:  # noqa: BLE001 - tensors without storage (sparse, ...) alias nothing
        return None


def _view_chain(node):
    """(base, ops) when `node` is a chain of view ops with constant arguments from `base`
    (`ops`: (op, arguments after the first) in the order they apply), else (None, ())."""
    ops = []
    base = node
    while isinstance(base, torch.fx.Node) and base.op == "call_function":
        if base.target in VIEW_OPS:
            rest = tuple(base.args[1:])
        elif base.target is operator.getitem and isinstance(base.args[0], torch.fx.Node) \
                and base.args[0].op == "call_function" and base.args[0].target in SPLIT_OPS:
            ops.append((operator.getitem, tuple(base.args[1:])))  # a piece of `split`: a slice
            base = base.args[0]
            rest = tuple(base.args[1:])
        else:
            break
        if base.kwargs or not _constant(rest):
            return None, ()
        ops.append((base.target, rest))
        base = base.args[0]
    if base is node or not isinstance(base, torch.fx.Node):
        return None, ()
    return base, tuple(reversed(ops))


def _constant(args) -> bool:
    if isinstance(args, (list, tuple)):
        return all(_constant(a) for a in args)
    return args is None or (isinstance(args, (int, float, bool)) and not isinstance(args, torch.SymInt))


def _is_base(val) -> bool:
    """Whether a tensor can be the base others view: its own storage, from offset 0, all of it."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    # a data-dependent offset (a column of `nonzero`'s result: u0) may be nonzero
    return isinstance(val, torch.Tensor) and guard_or_false(val.storage_offset() == 0) \
        and not val._is_view() and _covers_storage(val)


def _not_larger(base, views) -> bool:
    """Whether materialising `base` writes no more than materialising its `views` (a slice of
    a large intermediate is better copied than the intermediate kept whole; `split`'s pieces
    together are the whole)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(base.numel() <= sum(v.numel() for v in views))


def _data_dependent(val) -> bool:
    """Whether a view's sizes, strides or offset depend on data (`nonzero`'s count): they are
    not known from the call's arguments, so the view could not be made after the call."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return any(isinstance(x, torch.SymInt) and free_unbacked_symbols(x)
               for x in (*val.shape, *val.stride(), val.storage_offset()))


def find(gm: torch.fx.GraphModule, structural_from: int | None = None,
         sole_views_from: int | None = None) -> list[OutputView]:
    """The outputs of `gm` that are views, with their bases. Two ways to know: the meta values
    share storage (views AOTAutograd recorded), or — for outputs from position
    `structural_from` on (None: none) — the output is a chain of view ops (`VIEW_OPS`) from a
    placeholder, an output, or intermediate values no larger than their views together.

    The second kind is not a view to AOTAutograd, so it is made only where nothing but
    tilefuse reads it: the tensors a training forward saves for its backward (a user's output
    made a view would refuse in-place ops, or share memory with a saved tensor), and the
    outputs of an inference graph. From `sole_views_from` on (a backward's gradients), an
    output that is the only view of an intermediate value no larger than it is made from that
    value too: its storage is its own, as a fresh tensor's is, so nothing can tell it from the
    copy a kernel would make (eager returns the same view: the gradient of `k` in
    `q @ k.transpose(-1, -2)` is the transposed product)."""
    from .frontend.context import sym_expr

    def strides_of(val):
        return tuple(sym_expr(st) for st in val.stride())

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs: dict = {}
    for k, node in enumerate(placeholders):
        ref = _storage(node.meta.get("val"))
        if ref is not None:
            inputs.setdefault(ref, k)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = out_node.args[0] if isinstance(out_node.args[0], (list, tuple)) else (out_node.args[0],)
    vals: list[Any] = [o.meta.get("val") if isinstance(o, torch.fx.Node) else None for o in outs]
    refs = [_storage(val) for val in vals]
    owners: dict = {}  # storage -> index of the first output that is not a view
    first_output: dict = {}  # node -> index of the first output that returns it
    for k, (node, val, ref) in enumerate(zip(outs, vals, refs)):
        if ref is not None and ref not in inputs and _is_base(val):
            owners.setdefault(ref, k)
        if isinstance(node, torch.fx.Node):
            first_output.setdefault(node, k)
    found, of_values = [], {}  # of_values: intermediate value -> [(k, val, replay)] viewing it
    for k, (node, val, ref) in enumerate(zip(outs, vals, refs)):
        if ref is None:
            continue
        replay, base_strides = (), ()
        if ref in inputs and placeholders[inputs[ref]].meta["val"].dtype == val.dtype:
            kind, base = "input", inputs[ref]
            base_strides = strides_of(placeholders[base].meta["val"])
        elif ref in owners and owners[ref] != k and vals[owners[ref]].dtype == val.dtype:
            kind, base = "output", owners[ref]
            base_strides = strides_of(vals[base])
        elif sole_views_from is not None and k >= sole_views_from and ref not in inputs \
                and not (ref in owners and owners[ref] != k):
            start, replay = _view_chain(node)
            if start is not None and start.op == "call_function" and start not in first_output \
                    and _is_base(start.meta.get("val")) and not _data_dependent(val):
                of_values.setdefault(start, []).append((k, val, replay))
            continue
        elif ref in inputs or (ref in owners and owners[ref] != k) or structural_from is None \
                or k < structural_from:
            continue  # (a view that reinterprets the dtype is computed by the graph)
        else:  # replayed on the base: no strides needed
            start, replay = _view_chain(node)
            if start is None or not _is_base(start.meta.get("val")) or _data_dependent(val):
                continue
            if start.op == "placeholder":
                kind, base = "input", placeholders.index(start)
            elif start in first_output and first_output[start] != k:
                kind, base = "output", first_output[start]
            else:
                if start.op == "call_function":
                    of_values.setdefault(start, []).append((k, val, replay))
                continue
        found.append(OutputView(k, kind, base, tuple(sym_expr(d) for d in val.shape), strides_of(val),
                                sym_expr(val.storage_offset()), None, replay,
                                as_base=not _data_dependent(val), base_strides=base_strides))
    for start, views in of_values.items():
        sole = sole_views_from is not None and views[0][0] >= sole_views_from
        if sole and len(views) > 1:
            continue  # (two gradients sharing a storage: accumulating into one would change the other)
        if _not_larger(start.meta["val"], [val for _, val, _ in views]):
            found += [OutputView(k, "output", k, (), (), 0, start.name, replay) for k, val, replay in views]
    # made in this order: views replayed on their bases first (another output may view one)
    return sorted(found, key=lambda v: (not v.replay, v.index))


def compiled_as_bases(gm: torch.fx.GraphModule, views: list[OutputView]) -> torch.fx.GraphModule:
    """The graph to compile: each output that is a view returns its base instead (an input,
    another output, or the intermediate value it views), which `rebuild` then views, so that
    no kernel copies what a view gives for free."""
    views = [v for v in views if v.as_base]
    if not views:
        return gm
    graph = torch.fx.Graph()
    val_map: dict = {}
    copied = graph.graph_copy(gm.graph, val_map)
    single = not isinstance(copied, (list, tuple))
    outs = [copied] if single else list(copied)
    placeholders = [val_map[n] for n in gm.graph.nodes if n.op == "placeholder"]
    by_name = {n.name: val_map[n] for n in gm.graph.nodes if n in val_map}
    for v in views:
        if v.base_node is not None:
            outs[v.index] = by_name[v.base_node]
        elif v.kind == "input":
            outs[v.index] = placeholders[v.base]
        else:
            outs[v.index] = outs[v.base]
    graph.output(outs[0] if single else tuple(outs) if isinstance(copied, tuple) else outs)
    return torch.fx.GraphModule(gm, graph)


def _covers_storage(val) -> bool:
    """Whether a tensor holds every element of its storage (a strided slice of an intermediate,
    as `unbind` gives, does not: it cannot be the base that other outputs are views of): a
    dense layout as large as the storage. `v[..., ::2]` of a (1, 3) value spans all 3
    elements' bytes but holds 2, and a view of the value made from it read the skipped one
    unwritten. With symbolic sizes: its extent and element count reach the storage's size and
    no dim repeats elements by a zero stride."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    nbytes = val.untyped_storage().nbytes()
    sizes = (*val.shape, *val.stride(), nbytes)
    if any(isinstance(x, torch.SymInt) for x in sizes):
        # symbolic: decided without guards (reading the sizes would specialise them), and only
        # when provable — a piece of `split` under `dynamic=True` is a slice of its storage
        extent = 1 + sum((d - 1) * st for d, st in zip(val.shape, val.stride()))
        return statically_known_true(extent * val.element_size() >= nbytes) \
            and statically_known_true(val.numel() * val.element_size() >= nbytes) \
            and all(statically_known_true(st != 0) or statically_known_true(d <= 1)
                    for d, st in zip(val.shape, val.stride()))
    if any(int(d) == 0 for d in val.shape):
        return True
    # dense: no element twice and none skipped (an unfold of an unfold can repeat and skip)
    return dense_layout(val.shape, val.stride()) and val.numel() * val.element_size() >= int(nbytes)


def rebuild(views: list[OutputView], compiled, args, out) -> list:
    """The call's outputs with each view made from its base (after the call): `Rebuilder`,
    once."""
    return Rebuilder(views)(compiled, args, out)


class Rebuilder:
    """Makes one graph's output views after each call. A base laid out otherwise than traced
    (rows padded for the library) is read through its values: views replayed on it (on a
    contiguous copy where `view` refuses its strides), and a view made by strides from a copy
    laid out as traced.

    What repeats is worked out once: a static view's layout when the rebuilder is made (a
    training forward returns some thirty views, each call), and a replayed view's layout per
    layout of its base, after which the view is made by strides (`as_strided`) instead of
    replaying its ops through the dispatcher.

    From output `private_from` on (the tensors a training forward saves), a view of storage
    nothing but these outputs holds (an intermediate value, or another of them: not an input
    or an output the caller sees) is made as Inductor's generated code makes it: a tensor of
    its own over that storage, without the dispatcher, not a view (0.6 µs against
    as_strided's 1.2, and the forward's saving needs no detach). Nothing can tell the two
    apart there: no other tensor shares its version counter or could be written in place.
    `gradients` (a backward's outputs, `private_from` 0): only a gradient that is the sole
    view of an intermediate value — two gradients over one storage stay a view and its base,
    which `AccumulateGrad` copies rather than keeps (kept, two parameters' `.grad` would share
    memory)."""

    def __init__(self, views: list[OutputView], private_from: int | None = None, gradients: bool = False):
        self.views = list(views)
        self.static = [None if v.replay else _static_layout(v) for v in self.views]
        self.replays: dict = {}  # view position -> (its base's layout, the view's layout)
        self.private = _private_views(self.views, private_from, gradients)

    def __call__(self, compiled, args, out) -> list:
        from .ir.interpret import bind_symbols
        from .ir.symbolic import evaluate

        env = None  # the call's symbols, bound only for views made by strides whose layout has symbols
        out = list(out)
        for k, v in enumerate(self.views):
            src = args[v.base] if v.kind == "input" else out[v.base]
            if v.replay:
                out[v.index] = self._replayed(k, v, src, self.private[k])
                continue
            layout = self.static[k]
            if layout is None:
                if env is None:
                    env = bind_symbols(compiled.graph, args)
                try:
                    layout = _layout(v, lambda e: int(evaluate(e, env)))
                except KeyError:  # a data-dependent view (`narrow` at a tensor start): made by an ATen call
                    if _same_storage(out[v.index], src):
                        continue  # ... which returned the view itself
                    raise
            view, traced = layout
            if traced and _strides_differ(src, traced):
                src = torch.empty_strided(src.shape, traced, dtype=src.dtype, device=src.device).copy_(src)
            out[v.index] = _strided(src, view, self.private[k])
        return out

    def _replayed(self, k: int, v: OutputView, base, private: bool):
        key = (base.shape, base.stride(), base.storage_offset())
        known = self.replays.get(k)
        if known is not None and known[0] == key:
            return _strided(base, known[1], private)
        view = _replayed(base, v.replay)
        if _same_storage(view, base):  # (not a view of a contiguous copy)
            layout = (tuple(view.shape), view.stride(), view.storage_offset())
            self.replays[k] = (key, layout)
            if private:
                return _strided(base, layout, True)
        return view


def _private_views(views: list[OutputView], private_from: int | None, gradients: bool = False) -> list[bool]:
    """Per view, whether it may be made as a tensor of its own (`Rebuilder`): from position
    `private_from` on, over an intermediate value or (not among `gradients`) an output from
    there on, and not the base of a view the caller sees."""
    if private_from is None or not REINTERPRETS_AS_NEW:
        return [False] * len(views)
    seen = {v.base for v in views if v.kind == "output" and v.index < private_from}
    viewed = {v.base for v in views if v.kind == "output" and v.base != v.index}  # (outputs others view)

    def private(v: OutputView) -> bool:
        if v.index < private_from or v.kind != "output" or v.index in seen or v.base in seen:
            return False
        if gradients:
            return v.base_node is not None and v.base == v.index and v.index not in viewed
        return v.base >= private_from

    return [private(v) for v in views]


def _strided(base, layout: tuple, private: bool):
    """`base.as_strided(*layout)`, or where `private` the same sizes, strides and offset as a
    tensor of its own over the storage."""
    if private:
        sizes, strides, offset = layout
        return _reinterpret(base, sizes, strides, offset - base.storage_offset())
    return base.as_strided(*layout)


def _layout(v: OutputView, value) -> tuple:
    """((sizes, strides, offset) of the view, the base's traced strides), each entry `value(expr)`."""
    return ((tuple(value(d) for d in v.sizes), tuple(value(st) for st in v.strides), value(v.offset)),
            tuple(value(st) for st in v.base_strides))


def _static_layout(v: OutputView):
    """The view's layout (`_layout`) when it is the same for every call — static shapes, the
    usual case — worked out once instead of at every call; None when it holds a symbol."""
    try:
        return _static_layout_of(v)
    except TypeError:  # an unhashable field: evaluated at each call
        return None


@functools.lru_cache(maxsize=4096)
def _static_layout_of(v: OutputView):
    exprs = [*v.sizes, *v.strides, v.offset, *v.base_strides]
    static = all(isinstance(e, int) or getattr(e, "is_Integer", False) for e in exprs)
    return _layout(v, int) if static else None


def _replayed(base, ops):
    try:
        t = base
        for op, rest in ops:
            t = op(t, *rest)
        return t
    except RuntimeError:  # `view` of a base whose layout it cannot express (padded rows)
        if base.is_contiguous():
            raise
        return _replayed(base.contiguous(), ops)


def _strides_differ(t, traced) -> bool:
    return any(n != 1 and st != want for n, st, want in zip(t.shape, t.stride(), traced))


def _same_storage(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
