"""The differential fuzzer: random programs compiled by tilefuse and compared with eager.

Each case is a random `Program` (see `check.program`) run three ways — eagerly in its dtype,
eagerly in fp64 (the reference) and through `torch.compile(backend="tilefuse",
fullgraph=True)` with `TILEFUSE_FALLBACK=error` — and judged by the fp64 rule
(`tilefuse.compare`). A case is `ok`, a `mismatch` (wrong numbers), an `error` (tilefuse raised),
or `skipped` (eager or Dynamo rejected it: not ours). A failing case is shrunk
(`check.shrink`) and written as a standalone script that reruns it.

    report = run_fuzz(cases=200, seed=1)        # or: tilefuse fuzz --cases 200 --seed 1
"""
from __future__ import annotations

import functools
import hashlib
import os
import random
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..compare import compare_outputs, to_fp64
from .fuzz_threads import check_program_threaded
from .outcome import Outcome, compile_failure
from .program import Program, generate
from .shrink import shrink


@dataclass
class Failure:
    case: int
    outcome: Outcome
    program: Program
    shrunk: Program
    reproducer: str | None


@dataclass
class FuzzReport:
    seed: int
    cases: int = 0
    counts: dict = field(default_factory=lambda: {"ok": 0, "mismatch": 0, "error": 0, "skipped": 0})
    failures: list = field(default_factory=list)

    def summary(self) -> str:
        c = self.counts
        return (f"{self.cases} cases (seed {self.seed}): {c['ok']} ok, {c['mismatch']} mismatches, "
                f"{c['error']} errors, {c['skipped']} skipped")


def check_program(program: Program, seed: int = 0) -> Outcome:
    """Compile and run `program` once and judge it by the fp64 rule."""
    from ..config import config

    fn = program.function()
    args = program.make_inputs(seed)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            eager = fn(*args)
            ref = fn(*to_fp64(args))
    except Exception as err:  # noqa: BLE001 - not a valid program
        return Outcome("skipped", f"eager fails: {type(err).__name__}: {err}")
    torch._dynamo.reset()
    try:
        with config.patch(fallback="error"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = torch.compile(fn, backend="tilefuse", fullgraph=True, dynamic=program.dynamic)(*args)
    except Exception as err:  # noqa: BLE001 - classified below
        return compile_failure(err)
    finally:
        torch._dynamo.reset()
    bad = compare_outputs(compiled, eager, ref)
    if bad is not None:
        return Outcome("mismatch", str(bad))
    layout = layout_mismatch(compiled, eager)
    if layout is not None:
        return Outcome("mismatch", layout)
    return Outcome("ok")


def layout_mismatch(compiled, eager) -> str | None:
    """The first tensor output whose strides differ from eager's (dims of size 1 aside), as a
    message; None when they agree. A caller may `view` an output, or a backward read a saved
    one, by the strides eager gives it."""
    cs = compiled if isinstance(compiled, (list, tuple)) else [compiled]
    es = eager if isinstance(eager, (list, tuple)) else [eager]
    for k, (c, e) in enumerate(zip(cs, es)):
        if not (isinstance(c, torch.Tensor) and isinstance(e, torch.Tensor)) or e.numel() <= 1 or c.shape != e.shape:
            continue
        if any(n != 1 and a != b for n, a, b in zip(e.shape, c.stride(), e.stride())):
            return f"output {k}: strides {tuple(c.stride())}, eager's {tuple(e.stride())} (shape {tuple(e.shape)})"
    return None


def reproducer_source(program: Program, outcome: Outcome, seed: int = 0) -> str:
    """A standalone script that reruns `program` and exits non-zero while the bug is there."""
    detail = outcome.detail.replace('"""', "'''")
    return f'''"""tilefuse fuzzer reproducer ({outcome.status}): {detail}

Run with `python <this file>`. It exits with an error while the bug is present and prints
"ok" once it is fixed."""
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse.check.fuzz import layout_mismatch
from tilefuse.compare import compare_outputs, to_fp64


{program.function_source()}

def main():
    g = torch.Generator().manual_seed({seed})
    args = {program.inputs_source()}
    eager = program(*args)
    ref = program(*to_fp64(args))
    with tilefuse.config.patch(fallback="error"):
        compiled = torch.compile(program, backend="tilefuse", fullgraph=True, dynamic={program.dynamic})(*args)
    bad = compare_outputs(compiled, eager, ref) or layout_mismatch(compiled, eager)
    if bad is not None:
        raise SystemExit(f"MISMATCH: {{bad}}")
    print("ok: compiled matches eager under the fp64 rule, in eager's strides")


if __name__ == "__main__":
    main()
'''


def write_reproducer(program: Program, outcome: Outcome, out_dir: str, seed: int = 0) -> str:
    """Write the reproducer to a new file in `out_dir` (created exclusively, never through a
    link: a file already there is kept, and the script gets another name unless it is that
    file's own text)."""
    from ..cache import trust

    data = reproducer_source(program, outcome, seed).encode()
    os.makedirs(out_dir, exist_ok=True)
    stem = f"fuzz_repro_{hashlib.sha256(data).hexdigest()[:10]}"
    path = os.path.join(out_dir, stem + ".py")
    try:
        trust.create(path, data, mode=0o644)
    except FileExistsError:
        try:
            if trust.read(path, modes=False) == data:
                return path
        except OSError:
            pass
        path = trust.create_unique(out_dir, stem + "_", ".py", data)
    return path


def case_program(seed: int, case: int, max_ops: int = 6) -> Program:
    """The program of case `case` of a run seeded with `seed` (reproducible on its own)."""
    return generate(random.Random(seed * 1_000_003 + case), max_ops=max_ops)


def run_fuzz(cases: int, seed: int = 0, max_ops: int = 6, shrink_failures: bool = True, shrink_budget: int = 40,
             out_dir: str | None = None, progress: Callable[[int, Outcome], None] | None = None,
             checker: Callable[[Program], Outcome] | None = None, threads: int = 1) -> FuzzReport:
    """Run `cases` random programs; shrink and write a reproducer for each failure. With
    `threads` > 1 (and no `checker`), each case is called from that many threads at once
    (`fuzz_threads.check_program_threaded`)."""
    if checker is None:
        checker = check_program if threads <= 1 else functools.partial(check_program_threaded, threads=threads)
    report = FuzzReport(seed)
    for k in range(cases):
        program = case_program(seed, k, max_ops)
        outcome = checker(program)
        report.cases += 1
        report.counts[outcome.status] += 1
        if outcome.failed:
            shrunk = program
            if shrink_failures:
                shrunk, _ = shrink(program, lambda p: checker(p).status == outcome.status, budget=shrink_budget)
            final = checker(shrunk) if shrunk is not program else outcome
            path = write_reproducer(shrunk, final, out_dir) if out_dir else None
            report.failures.append(Failure(k, outcome, program, shrunk, path))
        if progress is not None:
            progress(k, outcome)
    return report
