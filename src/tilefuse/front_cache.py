"""The front cache: a graph that some process compiled before reaches its stored compiled
graphs straight from Dynamo's FX graph, without AOTAutograd's trace.

The graph cache (`graph_cache.py`) is keyed by the graphs AOTAutograd hands the compiler, so a
warm process still traced every graph through AOTAutograd before it could look: 0.3 s of a
warm HF Llama's 1.3 s on a CPU, and half of a warm training step's first call, against
Inductor's AOTAutogradCache, which skips that trace. Here the key is taken one step earlier,
from Dynamo's graph and its example inputs, and the entry names the graph cache's keys of what
AOTAutograd produced from it.

That is sound only where AOTAutograd's runtime wrapper around the compiled graphs does nothing
that the entry cannot redo. An entry is written only for such graphs (`plain_runtime`): no
input mutated (an inference graph may write inputs in place itself, a KV-cache update: its
entry names them, and the call bumps their version counters where AOTAutograd's would), no
output AOTAutograd rebuilds as an alias (views tilefuse makes after the call,
`output_views`, are stored with the entry), no change of grad mode inside, no effect tokens, no
subclass inputs, no parameters lifted by AOTAutograd, nothing in the graph whose behaviour its
code does not name (a function `allow_in_graph` put there, a module call, a custom operator's
Python implementation: AOTAutograd traces through them), static shapes (a symbolic graph's
guards come from its trace). An inference graph's call runs with grad disabled, as AOTAutograd
runs it. A training graph's entry (`TrainingEntry`) also holds what AOTAutograd's autograd
function needs (`plain_training`): how many outputs and saved tensors the forward returns,
which outputs are not differentiable, which take a gradient and the layout the backward was
compiled for; `front_autograd` rebuilds the function from it. It is written once the forward
and the backward have each run, and never in verify mode (which checks the traced graphs).
A graph traced under autocast runs its compiled code with autocast off, as AOTAutograd runs it.
Everything else compiles as before; a key whose entry is missing, or whose graph entries no
longer load, is a miss that compiles and writes the entry again.

The key holds what AOTAutograd's output depends on besides the graph: Dynamo's graph code,
each input's dtype, device, shape, strides and requires_grad, every attribute the graph
reads (a subgraph by its code; tensors there are buffers, which make a graph ineligible),
the GPU's SM count, grad mode, autocast per device, the attention back ends
`scaled_dot_product_attention` may pick, deterministic algorithms, the default dtype,
float32 matmul precision, AOTAutograd's own configuration, the knobs that shape a compile, and
the versions and source hash the graph cache keys on. Entries live in the disk cache's "front"
namespace under the `graph_cache` knob.
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
from .backends.targets import parallel_units
from .tune.tuner import real_tensors

#: what an entry holds; a change of it misses (3: a training entry's backward views; 4: graphs
#: returning a tensor subclass are no longer keyed, their stored entries dropped)
FORMAT = 4

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
        why = _ineligible(gm, example_inputs, training, options)
        if why is not None:
            raise Unkeyable(why)
        with real_tensors():  # (constants are hashed: outside any fake-tensor mode)
            parts = _key_parts(gm, example_inputs, options)
    except Unkeyable as why:
        logs.log("cache", "front cache: graph not keyed: %s", why)
        return None
    return cache_key(*parts)


def _ineligible(gm, example_inputs, training: bool, options: Options) -> str | None:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if training and options.verify:
        return "verify mode checks a training graph against the graphs AOTAutograd traces"
    if training and _compiled_autograd_on():
        return "compiled autograd traces AOTAutograd's own backward"
    if any(True for _ in gm.named_parameters()) or any(True for _ in gm.named_buffers()):
        return "parameters or buffers that AOTAutograd lifts into inputs"
    for node in _nodes_within(gm):
        why = _opaque(node)
        if why is not None:
            return why
    for k, value in enumerate(_output_values(gm)):
        if is_traceable_wrapper_subclass(value):  # (its metadata is the flattened inner tensors')
            return f"output {k} is a tensor subclass, which AOTAutograd's wrapper rebuilds"
    for k, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor):
            if is_traceable_wrapper_subclass(x):
                return f"input {k} is a tensor subclass"
            if any(isinstance(d, torch.SymInt) for d in (*x.shape, *x.stride())):
                return f"input {k} has symbolic sizes"
        elif type(x) not in (int, float, bool):
            return f"input {k} is a {type(x).__name__}"
    return None


def _nodes_within(gm: torch.fx.GraphModule):
    """The nodes of `gm` and of every subgraph it reads (a checkpointed region, a cond's
    branches), however deeply nested."""
    for node in gm.graph.nodes:
        yield node
        if node.op == "get_attr":
            value = gm
            for part in node.target.split("."):
                value = getattr(value, part, None)
            if isinstance(value, torch.fx.GraphModule):
                yield from _nodes_within(value)


#: operator namespaces whose implementations come with PyTorch's version (or tilefuse's source)
_KNOWN_NAMESPACES = frozenset({"aten", "prims", "tilefuse"})


def _output_values(gm) -> list:
    """The example values Dynamo recorded for its graph's outputs (None where it recorded none)."""
    outputs = gm.graph.output_node().args[0] if gm.graph.nodes else ()
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    return [o.meta.get("example_value") if isinstance(o, torch.fx.Node) else None for o in outputs]


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
    state = [torch.is_grad_enabled(), torch.is_inference_mode_enabled(), _autocast_state(), compile_state()]
    devices = sorted({x.device for x in example_inputs if isinstance(x, torch.Tensor)}, key=str)
    machine = [[str(d), parallel_units(d)] for d in devices]
    return ["tilefuse-front", FORMAT, environment_fingerprint(), graph_cache.source_hash(), knobs, state, machine,
            gm.code, inputs, attributes]


def compile_state() -> list:
    """The process state a compile reads besides its knobs: deterministic algorithms, the
    default dtype, float32 matmul precision, the attention back ends, AOTAutograd's config (a
    training graph's backward compiles later: its entry is written only if this is unchanged)."""
    return [torch.are_deterministic_algorithms_enabled(), str(torch.get_default_dtype()),
            graph_cache.matmul_precision(), _attention_backends(), _aot_config()]


def _autocast_state() -> list:
    """Autocast as AOTAutograd's trace sees it: on or off and its dtype, per device kind."""
    return [[device, torch.is_autocast_enabled(device), str(torch.get_autocast_dtype(device))]
            for device in ("cpu", "cuda")] + [torch.is_autocast_cache_enabled()]


def _attention_backends() -> list:
    """Which kernels `scaled_dot_product_attention` may pick: the trace records the one it picks."""
    cuda = torch.backends.cuda
    flags = ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled",
             "fp16_bf16_reduction_math_sdp_allowed")  # (the last: whether the math kernel upcasts)
    return [name for name in flags if getattr(cuda, name, lambda: False)()]


def _aot_config() -> str:
    """AOTAutograd's configuration (the partition's budget, its view replay): the trace follows it."""
    import torch._functorch.config as functorch_config

    return repr(sorted((k, repr(v)) for k, v in functorch_config.get_config_copy().items()))


def _compiled_autograd_on() -> bool:
    compiled_autograd = getattr(torch._dynamo, "compiled_autograd", None)
    return bool(getattr(compiled_autograd, "compiled_autograd_enabled", False))


def plain_runtime(metadata, compiled_inputs: int, dynamo_inputs: int, writes_in_graph: bool = False) -> bool:
    """Whether AOTAutograd's runtime wrapper of an inference graph with this metadata
    (`ViewAndMutationMeta`) passes arguments and results through unchanged: the compiled graph
    takes Dynamo's `dynamo_inputs` arguments as they come (`compiled_inputs` placeholders: no
    duplicate or lifted argument), writes no input (with `writes_in_graph`: none but those
    whose writes the graph itself makes, a KV-cache update: the wrapper then only bumps their
    version counters, `bumped_versions`), returns no alias AOTAutograd rebuilds, no effect
    tokens, no random-state offsets, no grad-mode change, no subclass or dynamic output.
    Attributes are read directly: one a PyTorch version names otherwise is not known plain."""
    if metadata is None or compiled_inputs != dynamo_inputs:
        return False
    try:
        return (metadata.num_outputs_aliased == 0 and metadata.num_mutated_inp_runtime_indices == 0
                and metadata.num_intermediate_bases == 0 and not metadata.tokens
                and metadata.grad_enabled_mutation is None and not metadata.is_rng_op_functionalized
                and not any(i.mutates_metadata or (i.mutates_data and not (writes_in_graph and _written_in_graph(i)))
                            for i in metadata.input_info)
                and not getattr(metadata, "dynamic_outputs", False)
                and all(isinstance(m, int) or type(m).__name__ == "PlainTensorMeta"
                        for m in metadata.subclass_inp_meta))
    except AttributeError:  # (a PyTorch whose metadata names these differently: not known plain)
        return False


def _written_in_graph(info) -> bool:
    """Whether AOTAutograd left an input's data write in the graph (`keep_input_mutations`)
    rather than copying the new value back after the call."""
    from torch._functorch._aot_autograd.schemas import MutationType

    return info.mutation_type == MutationType.MUTATED_IN_GRAPH


def bumped_versions(metadata) -> list[int]:
    """The inputs whose version counters AOTAutograd's wrapper bumps after a graph that writes
    them itself (`mutated_graph_handled_indices_seen_by_autograd`: a KV-cache write under
    no_grad is among them, as eager's in-place write bumps the counter there too)."""
    return [int(k) for k in metadata.mutated_graph_handled_indices_seen_by_autograd]


def plain_training(metadata, forward: torch.fx.GraphModule, saved_from: int | None, dynamo_inputs: int) -> dict | None:
    """The autograd function AOTAutograd wraps around a training forward with this metadata,
    as an entry holds it, or None where that function does more than `front_autograd` redoes
    (the reason is logged). The forward returns `outputs` results then `saved` tensors for the
    backward (no numbers: static shapes), none of them saved without AOTAutograd's version
    check, no unsafe views; `non_differentiable`: outputs that do not require grad;
    `tangent_outputs`: those whose gradient the backward takes, in its order."""
    function = _training_function(metadata, forward, saved_from, dynamo_inputs)
    if isinstance(function, str):
        logs.log("cache", "front cache: training graph not stored: %s", function)
        return None
    return function


def _training_function(metadata, forward, saved_from, dynamo_inputs) -> dict | str:
    placeholders = sum(1 for n in forward.graph.nodes if n.op == "placeholder")
    if saved_from is None:
        return "the partition did not say where the saved tensors start"
    if not plain_runtime(metadata, placeholders, dynamo_inputs):
        return "AOTAutograd's wrapper does work around it (mutations, aliased outputs, lifted arguments)"
    try:
        extra = ("num_unsafe_view_outputs", "num_tensors_saved_with_no_vc_check", "num_symints_saved_for_bw",
                 "num_opaque_objects_saved_for_bw", "num_graphsafe_rng_states")
        done = [name for name in extra if getattr(metadata, name, 0)]
        if done:
            return f"AOTAutograd's function does more ({', '.join(done)})"
        outputs = metadata.output_info
        if metadata.num_forward_returns != len(outputs) or saved_from != len(outputs):
            return "its forward returns more than the outputs and the saved tensors"
        if not all(isinstance(o.raw_type, type) and issubclass(o.raw_type, torch.Tensor) for o in outputs) \
                or not all(type(m).__name__ == "PlainTensorMeta" for m in metadata.subclass_tangent_meta):
            return "an output that is not a plain tensor"
        tangent_outputs = [k for k, o in enumerate(outputs) if getattr(o, "requires_grad_for_backward", o.requires_grad)]
        non_differentiable = [k for k, o in enumerate(outputs) if not o.requires_grad]
    except AttributeError as err:  # (a PyTorch naming these otherwise: not known plain)
        return f"AOTAutograd's metadata reads otherwise ({err})"
    returned = next(n for n in forward.graph.nodes if n.op == "output").args[0]
    saved = list(returned[saved_from:])
    if not all(isinstance(n, torch.fx.Node) and isinstance(n.meta.get("val"), torch.Tensor) for n in saved):
        return "it saves numbers for the backward"
    return {"outputs": saved_from, "saved": len(saved), "non_differentiable": non_differentiable,
            "tangent_outputs": tangent_outputs}


def backward_function(backward: torch.fx.GraphModule, function: dict, dynamo_inputs: int) -> dict | None:
    """The backward half of a training entry, or None where the backward graph's arguments or
    results are not the function's (one gradient per `tangent_outputs` after the saved tensors,
    one result per input of the forward): `tangents`, the [sizes, strides, dtype] it was
    compiled for per gradient; `no_gradient`, the inputs whose gradient it never computes."""
    placeholders = [n for n in backward.graph.nodes if n.op == "placeholder"]
    tangents = placeholders[function["saved"]:]
    results = next(n for n in backward.graph.nodes if n.op == "output").args[0]
    if len(tangents) != len(function["tangent_outputs"]) or len(results) != dynamo_inputs:
        return None
    layouts = []
    for node in tangents:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not all(isinstance(d, int) for d in (*val.shape, *val.stride())):
            return None
        layouts.append([[int(d) for d in val.shape], [int(d) for d in val.stride()], str(val.dtype).split(".")[-1]])
    return {"tangents": layouts, "no_gradient": [k for k, r in enumerate(results) if r is None]}


class TrainingEntry:
    """A training graph's entry, gathered while AOTAutograd compiles it: the forward's function
    shape (`plain_training`) and graph key when the forward compiles, the backward's tangent
    layouts and graph key when the backward compiles (when it first runs), written once each
    has run once without failing. Any part that is not plain leaves the entry unwritten."""

    def __init__(self, front_key: str, dynamo_inputs: int, autocast: bool, conditions: list):
        self.front_key = front_key
        self.dynamo_inputs = dynamo_inputs
        self.autocast = autocast
        self.conditions = conditions  # what the key holds of the compile's knobs and state
        self.record: dict | None = None
        self.views: list = []
        self.backward_views: list = []
        self.ran: set = set()
        self.refused = False
        #: kind ("forward", "backward") -> (compiled graph, report), as compiled in this process
        self.graphs: dict = {}
        #: the entry is whole (both graphs compiled and run once, nothing refused): this process
        #: may run them as a warm one would (`api._lean_after_first_steps`)
        self.complete = False

    def forward_compiled(self, metadata, gm, saved_from: int | None, graph_key: str | None, views: list,
                         mutated: list) -> None:
        function = None if mutated or not graph_key else plain_training(metadata, gm, saved_from, self.dynamo_inputs)
        if function is None:
            self.refused = True
            return
        self.record = {"kind": "training", "graph_key": graph_key, "static_inputs": [], "autocast": self.autocast,
                       "deterministic": torch.are_deterministic_algorithms_enabled(), **function}
        self.views = list(views)

    def backward_compiled(self, gm, graph_key: str | None, conditions: list, views: list = ()) -> None:
        """The backward compiled (when it first ran) under `conditions` (`conditions()`); `views`:
        its outputs made as views after the call (a gradient that views an intermediate or a
        tangent), which the entry keeps as it keeps the forward's."""
        if self.record is None or not graph_key:
            self.refused = True
            return
        if conditions != self.conditions:
            self.refused = True
            logs.log("cache", "front cache: training graph not stored: its backward compiled under other knobs or "
                     "process state than its forward")
            return
        half = backward_function(gm, self.record, self.dynamo_inputs)
        if half is None:
            self.refused = True
            logs.log("cache", "front cache: training graph not stored: its backward takes other arguments")
            return
        self.record.update(backward_key=graph_key, **half)
        self.backward_views = list(views)

    def ran_once(self, kind: str) -> None:
        """The `kind` graph ("forward", "backward") ran once; the entry is written when both have."""
        self.ran.add(kind)
        if self.refused or self.ran != {"forward", "backward"} or "backward_key" not in (self.record or {}):
            return
        self.refused = True  # (written once)
        self.complete = True
        store(self.front_key, self.record, self.views, self.backward_views)


def load(front_key: str) -> dict | None:
    """The entry under `front_key` (`graph_key`, `static_inputs`, `views`; a training entry's
    `kind` "training" with `plain_training`'s fields, `backward_key`, `tangents`, `autocast`);
    None on a miss or an entry that does not read (logged)."""
    from .output_views import OutputView

    files = front_cache().get(front_key)
    if files is None:
        return None
    try:
        record = json.loads(files["entry.json"].decode())
        if not isinstance(record.get("graph_key"), str):
            raise ValueError("no graph key")
        if record.get("kind", "inference") == "training":
            _check_training(record)
        record["views"] = [OutputView(**fields) for fields in artifact.decode(files["views.json"])]
        if record.get("kind", "inference") == "training":
            record["backward_views"] = [OutputView(**fields)
                                        for fields in artifact.decode(files["backward_views.json"])]
        return record
    except (KeyError, TypeError, ValueError, UnicodeDecodeError, AttributeError) as err:
        # (ArtifactError is a ValueError)
        logs.log("cache", "front cache: entry %s unreadable (%s)", front_key[:12], err)
        return None


def conditions(options: Options) -> list:
    """What a compile depends on besides its graph and inputs: the knobs in the key and
    `compile_state`."""
    return [graph_cache.knobs_in_key(options), compile_state()]


def _check_training(record: dict) -> None:
    if not isinstance(record["backward_key"], str) or not isinstance(record["deterministic"], bool):
        raise ValueError("no backward key")
    counts = [record["outputs"], record["saved"], *record["non_differentiable"], *record["tangent_outputs"],
              *record["no_gradient"]]
    if not all(type(c) is int and c >= 0 for c in counts):
        raise ValueError("a count that is not a count")
    if len(record["tangents"]) != len(record["tangent_outputs"]):
        raise ValueError("tangents unlike the outputs taking them")
    for sizes, strides, dtype in record["tangents"]:
        if not isinstance(getattr(torch, dtype), torch.dtype) or len(sizes) != len(strides) \
                or not all(type(d) is int for d in (*sizes, *strides)):
            raise ValueError(f"a tangent layout that does not read: {sizes}, {strides}, {dtype}")


def store(front_key: str, record: dict, views: list, backward_views: list | None = None) -> bool:
    """Write the entry `record` (its graph keys, the inputs CUDA graphs keep in place; a training
    entry's function shape) under `front_key`, with the outputs rebuilt as views after the call
    (`output_views`): the graph's, and a training entry's backward's (`backward_views`)."""
    try:
        with real_tensors():
            files = {"views.json": artifact.encode([v._asdict() for v in views])}
            if backward_views is not None:
                files["backward_views.json"] = artifact.encode([v._asdict() for v in backward_views])
    except artifact.ArtifactError as err:
        logs.log("cache", "front cache: entry not written (%s)", err)
        return False
    return front_cache().put(front_key, {"entry.json": json.dumps(record).encode(), **files})


__all__ = ["key", "load", "store", "plain_runtime", "bumped_versions", "plain_training", "backward_function", "TrainingEntry",
           "conditions", "compile_state", "front_cache", "FORMAT"]
