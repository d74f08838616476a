"""Training graphs: each attention chain becomes one autograd function whose backward
recomputes the scores instead of reading saved probabilities.

A Dynamo graph of a training step is rewritten before AOTAutograd traces it. A chain

    s = f(q @ kᵀ, extras…)        any differentiable score function: scale, masks, biases,
                                  soft-capping, ALiBi (`extras` are its other inputs)
    p = softmax(s, dim=-1)
    o = cast…(dropout(p)) @ v     casts, and at most one dropout

whose intermediates nothing else reads becomes `_AttentionChain.apply(q, kᵀ, v, extras…)`:

* **forward** — the user's own ops for `f`, the softmax spelt out (`m = max s`, `l = Σ exp(s − m)`)
  on the scores in the dtype the user's softmax computed in, the casts and the product, plus
  the row statistics `m` and `log l` (apart: in a row masked throughout by a finite fill,
  `m + log l` rounds to `m`). The fusion planner makes this one flash kernel that also stores
  them (`fusion.flash`'s row statistics); the forward saves q, kᵀ, v, o, m and log l — never
  the probabilities. A dropout on the weights draws one seed (`random_ops.seed`) and keeps
  the weights where the counter-based uniform at their index is at least p
  (`random_ops.philox_uniform`): the mask is computed inside the flash kernel and only the
  seed is saved.
* **backward** — FlashAttention-2's derivation, with the score function's derivative taken by
  autograd from the user's own ops (so any `f` works, nothing is tabled):

      s  = f(q @ kᵀ)              recomputed, under the forward's autocast state
      p  = exp((s − m) − log l)
      z  = the forward's dropout mask over 1 − p, regenerated from the saved seed (1 without)
      dv, dp = the output product's vjp at dO (dp = (dO vᵀ) ∘ z)
      D  = rowsum(dO ∘ o)         = Σⱼ pᵢⱼ dpᵢⱼ, since o = (p ∘ z) @ v
      ds = p ∘ (dp − D)
      dq, dkᵀ, dextras = f's vjp at ds

  The fusion planner makes these flash-shaped kernels over recomputed scores
  (`fusion.recompute`).

Chains with randomness or in-place updates inside `f` are left alone (a recomputation would
differ), as are chains whose weights pass through anything but casts and one dropout
between the softmax and the product (`D = rowsum(dO ∘ o)` needs `o = (p ∘ z) @ v`), and
softmaxes over another dim.
"""
from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass

import torch
import torch.fx

from .. import logs
from . import random_ops  # noqa: F401 - torch.ops.tilefuse.seed and .philox_uniform

_MATMULS = {operator.matmul, torch.matmul, torch.bmm}
_MATMUL_METHODS = {"matmul", "bmm", "__matmul__"}
_SOFTMAX = {torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax}
_CASTS = {"to", "float", "half", "bfloat16", "double", "type_as", "type", "contiguous"}
_RANDOM = ("dropout", "rand", "bernoulli", "normal", "uniform", "multinomial", "poisson")


def _is_matmul(n: torch.fx.Node) -> bool:
    return (n.op == "call_function" and n.target in _MATMULS) or (n.op == "call_method" and n.target in _MATMUL_METHODS)


def _is_softmax(n: torch.fx.Node) -> bool:
    return (n.op == "call_function" and n.target in _SOFTMAX) or (n.op == "call_method" and n.target == "softmax")


def _name(n: torch.fx.Node) -> str:
    return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))


def _deterministic(n: torch.fx.Node) -> bool:
    """Whether recomputing `n` in the backward gives what the forward got."""
    if n.op not in ("call_function", "call_method"):
        return False
    name = _name(n).lower()
    inplace = name.endswith("_") and not name.endswith("__")
    return not inplace and not any(word in name for word in _RANDOM)


def _value(n):
    return n.meta.get("example_value") if isinstance(n, torch.fx.Node) else None


def _identity_weights(n: torch.fx.Node) -> bool:
    """A node between the softmax and the product that passes the weights on unchanged but for
    their dtype: a cast, or dropout that drops nothing."""
    if n.op == "call_method" and n.target in _CASTS:
        return True
    return _dropout_rate(n) == 0


def _dropout_rate(n: torch.fx.Node) -> float | None:
    """The probability `F.dropout` at `n` zeroes an element with (0 outside training); None
    when `n` is not an out-of-place dropout with a number for its probability."""
    if n.op != "call_function" or n.target is not torch.nn.functional.dropout:
        return None
    args = dict(zip(("input", "p", "training", "inplace"), n.args), **n.kwargs)
    p, training = args.get("p", 0.5), args.get("training", True)
    if training is False:
        return 0.0
    if training is not True or not isinstance(p, (int, float)) or isinstance(p, bool):
        return None
    if p == 0:
        return 0.0
    if args.get("inplace", False) is not False or not 0 < p < 1:
        return None  # (p = 1: eager zeroes everything; the traced chain does that)
    return float(p)


@dataclass
class Chain:
    """One attention chain found in a Dynamo graph (nodes of that graph)."""

    score: torch.fx.Node  # q @ kᵀ
    region: list  # f's nodes, in graph order (the softmax's input last)
    extras: list  # f's other inputs (nodes or constants), in order of first use
    softmax: torch.fx.Node
    weights: list  # casts between the softmax and the product
    output: torch.fx.Node  # cast…(p) @ v
    #: the probability a dropout among `weights` zeroes a weight with (0: none)
    dropout: float = 0.0


def _users_within(n: torch.fx.Node, allowed: set) -> bool:
    return all(u in allowed for u in n.users)


def find_chain(softmax: torch.fx.Node) -> Chain | str:
    """The chain around `softmax`, or why there is none."""
    x = softmax.args[0] if softmax.args else softmax.kwargs.get("input")
    dim = softmax.args[1] if len(softmax.args) > 1 else softmax.kwargs.get("dim")
    xv = _value(x)
    if not isinstance(xv, torch.Tensor) or dim not in (-1, xv.dim() - 1):
        return "the softmax is not over the last dim"
    # the weights: casts up to the product that reads them as its left operand
    weights, at, dropout = [], softmax, 0.0
    while True:
        users = list(at.users)
        if len(users) != 1:
            return "the probabilities are read outside the chain"
        (user,) = users
        if _is_matmul(user) and user.args[0] is at:
            output = user
            break
        rate = _dropout_rate(user)
        if rate and not dropout and user.args[0] is at:
            dropout = rate  # regenerated from a saved seed in the backward
        elif not _identity_weights(user) or user.args[0] is not at:
            return f"the probabilities pass through {_name(user)} before the product"
        weights.append(user)
        at = user
    # f: the nodes between one matmul and the softmax's input, read by nothing else
    ancestors, frontier = set(), [x]
    scores = set()
    while frontier:
        n = frontier.pop()
        if not isinstance(n, torch.fx.Node) or n in ancestors:
            continue
        if _is_matmul(n):
            scores.add(n)
            continue
        if n.op != "call_function" and n.op != "call_method":
            continue
        ancestors.add(n)
        frontier.extend(a for a in n.all_input_nodes)
    if len(scores) != 1:
        return f"{len(scores)} products reach the softmax's input"
    (score,) = scores
    below = set()  # descendants of the score product among the ancestors
    order = list(x.graph.nodes)
    for n in order:
        if n in ancestors and any(a is score or a in below for a in n.all_input_nodes):
            below.add(n)
    if x is not score and x not in below:
        return "the softmax's input does not depend on the product"
    region = [n for n in order if n in below]
    inside = set(region) | {softmax}
    for n in [score, *region]:
        if not _users_within(n, inside):
            return f"{n.name} is read outside the chain"
        if n is not score and not _deterministic(n):
            return f"{n.name} ({_name(n)}) would differ when recomputed"
    if len(x.users) != 1:
        return "the scores are read outside the chain"
    extras = []
    for n in region:
        for a in n.all_input_nodes:
            if a is not score and a not in below and a not in extras:
                extras.append(a)
    ov = _value(output)
    if not isinstance(ov, torch.Tensor) or tuple(ov.shape[:-1]) != tuple(xv.shape[:-1]):
        return "the output's rows are not the scores' rows"
    return Chain(score, region, extras, softmax, weights, output, dropout)


def _subgraph(gm: torch.fx.GraphModule, inputs: list, nodes: list, result) -> torch.fx.GraphModule:
    """A graph module computing `result` from `inputs` by copies of `nodes`."""
    graph = torch.fx.Graph()
    env = {n: graph.placeholder(f"in{k}") for k, n in enumerate(inputs)}
    for n in nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(env[result])
    return torch.fx.GraphModule(gm, graph)


def _output_graph(gm: torch.fx.GraphModule, chain: Chain) -> torch.fx.GraphModule:
    """`output(p, v, keep)`: the casts between the softmax and the product, each as the
    conversion to the dtype it produced (`type_as(xq)` reads another tensor only for its
    dtype), a dropout as the product with `keep` (the kept weights' scale, 0 where dropped),
    then a copy of the product."""
    graph = torch.fx.Graph()
    p, v, keep = graph.placeholder("p"), graph.placeholder("v"), graph.placeholder("keep")
    x = p
    for n in chain.weights:
        value = _value(n)
        if n.op == "call_method" and n.target in _CASTS and isinstance(value, torch.Tensor):
            x = graph.call_method("to", (x, value.dtype))
        elif _dropout_rate(n):
            x = graph.call_function(_dropped, (x, keep))
    args = (x, v) + tuple(chain.output.args[2:])
    out = graph.create_node(chain.output.op, chain.output.target, args, dict(chain.output.kwargs))
    graph.output(out)
    return torch.fx.GraphModule(gm, graph)


def _dropped(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Dropout with a given mask: x · keep, computed in float32 (or x's wider dtype) and
    rounded back, as eager's dropout kernel computes its low-precision inputs."""
    wide = torch.promote_types(x.dtype, torch.float32)
    return (x.to(wide) * keep.to(wide)).to(x.dtype)


def _keep_scale(seed: torch.Tensor, shape, rate: float) -> torch.Tensor:
    """Dropout's mask times its scale, float32: 1 / (1 − rate) where the counter-based uniform
    at the element's linear index is at least `rate`, else 0 (`random_ops`)."""
    u = torch.ops.tilefuse.philox_uniform(seed, list(shape))
    return (u >= rate).to(torch.float32) * (1.0 / (1.0 - rate))


@dataclass(frozen=True)
class ChainFunctions:
    """A chain's pieces as callables: `scores(q, kᵀ, *extras)`, `output(p, v, keep)` and the dtype
    the user's softmax returned."""

    scores: torch.fx.GraphModule
    output: torch.fx.GraphModule
    softmax_dtype: torch.dtype
    #: the user's frames at the softmax: the backward's ops are traced as coming from there
    stack_trace: str | None = None
    #: dropout's probability on the weights (0: none), and the number that keeps this chain's
    #: seed apart from other chains' of its graph (`random_ops.seed`)
    dropout: float = 0.0
    tag: int = 0
    #: a row whose scores are all −inf gives probabilities 0 (`aten._safe_softmax`, as
    #: FlexAttention's definition has it) instead of NaN, and no gradient
    safe_rows: bool = False


class _AttentionChain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fns: ChainFunctions, q, k, v, *extras):
        s = fns.scores(q, k, *extras)
        x = _softmax_input(s, fns.softmax_dtype)
        m = x.amax(-1, keepdim=True)
        total = torch.exp(x - m).sum(-1, keepdim=True)
        p = torch.exp(x - m) / total
        dead = (m == float("-inf")) if fns.safe_rows else None
        if dead is not None:
            p = torch.where(dead, 0.0, p)
        p = p.to(fns.softmax_dtype)
        seed = torch.ops.tilefuse.seed(q, fns.tag) if fns.dropout else None
        keep = _keep_scale(seed, p.shape, fns.dropout) if fns.dropout else None
        o = fns.output(p, v, keep)
        # m and log l apart, not their sum: in a row masked throughout by a finite fill
        # (finfo.min) m + log l rounds to m, and exp(s − lse) would give 1, not 1/T
        log_total = torch.log(total)
        if dead is not None:  # (the backward's exp((s − m) − log l) is then 0 on such a row)
            m, log_total = torch.where(dead, 0.0, m), torch.where(dead, float("inf"), log_total)
        device = q.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.fns = fns
        tensors = [t if isinstance(t, torch.Tensor) else None for t in extras]
        ctx.constants = [None if isinstance(t, torch.Tensor) else t for t in extras]
        ctx.save_for_backward(q, k, v, o, m, log_total, seed, *tensors)
        return o

    @staticmethod
    def backward(ctx, do):
        with _traced_at(ctx.fns.stack_trace):
            return _recomputed_grads(ctx, do)


def _recomputed_grads(ctx, do) -> tuple:
    """The chain's gradients from what its forward saved (the module's docstring)."""
    q, k, v, o, m, log_total, seed, *tensors = ctx.saved_tensors
    extras = [t if c is None else c for t, c in zip(tensors, ctx.constants)]
    needs = ctx.needs_input_grad[1:]
    device, enabled, dtype = ctx.autocast
    fns = ctx.fns

    def leaf(t, need):
        return t.detach().requires_grad_(need) if isinstance(t, torch.Tensor) and need else t

    inputs = [leaf(t, n) for t, n in zip((q, k, *extras), (needs[0], needs[1], *needs[3:]))]
    with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
        s = fns.scores(*inputs)
    p = torch.exp((_softmax_input(s.detach(), fns.softmax_dtype) - m) - log_total)
    weights = p.to(fns.softmax_dtype).requires_grad_(True)
    value = leaf(v, needs[2])
    keep = _keep_scale(seed, p.shape, fns.dropout) if fns.dropout else None  # the forward's mask
    with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
        out = fns.output(weights, value, keep)
    wrt = [weights] + ([value] if needs[2] else [])
    grads = torch.autograd.grad(out, wrt, do)
    dp, dv = grads[0], (grads[1] if needs[2] else None)
    row = (do.to(p.dtype) * o.to(p.dtype)).sum(-1, keepdim=True)
    ds = (p * (dp.to(p.dtype) - row)).to(s.dtype)
    wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    found = iter(torch.autograd.grad(s, wanted, ds, allow_unused=True) if wanted else ())
    d_inputs = [next(found) if isinstance(t, torch.Tensor) and t.requires_grad else None for t in inputs]
    return (None, d_inputs[0], d_inputs[1], dv, *d_inputs[2:])


@contextlib.contextmanager
def _traced_at(stack_trace: str | None):
    """While AOTAutograd traces the backward, its nodes record `stack_trace` as the user's
    frames (the softmax's line), as the nodes of a built-in op's backward record its forward
    op's; elsewhere (or on a PyTorch without node-meta tracing) nothing changes."""
    try:
        from torch.fx import traceback as fx_traceback

        meta = fx_traceback.get_current_meta() if fx_traceback.has_preserved_node_meta() else None
    except AttributeError:
        meta = None
    if not stack_trace or not isinstance(meta, dict):
        yield
        return
    saved = meta.get("stack_trace")
    meta["stack_trace"] = stack_trace
    try:
        yield
    finally:
        if saved is None:
            meta.pop("stack_trace", None)
        else:
            meta["stack_trace"] = saved


def _softmax_input(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the user's softmax computed on: the scores in the dtype it returned (its `dtype=`
    argument, or autocast's fp32) — `softmax(x, dtype=bf16)` rounds x first — widened to at
    least fp32."""
    return s.to(dtype).to(torch.promote_types(dtype, torch.float32))


def _call_chain(fns: ChainFunctions, q, k, v, *extras):
    return _AttentionChain.apply(fns, q, k, v, *extras)


def rewrite(gm: torch.fx.GraphModule) -> int:
    """Rewrite every attention chain of a Dynamo graph in place; returns how many."""
    done = 0
    for softmax in [n for n in gm.graph.nodes if _is_softmax(n)]:
        chain = find_chain(softmax)
        if isinstance(chain, str):
            logs.log("graph", "%s: attention chain left as traced: %s", softmax.name, chain)
            continue
        q, k = chain.score.args[:2]
        v = chain.output.args[1]
        scores = _subgraph(gm, [q, k, *chain.extras], [chain.score, *chain.region],
                           chain.region[-1] if chain.region else chain.score)
        output = _output_graph(gm, chain)
        trace = chain.softmax.meta.get("stack_trace") or chain.output.meta.get("stack_trace")
        fns = ChainFunctions(scores, output, _value(chain.softmax).dtype, trace, chain.dropout, done)
        with gm.graph.inserting_before(chain.output):
            call = gm.graph.call_function(_call_chain, (fns, q, k, v, *chain.extras))
        call.meta.update(chain.output.meta)
        if trace:
            call.meta["stack_trace"] = trace  # (the forward's kernels: the attention's line)
        chain.output.replace_all_uses_with(call)
        for n in reversed([chain.score, *chain.region, chain.softmax, *chain.weights, chain.output]):
            gm.graph.erase_node(n)
        logs.log("graph", "%s: attention chain over %s becomes one autograd function (backward recomputes "
                 "the scores from the saved logsumexp)", call.name, chain.score.name)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
