"""The graph cache: a process compiling a graph that some process compiled before loads the
compiled graph (its steps, kernel sources, launch settings and report) instead of planning,
lowering and tuning it again.

The key is everything the compiled graph depends on: the FX graph's code; each input's dtype,
device, shape and strides (symbolic ones as their expressions), and the shape environment's
guards and ranges on the symbols; the values of tensor constants; the graph's kind (forward or
backward); every knob that shapes the compile (not logs, caches or the fallback); PyTorch's
float32 matmul precision; the versions of tilefuse, PyTorch, Triton and Python, the device
name and capability (`cache.disk.environment_fingerprint`), the GPU's SM count; and a hash
of tilefuse's own source files (an edited checkout never loads a graph the old code compiled).

Entries are JSON (`runtime.artifact`), in the disk cache's "graphs" namespace: atomic,
checksummed, private, bounded, as kernel entries are. Loading rebuilds each kernel's launcher
from the kernel cache, so a graph entry holds no binary. A graph that cannot be stored (a
constant too large, an extern call to an operator with no name) is compiled every time,
with the reason in the `cache` log; an entry that does not load is a miss, logged, never an
error. Knob: `graph_cache` (TILEFUSE_GRAPH_CACHE=0 turns it off).
"""
from __future__ import annotations

import functools
import hashlib
import os
import time

import torch

from . import logs
from .config import Options, config
from .runtime import artifact
from .cache.disk import DiskCache, cache_key, environment_fingerprint
from .runtime.compiled import CompiledGraph
from .tune.tuner import real_tensors

#: what a stored graph's encoding is; a change of it (or of any tilefuse source) misses
FORMAT = 1
#: knobs that change nothing in a compiled graph (where it goes, what is printed, how a
#: failure is reported, how many threads build it)
NOT_IN_KEY = frozenset({"logs", "debug_dir", "cache_dir", "cache_lock_timeout", "cache_max_bytes",
                         "compile_threads", "fallback", "verify", "graph_cache", "cuda_graphs",
                         "generated_wrapper", "kernel_runs"})

_caches: dict[str, DiskCache] = {}


def graph_cache() -> DiskCache:
    root = config.cache_dir
    cache = _caches.get(root)
    return cache if cache is not None else _caches.setdefault(root, DiskCache("graphs", root))


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """A hash of every Python file of the tilefuse package (computed once per process)."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def graph_key(gm: torch.fx.GraphModule, device: torch.device, kind: str, sm_count: int,
              options: Options) -> str | None:
    """The graph's key under the compile's `options`, or None when something it depends on
    cannot be named (the reason is logged): such a graph is compiled every time. `sm_count`:
    what its plans spread over (`backends.targets.parallel_units`: the GPU's multiprocessors,
    a CPU's threads)."""
    try:
        with real_tensors():  # (constants are hashed: outside the compile's fake-tensor mode)
            parts = _key_parts(gm, device, kind, sm_count, options)
    except Unkeyable as why:
        logs.log("cache", "graph %s not cached: %s", kind, why)
        return None
    return cache_key(*parts)


class Unkeyable(Exception):
    """Something a compiled graph depends on that a key cannot name."""


def _key_parts(gm, device, kind, sm_count: int, options: Options) -> list:
    inputs, shape_envs = [], []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            inputs.append(describe_input(val, node.name))
            env = _shape_env(val)
            if env is not None and all(e is not env for e in shape_envs):
                shape_envs.append(env)
        elif node.op == "get_attr":
            inputs.append([node.target, attribute_key(gm, node.target)])
    knobs = knobs_in_key(options)
    return ["tilefuse-graph", FORMAT, environment_fingerprint(), source_hash(), kind, device.type, sm_count,
            matmul_precision(), knobs, gm.code, inputs, [_guards(e) for e in shape_envs]]


#: the float32 precisions PyTorch's newer API sets (`torch.backends[.<path>].fp32_precision`:
#: the global one, then each backend's)
_FP32_PRECISIONS = ("", "cuda.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")


def matmul_precision() -> str:
    """The float32 matmul precision, as a cache key reads it: PyTorch's global setting, or each
    backend's own where a program mixed the legacy API (`allow_tf32`) with the per-backend one
    (`fp32_precision`) — `torch.get_float32_matmul_precision` then refuses to name one, and a
    compile must not fail for a setting eager runs with."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        parts = []
        for path in _FP32_PRECISIONS:
            backend = torch.backends
            for name in filter(None, path.split(".")):
                backend = getattr(backend, name, None)
            try:
                value = getattr(backend, "fp32_precision", None)
            except RuntimeError as err:  # (a getter that refuses the mix too)
                value = f"unreadable: {err}"[:80]
            parts.append(f"{path or 'global'}={value}")
        return "per-backend: " + ", ".join(parts)


def knobs_in_key(options: Options) -> dict:
    """The knobs that shape a compiled graph, as a key holds them."""
    return {name: str(value) for name, value in options.as_dict().items() if name not in NOT_IN_KEY}


def describe_input(val, name: str):
    """An input's part of a key: a tensor's dtype, device, sizes, strides, offset and
    requires_grad (symbolic ones as expressions), a symbol, or a plain value."""
    if isinstance(val, torch.Tensor):
        return ["tensor", str(val.dtype), val.device.type, [str(d) for d in val.shape],
                [str(s) for s in val.stride()], str(val.storage_offset()), bool(val.requires_grad)]
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ["symbolic", type(val).__name__, str(val)]
    if val is None or isinstance(val, (bool, int, float, str)):
        return ["value", repr(val)]
    raise Unkeyable(f"input {name} is a {type(val).__name__}")


def _shape_env(val):
    fake_mode = getattr(val, "fake_mode", None)
    if fake_mode is not None:
        return getattr(fake_mode, "shape_env", None)
    node = getattr(val, "node", None)  # a SymInt
    return getattr(node, "shape_env", None)


def _guards(shape_env) -> list:
    """What the shape environment knows of the symbols: its guards, value ranges and
    replacements (a graph traced under other guards may have been compiled differently)."""
    guards = sorted(str(g.expr) for g in getattr(shape_env, "guards", ()))
    ranges = sorted(f"{k}: {v}" for k, v in getattr(shape_env, "var_to_range", {}).items())
    replacements = sorted(f"{k}: {v}" for k, v in getattr(shape_env, "replacements", {}).items())
    return [guards, ranges, replacements]


def attribute_key(gm, target: str):
    """An attribute's part of a key: a subgraph by its code and, recursively, the attributes it
    reads (a checkpointed region inside another names its inner region only by attribute);
    a tensor by its dtype, layout and a hash of its values."""
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    if isinstance(value, torch.fx.GraphModule):
        inner = [[n.target, attribute_key(value, n.target)] for n in value.graph.nodes if n.op == "get_attr"]
        return ["module", value.code, inner]
    if isinstance(value, torch.Tensor):
        if type(value) not in (torch.Tensor, torch.nn.Parameter) or value.layout != torch.strided:
            raise Unkeyable(f"constant {target} is a {type(value).__name__}")
        data = value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return ["tensor", str(value.dtype), list(value.shape), list(value.stride()), hashlib.sha256(data).hexdigest()]
    raise Unkeyable(f"attribute {target} is a {type(value).__name__}")


def load(key: str, device: torch.device, name: str):
    """(compiled graph, report) stored under `key`, its launchers rebuilt; None on a miss."""
    t0 = time.perf_counter()
    files = graph_cache().get(key)
    if files is None:
        return None
    try:
        with real_tensors():
            stored = artifact.decode(files["graph.json"])
            graph, steps, report = stored["graph"], stored["steps"], stored["report"]
            for step in steps:  # C++ kernels load (or build again) in the background
                wait = getattr(getattr(step, "launch", None), "wait", None)
                if wait is not None:
                    wait()
            graph.name = report.graph_name = name
            compiled = CompiledGraph(graph, steps, device)
    except Exception as err:  # noqa: BLE001 - a stored graph that does not load is compiled again
        logs.log("cache", "graph %s: stored entry %s did not load (%s: %s): compiling", name, key[:12],
                 type(err).__name__, err)
        return None
    report.stage_seconds = {"graph cache": time.perf_counter() - t0}
    report.cached = key[:16]
    logs.log("cache", "graph %s loaded from the graph cache (%s) in %.3f s", name, key[:12], time.perf_counter() - t0)
    return compiled, report


def store(key: str, compiled: CompiledGraph, report) -> bool:
    """Store a compiled graph under `key`; False (logged) when it cannot be encoded."""
    try:
        with real_tensors():
            data = artifact.encode({"graph": compiled.graph, "steps": compiled.steps, "report": report})
    except artifact.ArtifactError as err:
        logs.log("cache", "graph %s not cached: %s", compiled.graph.name, err)
        return False
    return graph_cache().put(key, {"graph.json": data})


__all__ = ["graph_key", "load", "store", "source_hash", "graph_cache", "attribute_key", "describe_input",
           "knobs_in_key", "matmul_precision", "Unkeyable", "FORMAT"]
