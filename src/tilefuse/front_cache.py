"""The front cache: an inference graph that some process compiled before reaches its stored
compiled graph straight from Dynamo's FX graph, without AOTAutograd's trace.

The graph cache (`graph_cache.py`) is keyed by the graph AOTAutograd hands the compiler, so a
warm process still traced every graph through AOTAutograd before it could look: 0.3 s of a
warm HF Llama's 1.3 s on a CPU, against Inductor's AOTAutogradCache, which skips that trace.
Here the key is taken one step earlier, from Dynamo's graph and its example inputs, and the
entry names the graph cache's key of what AOTAutograd produced from it.

That is sound only where AOTAutograd's runtime wrapper around the compiled graph does
nothing, so the compiled graph may be called with Dynamo's arguments as they come. An entry
is written only for such graphs (`plain_runtime`): inference (no joint graph), no input
mutated, no output AOTAutograd rebuilds as an alias (views tilefuse makes after the call,
`output_views`, are stored with the entry), no change of grad mode inside, no effect tokens, no subclass
inputs, no parameters lifted by AOTAutograd, nothing in the graph whose behaviour its code
does not name (a function `allow_in_graph` put there, a module call, a custom operator's
Python implementation: AOTAutograd traces through them), static shapes (a symbolic graph's
guards come from its trace), autocast off (AOTAutograd runs a graph traced under autocast with autocast
disabled). The call runs with grad disabled, as AOTAutograd runs an inference graph.
Everything else compiles as before; a key whose entry is missing, or whose
graph entry no longer loads, is a miss that compiles and writes the entry again.

The key holds what AOTAutograd's output depends on besides the graph: Dynamo's graph code,
each input's dtype, device, shape, strides and requires_grad, every attribute the graph
reads (a subgraph by its code; tensors there are buffers, which make a graph ineligible),
the GPU's SM count, grad mode, deterministic algorithms, the default dtype,
float32 matmul precision, the knobs that shape a compile, and the versions and source hash
the graph cache keys on. Entries live in the disk cache's "front" namespace under the
`graph_cache` knob.
"""
from __future__ import annotations

import json

import torch

from . import logs
from .cache.disk import DiskCache, cache_key, environment_fingerprint
from .config import Options, config
from . import graph_cache
from .graph_cache import Unkeyable, attribute_key
from .runtime import artifact
from .backends.targets import sm_count
from .tune.tuner import real_tensors

#: what an entry holds; a change of it misses
FORMAT = 1

_caches: dict[str, DiskCache] = {}


def front_cache() -> DiskCache:
    root = config.cache_dir
    cache = _caches.get(root)
    return cache if cache is not None else _caches.setdefault(root, DiskCache("front", root))


def key(gm: torch.fx.GraphModule, example_inputs, options: Options, training: bool) -> str | None:
    """The front key of Dynamo's graph `gm` called with `example_inputs`, or None where the
    graph may not skip AOTAutograd (the reason is logged)."""
    if not options.graph_cache:
        return None
    try:
        why = _ineligible(gm, example_inputs, training)
        if why is not None:
            raise Unkeyable(why)
        with real_tensors():  # (constants are hashed: outside any fake-tensor mode)
            parts = _key_parts(gm, example_inputs, options)
    except Unkeyable as why:
        logs.log("cache", "front cache: graph not keyed: %s", why)
        return None
    return cache_key(*parts)


def _ineligible(gm, example_inputs, training: bool) -> str | None:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if training:
        return "a training graph (AOTAutograd builds its autograd function)"
    if torch._C._is_any_autocast_enabled():
        return "autocast is on"
    if any(True for _ in gm.named_parameters()) or any(True for _ in gm.named_buffers()):
        return "parameters or buffers that AOTAutograd lifts into inputs"
    for node in gm.graph.nodes:
        why = _opaque(node)
        if why is not None:
            return why
    for k, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor):
            if is_traceable_wrapper_subclass(x):
                return f"input {k} is a tensor subclass"
            if any(isinstance(d, torch.SymInt) for d in (*x.shape, *x.stride())):
                return f"input {k} has symbolic sizes"
        elif type(x) not in (int, float, bool):
            return f"input {k} is a {type(x).__name__}"
    return None


#: operator namespaces whose implementations come with PyTorch's version (or tilefuse's source)
_KNOWN_NAMESPACES = frozenset({"aten", "prims", "tilefuse"})


def _opaque(node) -> str | None:
    """Why a node of Dynamo's graph is not fully named by the graph's code, or None: AOTAutograd
    traces through a function `torch.compiler.allow_in_graph` put in the graph, a module call
    or a custom operator's Python implementation, and the code names only the callee."""
    if node.op == "call_module":
        return f"a module call ({node.target})"
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        space = getattr(target, "namespace", None) or str(target).split(".")[0]
        return None if space in _KNOWN_NAMESPACES else f"a custom operator ({target})"
    module = getattr(target, "__module__", None) or ""
    if module.split(".")[0] in ("torch", "_operator", "operator", "math", "builtins") \
            or type(target).__name__ == "builtin_function_or_method":
        return None
    return f"a Python function in the graph ({module}.{getattr(target, '__qualname__', target)})"


def _key_parts(gm, example_inputs, options: Options) -> list:
    inputs = [graph_cache.describe_input(x, f"input {k}") for k, x in enumerate(example_inputs)]
    attributes = [[n.target, attribute_key(gm, n.target)] for n in gm.graph.nodes if n.op == "get_attr"]
    knobs = graph_cache.knobs_in_key(options)
    state = [torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
             torch.are_deterministic_algorithms_enabled(), str(torch.get_default_dtype()),
             torch.get_float32_matmul_precision()]
    devices = sorted({x.device for x in example_inputs if isinstance(x, torch.Tensor)}, key=str)
    machine = [[str(d), sm_count(d)] for d in devices]
    return ["tilefuse-front", FORMAT, environment_fingerprint(), graph_cache.source_hash(), knobs, state, machine,
            gm.code, inputs, attributes]


def plain_runtime(metadata, compiled_inputs: int, dynamo_inputs: int) -> bool:
    """Whether AOTAutograd's runtime wrapper of an inference graph with this metadata
    (`ViewAndMutationMeta`) passes arguments and results through unchanged: the compiled graph
    takes Dynamo's `dynamo_inputs` arguments as they come (`compiled_inputs` placeholders: no
    duplicate or lifted argument), writes no input, returns no alias AOTAutograd rebuilds, no
    effect tokens, no random-state offsets, no grad-mode change, no subclass or dynamic
    output. Attributes are read directly: one a PyTorch version names otherwise is not known
    plain."""
    if metadata is None or compiled_inputs != dynamo_inputs:
        return False
    try:
        return (metadata.num_outputs_aliased == 0 and metadata.num_mutated_inp_runtime_indices == 0
                and metadata.num_intermediate_bases == 0 and not metadata.tokens
                and metadata.grad_enabled_mutation is None and not metadata.is_rng_op_functionalized
                and not any(i.mutates_data or i.mutates_metadata for i in metadata.input_info)
                and not getattr(metadata, "dynamic_outputs", False)
                and all(isinstance(m, int) or type(m).__name__ == "PlainTensorMeta"
                        for m in metadata.subclass_inp_meta))
    except AttributeError:  # (a PyTorch whose metadata names these differently: not known plain)
        return False


def load(front_key: str) -> dict | None:
    """{"graph_key", "static_inputs", "views"} of the entry under `front_key`; None on a miss
    or an entry that does not read (logged)."""
    from .output_views import OutputView

    files = front_cache().get(front_key)
    if files is None:
        return None
    try:
        record = json.loads(files["entry.json"].decode())
        if not isinstance(record.get("graph_key"), str):
            raise ValueError("no graph key")
        record["views"] = [OutputView(**fields) for fields in artifact.decode(files["views.json"])]
        return record
    except (KeyError, TypeError, ValueError, UnicodeDecodeError) as err:  # (ArtifactError is a ValueError)
        logs.log("cache", "front cache: entry %s unreadable (%s)", front_key[:12], err)
        return None


def store(front_key: str, graph_key: str, static_inputs: list, views: list) -> bool:
    """Point `front_key` at the graph cache's `graph_key`, with the inputs CUDA graphs keep in
    place and the outputs rebuilt as views after the call (`output_views`)."""
    record = {"graph_key": graph_key, "static_inputs": [int(k) for k in static_inputs]}
    try:
        with real_tensors():
            encoded_views = artifact.encode([v._asdict() for v in views])
    except artifact.ArtifactError as err:
        logs.log("cache", "front cache: entry not written (%s)", err)
        return False
    return front_cache().put(front_key, {"entry.json": json.dumps(record).encode(), "views.json": encoded_views})


__all__ = ["key", "load", "store", "plain_runtime", "front_cache", "FORMAT"]
