"""Verify mode (`TILEFUSE_VERIFY=1`): check a compiled graph against eager on its first run and,
when it diverges, find the first kernel that computes something wrong.

The check runs the captured ATen graph eagerly and in fp64 and applies the fp64 rule
(`compare`) to the compiled outputs. On a mismatch the compiled graph is run again with a
hook that records the buffers written by every step — the state after each prefix of the
graph's steps — and the kernels are examined in order: each kernel's outputs are recomputed by
the reference interpreter (`ir.interpret`) from the very buffers the kernel read in the
compiled run, so an error made upstream is not blamed on a later kernel. The first kernel whose
outputs disagree is reported with its nodes, the max error (against the interpreter from the
same inputs, and against the interpreter run of the whole graph) and a pointer to
`tilefuse.explain`.

The public API runs it (`tilefuse.compile(..., verify=True)`), so it sits with the driver, below
the API.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .ir import graph as G
from .ir.interpret import bind_symbols, evaluate_pointwise, evaluate_reduce, run_extern, run_scatter
from .compare import Mismatch, compare_outputs, compare_tensor, to_fp64


@dataclass
class KernelDivergence:
    kernel: str
    kind: str
    nodes: list
    buffer: str
    error: float  # max |kernel - interpreter| from the same inputs
    allowed: float
    global_error: float | None  # max |kernel - interpreter run of the whole graph|
    definitions: list = field(default_factory=list)  # IR text of the kernel's nodes
    source_lines: list = field(default_factory=list)  # the user's lines the kernel computes


@dataclass
class VerifyResult:
    graph: str
    mismatch: Mismatch | None
    divergence: KernelDivergence | None = None
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.mismatch is None

    def __str__(self) -> str:
        if self.ok:
            return f"TILEFUSE_VERIFY: {self.graph} matches eager"
        lines = [f"TILEFUSE_VERIFY: {self.graph} diverges from eager: {self.mismatch}"]
        d = self.divergence
        if d is not None:
            lines.append(f"first diverging kernel: {d.kernel} [{d.kind}] computing {', '.join(d.nodes)}")
            lines.extend(f"  from {line}" for line in d.source_lines)
            glob = f"; {d.global_error:.3g} against the interpreter run of the whole graph" \
                if d.global_error is not None else ""
            lines.append(f"  {d.buffer}: max error {d.error:.3g} against the reference interpreter "
                         f"from the same inputs (allowed {d.allowed:.3g}){glob}")
            lines.extend(f"  {line}" for line in d.definitions)
            lines.append(f"run tilefuse.explain(fn, *inputs) to see {d.kernel}'s plan, decisions and source")
        elif self.note:
            lines.append(self.note)
        return "\n".join(lines)


def _cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu(v) for v in value)
    return value


def _initial_buffers(graph: G.Graph, args) -> dict:
    bufs = {}
    for node in graph.nodes.values():
        if isinstance(node, G.Input):
            bufs[node.name] = _cpu(args[node.position])
        elif isinstance(node, G.ScalarInput):
            bufs[node.name] = torch.tensor(int(args[node.position]))
        elif isinstance(node, G.Constant):
            bufs[node.name] = _cpu(node.value)
    return bufs


def evaluate_nodes(graph: G.Graph, want, available: dict, env: dict) -> dict:
    """Interpreter values of the nodes `want`, computing whatever they need that `available`
    (name -> tensor) does not hold. Returns `available` extended with what was computed."""
    needed: set = set()
    stack = list(want)
    while stack:
        name = stack.pop()
        if name in needed or name in available or name not in graph.nodes:
            continue
        needed.add(name)
        stack.extend(graph[name].inputs())
    bufs = dict(available)
    for name, node in graph.nodes.items():
        if name not in needed:
            continue
        if isinstance(node, G.Pointwise):
            bufs[name] = evaluate_pointwise(node, bufs, env)
        elif isinstance(node, G.Reduce):
            bufs[name] = evaluate_reduce(node, bufs, env)
        elif isinstance(node, G.Scatter):  # into a copy: the recorded inputs stay as they were
            bufs[name] = run_scatter(node, {**bufs, node.target: bufs[node.target].clone()}, env)
        elif isinstance(node, G.Extern):
            bufs[name] = run_extern(node, bufs, env)
        elif isinstance(node, G.ExternResult):
            bufs[name] = bufs[node.extern][node.item]
    return bufs


def _definitions(graph: G.Graph, nodes) -> list:
    from .ir.printer import format_graph

    text = format_graph(graph).splitlines()
    out = []
    for n in nodes:
        line = next((t.strip() for t in text if t.strip().startswith(f"{n}:")), None)
        if line:
            out.append(line if len(line) <= 200 else line[:197] + "...")
    return out


def find_diverging_kernel(compiled, args, report=None) -> KernelDivergence | None:
    """Run `compiled` (a runtime CompiledGraph) recording each step's outputs, and return the
    first kernel whose outputs differ from the reference interpreter's values computed from the
    same inputs; None when every kernel agrees."""
    from .runtime.compiled import KernelStep

    graph = compiled.graph
    snapshots: dict = {}  # buffer -> value right after the step that wrote it
    order: list = []

    in_place = {target: name for name, target in getattr(compiled, "in_place", {}).items()}

    def written(step) -> list:  # an in-place write's kernel writes its input: the write's node
        return [in_place.get(n, n) for n in step.writes]

    def record(k, step, buffers):
        names = written(step) if isinstance(step, KernelStep) else \
            [step.name] + [n for n, _ in compiled.extern_results.get(step.name, ())]
        for n in names:
            if n in buffers and n in graph.nodes:
                snapshots[n] = _cpu(buffers[n])
        order.append((k, step))

    base = _initial_buffers(graph, args)  # before the run: it may write its inputs
    compiled.run(list(args), on_step=record)
    env = bind_symbols(graph, args)
    try:
        whole = evaluate_nodes(graph, list(graph.nodes), {k: _cpu(v) for k, v in base.items()}, env)  # (writes inputs)
    except Exception:  # noqa: BLE001 - only used for the report's second figure
        whole = {}
    kernels = {k.name: k for k in (report.kernels if report is not None else [])}
    available = dict(base)
    for _, step in order:
        writes = [n for n in (written(step) if isinstance(step, KernelStep) else [step.name]) if n in graph.nodes]
        if isinstance(step, KernelStep):
            local = evaluate_nodes(graph, writes, available, env)
            for n in writes:
                got, want = snapshots.get(n), local.get(n)
                if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
                    continue
                bad = compare_tensor(got, want, None)
                if bad is not None:
                    info = kernels.get(step.name)
                    nodes = list(info.nodes) if info is not None else writes
                    glob = None
                    if isinstance(whole.get(n), torch.Tensor) and got.shape == whole[n].shape and got.is_floating_point():
                        diff = (got.double() - whole[n].double()).abs()
                        glob = diff[torch.isfinite(diff)].max().item() if bool(torch.isfinite(diff).any()) else float("inf")
                    return KernelDivergence(step.name, info.kind if info is not None else "kernel", nodes, n,
                                            bad.error, bad.allowed, glob, _definitions(graph, nodes),
                                            list(getattr(info, "source_lines", ()))[:3])
        for n in writes + ([n for n, _ in compiled.extern_results.get(step.name, ())]
                           if not isinstance(step, KernelStep) else []):
            if n in snapshots:
                available[n] = snapshots[n]
    return None


def _as_found(args, before: dict | None) -> list:
    """The call's inputs with each input the graph writes replaced by a fresh copy of its value
    before the call (`before`: position -> that value), so every run starts where it did."""
    args = list(args)
    for k, t in (before or {}).items():
        args[k] = t.clone()
    return args


def verify_graph(name: str, eager_fn, compiled, args, out, report=None, before: dict | None = None) -> VerifyResult:
    """Apply the fp64 rule to `out` (the compiled outputs for `args`) against `eager_fn` (the
    captured ATen graph run eagerly); on a mismatch, find the first diverging kernel.
    `before`: copies of the inputs the graph writes, as the call found them; the eager, fp64
    and bisecting runs each start from those (never from the program's own tensors)."""
    eager = eager_fn(*_as_found(args, before))
    try:
        ref = eager_fn(*to_fp64(_as_found(args, before)))
    except Exception:  # noqa: BLE001 - some graphs cannot run in fp64 (dtype-specific ops)
        ref = None
    mismatch = compare_outputs(out, eager, ref)
    if mismatch is None:
        return VerifyResult(name, None)
    result = VerifyResult(name, mismatch)
    if not hasattr(compiled, "run") or not hasattr(compiled, "graph"):
        result.note = "(this compiled graph cannot be bisected)"
        return result
    try:
        result.divergence = find_diverging_kernel(compiled, _as_found(args, before), report)
    except Exception as err:  # noqa: BLE001 - the report must not hide the mismatch
        result.note = f"(bisecting the kernels failed: {type(err).__name__}: {err})"
        return result
    if result.divergence is None:
        result.note = ("every kernel agrees with the reference interpreter from its own inputs: the "
                       "difference comes from accumulated rounding, an extern, or the output layout; "
                       "run tilefuse.explain(fn, *inputs) to see the kernels")
    return result
