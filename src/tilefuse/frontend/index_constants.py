"""Captured tensors whose values are an index formula, computed from the indices instead of read.

Models keep masks and position tables as tensors made once: nanoGPT's
`register_buffer("bias", torch.tril(torch.ones(T, T)))`, an ALiBi distance `(j - i).float()`,
a sliding-window mask, `arange` tensors built outside the compiled function. Read from memory,
such a mask is data: attention can skip its dead tiles only through a run-time block summary,
and a bias table is loaded per tile (ALiBi's 4096×4096 distance for every head). As a formula it
is what `torch.where(j > i, ...)` written with indices is: block skipping decided when the
kernel is built, no mask loaded, a bias computed in registers.

`find` reads the values of each candidate once at compile time and fits one of two families
over the tensor's dims of more than one element (one or two of them, `r` and `k`):

- **affine**: `c + a·r + b·k` with integer coefficients, not constant (distances, positions);
- **band**: one value where `lo <= k - r <= hi` and another elsewhere, either bound possibly
  absent (`tril`, `triu`, sliding windows; bool, 0/1 or 0/-inf).

A fit counts only if the formula, evaluated by the very operations put into the graph, equals
the tensor exactly (`torch.equal`, and the signs of its zeros). Candidates are the tensors the
compiled code captures rather than takes as arguments — a module's buffers and attributes,
globals, closure cells; not a local of the frame, nor an item of a container reached from one
(`batch["mask"]`) — in graphs of static shapes, contiguous, not parameters, not inference
tensors (they keep no version), not written by the graph (any op that may mutate, conservatively
through any value made from them), not sharing memory with another input, and not returned
(as a view) by the graph.

`substituted` replaces the uses of each such input with the formula's nodes; the input stays a
graph input. `Guarded` makes the promise safe at run time: a call whose tensor is the one
verified, at the version verified (PyTorch bumps a tensor's version on every in-place write),
runs the substituted graph; any other tensor is verified again (one read of it and a wait for
the device), and one that no longer follows its formula — or that keeps changing — sends every
later call, with a warning, to a compile of the original graph, which reads the tensor (or, if
that compile fails, to the graph run eagerly). Writes that bypass the version counter
(`buffer.data.copy_(...)`, `buffer.data = ...`, writes through `.numpy()`, DLPack or another
tensor `set_` to its storage) are not seen: after
such a write, `torch._dynamo.reset()` or the `index_constants` knob off.
"""
from __future__ import annotations

import operator
import warnings
import weakref
from dataclasses import dataclass, replace

import torch

from .. import logs

aten = torch.ops.aten

#: larger tensors are not read at compile time (16 Mi elements: a 4096² table; verifying one
#: builds the formula at full size with int64 intermediates)
MAX_ELEMENTS = 1 << 24

#: tensors on an accelerator up to this size are fitted from a copy on the host: one copy and
#: one wait, where fitting on the device runs a dozen kinds of kernel for the first time in the
#: process (each loaded lazily: a warm first call spent 0.23 s fitting nanoGPT's two masks)
HOST_FIT_ELEMENTS = 1 << 22

#: verifications after the first before a guard gives up on its tensor (it changes every call)
MAX_RECHECKS = 4


@dataclass(frozen=True)
class IndexFormula:
    """The values of graph input `position`: `kind` "affine" with `terms` (c, a[, b]), or
    "band" with `terms` (lo, hi, inside, outside) (lo/hi None: no bound)."""

    position: int
    source: str
    shape: tuple
    dtype: torch.dtype
    device: torch.device
    dims: tuple  # the tensor's dims of more than one element (r, then k)
    kind: str
    terms: tuple

    def build(self, call):
        """The formula as a chain of ATen calls: `call(op, *args)` runs one (eagerly, or as a
        node of an FX graph), so the graph computes exactly what `evaluate` verified."""
        sizes = [self.shape[d] for d in self.dims]
        ranks = [call(aten.arange.start_step, 0, n, 1, dtype=torch.int64, device=self.device) for n in sizes]
        if len(ranks) == 2:
            ranks = [call(aten.view.default, ranks[0], [sizes[0], 1]), call(aten.view.default, ranks[1], [1, sizes[1]])]
        if self.kind == "affine":
            parts = [x if a == 1 else call(aten.mul.Tensor, x, a) for x, a in zip(ranks, self.terms[1:]) if a != 0]
            value = parts[0] if len(parts) == 1 else call(aten.add.Tensor, *parts)
            if self.terms[0] != 0:
                value = call(aten.add.Tensor, value, self.terms[0])
            if len(parts) < len(ranks):  # (a dim the values do not depend on)
                value = call(aten.clone.default, call(aten.expand.default, value, sizes),
                             memory_format=torch.contiguous_format)
            value = call(aten._to_copy.default, value, dtype=self.dtype)
        else:
            lo, hi, inside, outside = self.terms
            offset = call(aten.sub.Tensor, ranks[1], ranks[0])
            conds = ([call(aten.ge.Scalar, offset, lo)] if lo is not None else []) + \
                    ([call(aten.le.Scalar, offset, hi)] if hi is not None else [])
            cond = conds[0] if len(conds) == 1 else call(aten.logical_and.default, *conds) if conds else \
                call(aten.ge.Scalar, offset, -(sizes[0] + sizes[1]))
            if self.dtype == torch.bool:
                value = cond if inside else call(aten.logical_not.default, cond)
            else:
                value = call(aten.where.self, cond,
                             call(aten.scalar_tensor.default, inside, dtype=self.dtype, device=self.device),
                             call(aten.scalar_tensor.default, outside, dtype=self.dtype, device=self.device))
        return call(aten.view.default, value, list(self.shape))

    def evaluate(self) -> torch.Tensor:
        with torch.no_grad():
            return self.build(lambda op, *args, **kwargs: op(*args, **kwargs))

    def matches(self, t) -> bool:
        """Whether tensor `t` holds exactly this formula's values."""
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != self.shape or t.dtype != self.dtype \
                or t.device != self.device or not t.is_contiguous():
            return False
        with torch.no_grad():
            made = self.evaluate()
            if not torch.equal(made, t):
                return False
            # (equal counts -0.0 as 0.0; a table of signed zeros stays a table)
            return not t.dtype.is_floating_point or torch.equal(torch.signbit(made), torch.signbit(t))

    def describe(self) -> str:
        names = "rk"[:len(self.dims)]
        if self.kind == "affine":
            parts = [str(self.terms[0])] + [f"{a}·{n}" for a, n in zip(self.terms[1:], names)]
            return f"{self.source} = {' + '.join(parts)}"
        lo, hi, inside, outside = self.terms
        bounds = " and ".join(b for b in ((f"k - r >= {lo}" if lo is not None else ""),
                                          (f"k - r <= {hi}" if hi is not None else "")) if b) or "always"
        return f"{self.source} = {inside} where {bounds}, else {outside}"


def _source(node) -> str | None:
    """Where Dynamo found the input (`L['self']._buffers['bias']`, a module's or object's
    attribute, a global, a closure's cell), or None for a local of the compiled frame (an
    argument above all: a different tensor may come each call) or an item of a container
    reached from one (`L['batch']['mask']`: a dict of per-call data)."""
    arg = node.meta.get("grapharg")
    source = getattr(arg, "source", None)
    if source is None:
        return None
    from torch._dynamo import source as sources

    link = source
    while link is not None:
        if isinstance(link, sources.LocalSource) and link is source and not getattr(link, "is_derefed_cell_contents", False):
            return None
        if isinstance(link, (sources.GetItemSource, sources.DictGetItemSource)) \
                and not _module_container(getattr(link, "base", None)):
            return None
        link = getattr(link, "base", None)
    try:
        return source.name() if callable(source.name) else str(source.name)
    except Exception:  # noqa: BLE001 - a name is only for messages
        return type(source).__name__


def _module_container(base) -> bool:
    """Whether an item is taken from a module's own registry (`_buffers`, `_modules`, ...)."""
    from torch._dynamo import source as sources

    return isinstance(base, sources.AttrSource) and getattr(base, "member", "") in (
        "_buffers", "_modules", "_parameters")


def _written(gm: torch.fx.GraphModule) -> set:
    """Placeholders that an operation of the graph may write: every input reachable from a
    value an op writes (`setitem`'s target, an in-place op's first argument, an `out=`, the
    arguments a mutable ATen schema writes) — through any op, a conservative reading of views."""
    written = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_method", "call_function"):
            continue
        stack, seen = list(_write_targets(node)), set()
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            if x.op == "placeholder":
                written.add(x)
            stack.extend(x.all_input_nodes)
    return written


def _write_targets(node) -> list:
    """The graph values `node` may write."""
    target, targets = node.target, []
    if "out" in node.kwargs:
        targets.append(node.kwargs["out"])
    schema = getattr(target, "_schema", None)
    if schema is not None and getattr(schema, "is_mutable", False):
        for k, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                targets.append(node.args[k] if k < len(node.args) else node.kwargs.get(arg.name))
    if target is operator.setitem or target in _IN_PLACE_OPERATORS or _inplace_name(target) \
            or node.kwargs.get("inplace") is True:  # (`F.relu(x, inplace=True)`)
        targets.append(node.args[0] if node.args else None)
    return [x for t in targets for x in _flat(t) if isinstance(x, torch.fx.Node)]


_IN_PLACE_OPERATORS = frozenset(getattr(operator, f"i{name}") for name in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift", "matmul"))


def _inplace_name(target) -> bool:
    """An in-place method or op by PyTorch's naming (`add_`, `aten.add_.Tensor`); Python's
    `operator.and_`/`or_`/`not_` are not."""
    if isinstance(target, torch._ops.OpOverload):
        name = target.overloadpacket.__name__
    elif isinstance(target, str):
        name = target
    elif getattr(target, "__module__", "") in ("_operator", "operator"):
        return False
    else:
        name = getattr(target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def _written_while_traced(node) -> bool:
    """Whether Dynamo's fake value of a placeholder was written while the graph was traced
    (its version moved): any write, however it was spelt."""
    value = node.meta.get("example_value")
    try:
        return isinstance(value, torch.Tensor) and value._version > 0
    except Exception:  # noqa: BLE001 - a value without a version: say written
        return True


def _aliased_by_outputs(gm: torch.fx.GraphModule) -> set:
    """Placeholders whose storage a graph output shares (a view of a buffer returned: the
    caller's writes through it must reach the buffer), by Dynamo's fake example values; every
    placeholder when an output has none."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(_flat(output.args))
    storages = []
    for out in outs:
        value = out.meta.get("example_value") if isinstance(out, torch.fx.Node) else None
        if isinstance(out, torch.fx.Node) and not isinstance(value, torch.Tensor):
            if value is None:
                return set(placeholders)
            continue
        if isinstance(value, torch.Tensor):
            storages.append(_storage(value))
    aliased = set()
    for p in placeholders:
        value = p.meta.get("example_value")
        if not isinstance(value, torch.Tensor):
            continue
        if _storage(value) in storages:
            aliased.add(p)
    return aliased


def _flat(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _flat(y)
    else:
        yield x


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()._cdata
    except Exception:  # noqa: BLE001 - a tensor without storage aliases nothing
        return None


def _shares_storage(t: torch.Tensor, others) -> bool:
    """Whether another input's memory overlaps `t`'s (a write through it would change `t`);
    True where it cannot be told."""
    try:
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    except Exception:  # noqa: BLE001
        return True
    for o in others:
        if o is t or not isinstance(o, torch.Tensor) or o.device != t.device or o.numel() == 0:
            continue
        try:
            o_start = o.untyped_storage().data_ptr()
            o_end = o_start + o.untyped_storage().nbytes()
        except Exception:  # noqa: BLE001 - (an mkldnn or other storage-less tensor)
            return True
        if o_start < end and start < o_end:
            return True
    return False


def _symbolic(gm: torch.fx.GraphModule, example_inputs) -> bool:
    """Whether the graph takes symbolic sizes (a dynamic-shape graph: its fallback could not be
    compiled for one call's sizes)."""
    if any(isinstance(x, torch.SymInt) or not isinstance(x, (torch.Tensor, int, float, bool)) and x is not None
           for x in example_inputs):
        return True
    for node in gm.graph.nodes:
        value = node.meta.get("example_value") if node.op == "placeholder" else None
        if isinstance(value, torch.SymInt) or isinstance(value, torch.Tensor) and any(
                not isinstance(d, int) for d in (*value.shape, *value.stride())):
            return True
    return False


def _candidates(gm: torch.fx.GraphModule, example_inputs):
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs) or _symbolic(gm, example_inputs):
        return
    skip = None  # (the graph's writes and aliases, worked out once a captured tensor is found)
    for position, (node, t) in enumerate(zip(placeholders, example_inputs)):
        source = _source(node) if node.users and isinstance(t, torch.Tensor) else None
        if source is None or _written_while_traced(node):
            continue
        if skip is None:
            skip = _written(gm) | _aliased_by_outputs(gm)
        if node in skip:
            continue
        if isinstance(t, torch.nn.Parameter) or t.requires_grad or type(t) is not torch.Tensor \
                or t.is_sparse or t.is_quantized or t.is_complex() or not t.is_contiguous() or t.is_inference():
            continue  # (an inference tensor has no version counter to guard it by)
        if t.numel() < 2 or t.numel() > MAX_ELEMENTS or _shares_storage(t, example_inputs):
            continue
        yield position, source, t


def fit(position: int, source: str, t: torch.Tensor) -> IndexFormula | None:
    """The formula `t`'s values follow, verified exactly, or None."""
    dims = tuple(d for d, n in enumerate(t.shape) if n > 1)
    if not 1 <= len(dims) <= 2:
        return None
    if t.device.type != "cpu" and t.numel() <= HOST_FIT_ELEMENTS:
        with torch.no_grad():
            found = fit(position, source, t.to("cpu"))
        if found is None:
            return None
        found = replace(found, device=t.device)
        # (integers past 2**24 may round to a float type differently on the device: verify there)
        return found if _exact_in_float32(found) or found.matches(t) else None
    base = dict(position=position, source=source, shape=tuple(t.shape), dtype=t.dtype, device=t.device, dims=dims)
    with torch.no_grad():
        x = t.reshape([t.shape[d] for d in dims])
        for make in (_affine, _band):
            try:
                candidates = make(x)
            except (RuntimeError, ValueError, OverflowError):
                continue
            for terms in candidates:
                formula = IndexFormula(**base, kind=make.__name__[1:], terms=terms)
                if formula.matches(t):
                    return formula
    return None


def _exact_in_float32(formula: IndexFormula) -> bool:
    """Whether every value the formula computes before its final cast is below 2**24."""
    if formula.kind != "affine":
        return True
    c, *coeffs = formula.terms
    sizes = [formula.shape[d] for d in formula.dims]
    return abs(c) + sum(abs(a) * (n - 1) for a, n in zip(coeffs, sizes)) < 2 ** 24


def _affine(x: torch.Tensor) -> list:
    """The affine terms the first elements imply (a candidate, verified by the caller)."""
    if x.dtype == torch.bool:
        return []
    corner = x[(0,) * x.dim()]
    steps = [x[(1, 0)] if x.dim() == 2 else x[1]] + ([x[(0, 1)]] if x.dim() == 2 else [])
    values = torch.stack([corner, *steps]).double().tolist()
    if not all(v == v and abs(v) < 2 ** 53 and v == int(v) for v in values):
        return []
    c = int(values[0])
    coeffs = [int(v) - c for v in values[1:]]
    if not any(coeffs):
        return []  # a constant: more often a buffer about to be written (a cache) than a formula
    return [(c, *coeffs)]


def _band(x: torch.Tensor) -> list:
    """Band terms for a tensor of two values: one candidate per value as the band's."""
    if x.dim() != 2:
        return []
    first = x[0, 0]
    inside = x == first
    others = x[~inside]
    if others.numel() == 0:
        return []
    second = others[0]
    if not bool(((x == second) | inside).all()):
        return []
    rows, cols = x.shape
    offset = torch.arange(cols, device=x.device)[None, :] - torch.arange(rows, device=x.device)[:, None]
    found = []
    for value, other, band in ((first, second, inside), (second, first, ~inside)):
        live = offset[band]
        lo, hi = int(live.min()), int(live.max())
        found.append((lo if lo > -(rows - 1) else None, hi if hi < cols - 1 else None, value.item(), other.item()))
    return found


def find(gm: torch.fx.GraphModule, example_inputs) -> list[IndexFormula]:
    """The inputs of Dynamo's graph `gm` that are index formulas, by the values of `example_inputs`."""
    found = []
    for position, source, t in _candidates(gm, example_inputs):
        try:
            formula = fit(position, source, t)
        except Exception as err:  # noqa: BLE001 - recognising a formula is an optimisation
            logs.log("graph", "index constants: %s not fitted: %s: %s", source, type(err).__name__, err)
            continue
        if formula is not None:
            logs.log("graph", "index constants: %s", formula.describe())
            found.append(formula)
    return found


def substituted(gm: torch.fx.GraphModule, formulas: list[IndexFormula]) -> torch.fx.GraphModule:
    """A copy of `gm` whose uses of each formula's input compute the formula instead."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    last = placeholders[-1]
    for formula in formulas:
        placeholders[formula.position].replace_all_uses_with(_emit_after(graph, last, formula))
    graph.lint()
    made = torch.fx.GraphModule(gm, graph)
    made.meta.update(gm.meta)
    return made


def _emit_after(graph: torch.fx.Graph, anchor, formula: IndexFormula):
    """The formula's nodes, in order, after `anchor` (before the graph's first computation)."""
    cursor = [anchor]

    def call(op, *args, **kwargs):
        with graph.inserting_after(cursor[0]):
            n = graph.call_function(op, args, kwargs)
        cursor[0] = n
        return n

    return formula.build(call)


class Guarded:
    """The compiled graph that assumes `formulas`, with the check of each call (see the module's
    docstring); `fallback(args)` compiles the graph that reads the tensors instead, and where
    that fails `eager` (Dynamo's graph) runs them."""

    def __init__(self, compiled, formulas: list[IndexFormula], example_inputs, fallback, eager):
        self.compiled = compiled
        self.formulas = formulas
        self.fallback = fallback
        self.eager = eager
        self.verified = [(weakref.ref(example_inputs[f.position]), example_inputs[f.position]._version)
                         for f in formulas]
        self.rechecks = 0  # verifications on consecutive calls (a tensor that changes every call)
        self._checked_last_call = False

    def __call__(self, *args):
        if self.formulas:
            checked = False
            for (ref, version), f in zip(self.verified, self.formulas):
                t = args[f.position]
                if t is not ref() or t._version != version:
                    self._recheck(args)
                    checked = True
                    break
            self._checked_last_call = checked
        return self.compiled(*args)

    def _recheck(self, args) -> None:
        self.rechecks = self.rechecks + 1 if self._checked_last_call else 1
        tensors = [args[f.position] for f in self.formulas]
        untracked = [f for f, t in zip(self.formulas, tensors) if isinstance(t, torch.Tensor) and t.is_inference()]
        changed = untracked or [f for f, t in zip(self.formulas, tensors) if not f.matches(t)]
        if not changed and self.rechecks <= MAX_RECHECKS:
            self.verified = [(weakref.ref(t), t._version) for t in tensors]
            return
        why = (f"{changed[0].source} no longer follows the formula it was compiled with" if changed
               else f"the tensors read as formulas changed on {self.rechecks} calls in a row")
        warnings.warn(f"tilefuse: {why}; the graph is compiled again to read them (the index_constants "
                      "knob turns formulas off)", stacklevel=3)
        self.formulas = []
        try:
            self.compiled = self.fallback(list(args))
        except Exception as err:  # noqa: BLE001 - the graph still runs, as eager runs it
            warnings.warn(f"tilefuse: compiling it again failed ({type(err).__name__}: {err}); it runs eagerly",
                          stacklevel=3)
            self.compiled = self.eager
