"""The OpInfo sweep: PyTorch's own op samples (`op_db`) through
`torch.compile(backend="tilefuse", fullgraph=True)`, each op classified.

For every OpInfo and dtype (float32, bfloat16, int64 by default) the first few sample inputs
are compiled and run with `TILEFUSE_FALLBACK=error`, and the outputs are judged by the fp64 rule
(`tilefuse.compare`). The compile reports (the ones `tilefuse.explain` prints) say what each graph
became. An (op, dtype) is, worst sample first:

* `error` — tilefuse raised (a bug, unless listed in `EXPECTED` with its reason);
* `mismatch` — wrong numbers (a bug; zero is the rule);
* `graph-break` — Dynamo could not capture the op in one graph (PyTorch's limit, not ours);
* `extern` — compiled, and at least one ATen extern call was needed;
* `generated` — compiled to generated kernels only (or to no kernel at all: views);
* `skipped` — the dtype is unsupported, there is no sample, eager itself fails on the
  sample, or the op is nondeterministic (random numbers, uninitialised memory).

`run_sweep(...)` returns the results; `tilefuse ops --sweep` runs it all with a progress bar.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils import _pytree as pytree

from ..compare import compare_outputs, to_fp64
from .outcome import tilefuse_error_in

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}
ORDER = ("error", "mismatch", "graph-break", "extern", "generated", "skipped")

#: results that are not compared: the op is random or returns uninitialised memory
NONDETERMINISTIC = {
    "bernoulli", "normal", "normal.number_mean", "normal.in_place", "log_normal", "randn", "randn_like",
    "rand_like", "randint", "randint_like", "uniform", "exponential", "geometric", "cauchy", "multinomial",
    "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d", "nn.functional.alpha_dropout",
    "nn.functional.feature_alpha_dropout.with_train", "nn.functional.rrelu", "empty", "empty_like", "new_empty",
    "new_empty_strided", "empty_strided", "empty_permuted", "torch._C._nn._test_warn_in_autograd",
}

_NO_INTERPRETER_SPELLING = ("libdevice math the Triton interpreter cannot run (CPU only: the graph falls back "
                            "to eager with a warning; generated on GPUs)")
#: known failures: (op, dtype or "*") -> reason. Kept small; each one is a known limit or an
#: open bug named as such.
EXPECTED: dict = {
    **{(op, "*"): _NO_INTERPRETER_SPELLING for op in ("acos", "asin", "asinh", "atan", "atan2", "arctan2",
                                                       "lgamma", "acosh", "atanh", "erfinv", "digamma",
                                                       "polygamma.polygamma_n_0", "mvlgamma.mvlgamma_p_1",
                                                       "mvlgamma.mvlgamma_p_3", "mvlgamma.mvlgamma_p_5")},
}

#: the CI subset: representative ops of every family (pointwise, reduction, normalisation,
#: views, indexing, matmul, extern), float32 and one bf16 / int case each
CI_SUBSET = (
    ("add", "float32"), ("mul", "bfloat16"), ("sigmoid", "float32"), ("nn.functional.gelu", "bfloat16"),
    ("where", "float32"), ("clamp", "float32"), ("sum", "float32"), ("amax", "int64"), ("var", "float32"),
    ("softmax", "float32"), ("log_softmax", "bfloat16"), ("nn.functional.layer_norm", "float32"),
    ("transpose", "float32"), ("flip", "int64"), ("cat", "float32"), ("index_select", "float32"),
    ("mm", "float32"), ("bmm", "bfloat16"), ("sort", "float32"), ("bitwise_and", "int64"),
    # regressions: a literal cast inside an expression; complex intermediates as externs
    ("nn.functional.hinge_embedding_loss", "bfloat16"), ("view_as_complex", "float32"),
    # data-dependent sizes bound from the extern that makes them; an op behind effect tokens
    ("nonzero", "float32"), ("linalg.inv", "float32"),
)


@dataclass
class OpResult:
    op: str
    dtype: str
    status: str
    detail: str = ""
    samples: int = 0
    kernels: int = 0
    externs: list = field(default_factory=list)
    seconds: float = 0.0


def op_name(info) -> str:
    return info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")


def load_op_db() -> list:
    """PyTorch's OpInfo list (needs the `expecttest` package that PyTorch's test tools import)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db
    return list(op_db)


def _flatten_sample(sample):
    """The sample's tensors as a flat list and a function of that list that calls the op."""
    tree = (sample.input, tuple(sample.args), dict(sample.kwargs))
    leaves, spec = pytree.tree_flatten(tree)
    slots = [k for k, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = [leaves[k] for k in slots]

    def rebuild(args):
        filled = list(leaves)
        for k, t in zip(slots, args):
            filled[k] = t
        return pytree.tree_unflatten(filled, spec)

    return tensors, rebuild


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"


def check_sample(info, sample) -> tuple[str, str, int, list]:
    """(status, detail, kernels, externs) of one sample."""
    from .. import api
    from ..config import config

    tensors, rebuild = _flatten_sample(sample)

    def call(*args):
        inp, a, kw = rebuild(args)
        return info.op(inp, *a, **kw)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            eager = call(*tensors)
    except Exception as err:  # noqa: BLE001 - a sample eager rejects tests nothing
        return "skipped", f"eager fails: {_first_line(err)}", 0, []
    try:
        ref = call(*to_fp64(tensors)) if any(t.is_floating_point() for t in tensors) else None
    except Exception:  # noqa: BLE001 - no fp64 reference for this op: compare with eager
        ref = None
    reports: list = []
    api._report_sinks.append(reports)
    torch._dynamo.reset()
    try:
        with config.patch(fallback="error"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = torch.compile(call, backend="tilefuse", fullgraph=True)(*tensors)
    except Exception as err:  # noqa: BLE001 - classified
        ours = tilefuse_error_in(err)
        if ours is not None:
            return "error", str(ours).splitlines()[0][:400], 0, []
        if isinstance(err, torch._dynamo.exc.TorchDynamoException) or "dynamo" in type(err).__module__:
            return "graph-break", _first_line(err), 0, []
        return "error", _first_line(err), 0, []
    finally:
        api._report_sinks.remove(reports)
        torch._dynamo.reset()
    kernels = sum(len(r.kernels) for r in reports)
    externs = sorted({target for r in reports for _, target, _ in r.externs})
    if op_name(info) in NONDETERMINISTIC:
        return "skipped", "nondeterministic: not compared", kernels, externs
    try:
        bad = compare_outputs(compiled, eager, ref)
    except Exception as err:  # noqa: BLE001 - outputs of unexpected kinds
        return "mismatch", f"cannot compare outputs: {_first_line(err)}", kernels, externs
    if bad is not None:
        return "mismatch", str(bad), kernels, externs
    if externs:
        return "extern", ", ".join(externs), kernels, externs
    return "generated", "", kernels, externs


def check_op(info, dtype: str, samples: int = 2) -> OpResult:
    t0 = time.perf_counter()
    name = op_name(info)
    torch_dtype = DTYPES[dtype]
    result = OpResult(name, dtype, "skipped")
    if torch_dtype not in info.supported_dtypes("cpu"):
        result.detail = "dtype not supported by the op"
        return result
    try:
        sample_list = []
        for s in info.sample_inputs("cpu", torch_dtype, requires_grad=False):
            sample_list.append(s)
            if len(sample_list) >= samples:
                break
    except Exception as err:  # noqa: BLE001 - OpInfo's own sample generator failed
        result.detail = f"no samples: {_first_line(err)}"
        return result
    if not sample_list:
        result.detail = "no samples"
        return result
    worst = None
    for sample in sample_list:
        status, detail, kernels, externs = check_sample(info, sample)
        result.samples += 1
        result.kernels += kernels
        result.externs = sorted(set(result.externs) | set(externs))
        if worst is None or ORDER.index(status) < ORDER.index(worst[0]) or \
                (worst[0] == "skipped" and status != "skipped"):
            worst = (status, detail)
    # a sample that compiled outranks samples that were skipped
    result.status, result.detail = worst
    expected = EXPECTED.get((name, dtype)) or EXPECTED.get((name, "*"))
    if expected and result.status in ("error", "mismatch"):
        result.detail = f"expected: {expected} ({result.detail})"
        result.status = "xfail"
    result.seconds = time.perf_counter() - t0
    return result


def _rank(status: str) -> int:
    order = ("error", "mismatch", "xfail", "graph-break", "extern", "generated", "skipped")
    return order.index(status)


def run_sweep(dtypes=("float32", "bfloat16", "int64"), ops: list | None = None, samples: int = 2,
              progress: Callable[[OpResult], None] | None = None, select: Callable | None = None) -> list:
    """Check every OpInfo (or the names in `ops`) for every dtype; returns OpResults."""
    infos = load_op_db()
    if ops is not None:
        wanted = set(ops)
        infos = [i for i in infos if op_name(i) in wanted]
    results = []
    for info in infos:
        for dtype in dtypes:
            if select is not None and not select(op_name(info), dtype):
                continue
            r = check_op(info, dtype, samples)
            results.append(r)
            if progress is not None:
                progress(r)
    return results


def run_subset(pairs=CI_SUBSET, samples: int = 1) -> list:
    """The CI subset: (op, dtype) pairs."""
    wanted = set(pairs)
    return run_sweep(dtypes=tuple(DTYPES), ops=[op for op, _ in pairs], samples=samples,
                     select=lambda name, dtype: (name, dtype) in wanted)


def coverage(results: list) -> dict:
    """{dtype: {status: count}} plus "all" (an op counts once per dtype)."""
    table: dict = {}
    for r in results:
        for key in (r.dtype, "all"):
            row = table.setdefault(key, {s: 0 for s in ("generated", "extern", "graph-break", "mismatch", "error",
                                                          "xfail", "skipped")})
            row[r.status] = row.get(r.status, 0) + 1
    return table


def format_coverage(results: list) -> str:
    table = coverage(results)
    cols = ("generated", "extern", "graph-break", "mismatch", "error", "xfail", "skipped")
    lines = [f"{'dtype':<10}" + "".join(f"{c:>13}" for c in cols) + f"{'tested':>9}"]
    for key, row in sorted(table.items(), key=lambda kv: (kv[0] == "all", kv[0])):
        tested = sum(row[c] for c in cols if c != "skipped")
        lines.append(f"{key:<10}" + "".join(f"{row[c]:>13}" for c in cols) + f"{tested:>9}")
    return "\n".join(lines)
