"""The fuzzer's threaded mode: one compiled program called from several threads at once.

A compiled function is shared by every thread that calls it, so a launch that keeps per-call
state where another call can reach it gives one thread another's result, or corrupts memory.
Here the program is compiled once (on the first call, in this thread), then each of `threads`
threads calls it `calls` times on inputs of its own, all starting together; every result is
judged against eager on the same inputs by the fp64 rule (`tilefuse.compare`).

    run_fuzz(cases=50, seed=1, threads=4)
"""
from __future__ import annotations

import threading
import warnings

import torch

from ..compare import compare_outputs, to_fp64
from .outcome import Outcome, compile_failure
from .program import Program


def check_program_threaded(program: Program, seed: int = 0, threads: int = 4, calls: int = 4) -> Outcome:
    """Compile `program` once, call it from `threads` threads at once and judge every result."""
    from .. import api

    fn = program.function()
    inputs = [program.make_inputs(seed + k) for k in range(threads)]  # thread k's own inputs
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = [(fn(*args), fn(*to_fp64(args))) for args in inputs]
    except Exception as err:  # noqa: BLE001 - not a valid program
        return Outcome("skipped", f"eager fails: {type(err).__name__}: {err}")
    torch._dynamo.reset()
    try:
        # fallback="error" bound to the compiled function: the worker threads have their own config
        compiled = api.compile(fn, fullgraph=True, dynamic=program.dynamic, fallback="error")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                compiled(*inputs[0])
        except Exception as err:  # noqa: BLE001 - classified as a single-threaded run's
            return compile_failure(err)
        return _run_together(compiled, inputs, expected, calls)
    finally:
        torch._dynamo.reset()


def _run_together(compiled, inputs: list, expected: list, calls: int) -> Outcome:
    start, failures = threading.Barrier(len(inputs)), []

    def work(k: int) -> None:
        start.wait()
        try:
            for call in range(calls):
                bad = compare_outputs(compiled(*inputs[k]), *expected[k])
                if bad is not None:
                    failures.append(Outcome("mismatch", f"thread {k}, call {call}: {bad}"))
                    return
        except Exception as err:  # noqa: BLE001 - reported below
            failures.append(compile_failure(err))

    workers = [threading.Thread(target=work, args=(k,), name=f"tilefuse-fuzz-{k}") for k in range(len(inputs))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return failures[0] if failures else Outcome("ok")


__all__ = ["check_program_threaded"]
