"""Identical kernels compiled once, within a graph and across the graphs of a process.

A transformer's layers plan the same kernels under other names (`..._red_layer_norm_3`, `_7`)
over other buffers. A plan's key is its tile IR, lowered under the graph's options, with its
kernels' names and its buffers' replaced by positional ones, plus the backend, the options,
the knobs and its buffers' dtypes (shapes and strides are in the IR). The first plan with a
key is tuned, generated and built; every later one launches the same kernels through a
renaming of its buffers (`Renamed`), under its own step name, so the profiler and `explain`
still see each kernel as its own.

An entry lives while a compiled graph holds a kernel of it (a dropped graph leaves nothing).
"""
from __future__ import annotations

import dataclasses
import hashlib
import threading
import weakref
from dataclasses import dataclass, field

from .backends.inline_call import Buf, InlineCall

from .tile.variants import all_kernels
from .tune.tuner import canonical_source


@dataclass(eq=False)
class Shared:
    """What the first plan with a key built: its final kernels' launchers, sources and
    names, and the reports of those kernels (to count the plans that share them)."""

    plan: str  # the representative plan's name
    names: list  # its base lowering's names, in positional order
    kernels: list  # [(tile kernel, source, launcher)] as compiled
    tuned: object = None
    reports: list = field(default_factory=list)
    aten: bool = False  # the plan runs as ATen's matmul (the tuner chose it): nothing built
    split: bool = False  # the plan runs as ATen's product and its epilogue's own plan (`impl=split`)


_lock = threading.Lock()
_shared: "weakref.WeakValueDictionary[str, Shared]" = weakref.WeakValueDictionary()


def names_of(kernels) -> list:
    """The names a plan's kernels use that differ between identical plans, in order."""
    out: list = []
    for tk in kernels:
        for name in [tk.name] + [p.name for p in tk.params if p.kind == "buffer"] + list(tk.scratch):
            if name not in out:
                out.append(name)
    return out


def plan_key(graph, kernels, backend: str, lowering, options) -> str:
    """The content key of a plan lowered to `kernels` (name-free) under `lowering` (the tile
    layer's options) in a compile with `options` (its `config.Options`)."""
    text = canonical_source("\n".join(str(k) for tk in kernels for k in all_kernels(tk)), kernels)
    dtypes = []
    for tk in kernels:
        for p in tk.params:
            if p.kind == "buffer":
                spec = tk.scratch.get(p.name) or (graph[p.name] if p.name in graph.nodes else None)
                dtypes.append(str(getattr(spec, "dtype", None)))
    knobs = sorted((k, repr(v)) for k, v in options.as_dict().items())
    blob = repr((text, backend, repr(lowering), dtypes, knobs))
    return hashlib.sha256(blob.encode()).hexdigest()


def lookup(key: str) -> Shared | None:
    with _lock:
        return _shared.get(key)


def publish(key: str, shared: Shared) -> Shared:
    """Record `shared` under `key` (a concurrent compile's entry, if first, wins)."""
    with _lock:
        return _shared.setdefault(key, shared)


def forget(entries) -> None:
    """Drop `entries` (a compile that failed: its builds may have failed, and are not kept)."""
    with _lock:
        for key, shared in entries:
            if _shared.get(key) is shared:
                del _shared[key]


def renaming(shared: Shared, names: list) -> dict | None:
    """The representative's names → a duplicate's (None: its compiled kernels use a name the
    base lowering did not, so the duplicate cannot be mapped and compiles on its own)."""
    if len(names) != len(shared.names):
        return None
    mapping = dict(zip(shared.names, names))
    for tk, _, _ in shared.kernels:
        used = [p.name for p in tk.params if p.kind == "buffer"] + list(tk.writes) + list(tk.reads) + list(tk.scratch)
        if any(n not in mapping for n in used):
            return None
    return mapping


def kernel_name(shared: Shared, plan: str, tk_name: str, mapping: dict) -> str:
    """A duplicate's name for the representative's kernel `tk_name`."""
    if tk_name in mapping:
        return mapping[tk_name]
    if tk_name.startswith(shared.plan):
        return plan + tk_name[len(shared.plan):]
    return f"{plan}_{tk_name}"


class Renamed:
    """A launcher run over a duplicate's buffers: `launch(buffers, env)` with the duplicate's
    names, the shared launcher called with the representative's."""

    def __init__(self, launch, pairs: list, shared: Shared):
        self.launch = launch
        self.pairs = pairs  # [(representative's name, duplicate's name)]
        self.shared = shared  # keeps the entry alive while this graph is

    def __tilefuse_reduce__(self):  # a stored graph rebuilds it, sharing with nothing
        return self.launch, self.pairs, None

    def __call__(self, buffers: dict, env: dict) -> None:
        self.launch({r: buffers[d] for r, d in self.pairs}, env)

    def inline(self, buffers: dict, env: dict):
        """The shared launcher's inline call (`backends.inline_call`) over this duplicate's
        buffers."""
        inline = getattr(self.launch, "inline", None)
        if inline is None:
            return None
        call = inline({r: buffers[d] for r, d in self.pairs}, env)
        if not isinstance(call, InlineCall):
            return call
        names = dict(self.pairs)
        args = tuple(Buf(names[a.name]) if isinstance(a, Buf) else a for a in call.args)
        return dataclasses.replace(call, args=args, expects={names[n]: e for n, e in call.expects.items()})

    def wait(self):
        wait = getattr(self.launch, "wait", None)
        return wait() if wait is not None else None


def clear() -> None:
    """Forget every entry (tests: compile from scratch in this process)."""
    with _lock:
        _shared.clear()


__all__ = ["Shared", "Renamed", "plan_key", "names_of", "lookup", "publish", "forget", "renaming", "kernel_name", "clear"]
