"""Shrinking a failing fuzz program to a minimal one that still fails.

Greedy delta debugging over `check.program.Program`: try simpler candidates in a fixed order
and keep the first that still fails, until none does (or the budget of compilations is spent).
Candidates, simplest first: one output instead of several; any intermediate value as the only
output (a prefix of the program); a statement bypassed (its uses read one of its operands
instead); a statement taken out of its autocast region; inputs made contiguous; sizes made
smaller; bf16 or fp64 made fp32; `dynamic=True` dropped.
A candidate must still run eagerly (PyTorch checks its shapes) before it is compiled.
"""
from __future__ import annotations

import re
import warnings
from typing import Callable, Iterator

from .program import InputSpec, Program, prune, statement_name, used_names, without_region


def runs_eagerly(program: Program) -> bool:
    """Whether `program` is valid PyTorch (shapes agree) on its inputs."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program.function()(*program.make_inputs(0))
        return True
    except Exception:  # noqa: BLE001 - an invalid candidate is skipped
        return False


def _smaller(d: int) -> list:
    out = [1, 2, 3, d // 2, d - 1]
    return sorted({x for x in out if 1 <= x < d})


def candidates(p: Program) -> Iterator[Program]:
    if len(p.outputs) > 1:
        for o in p.outputs:
            yield prune(p.with_(outputs=(o,)))
    for line in p.lines[:-1]:
        yield prune(p.with_(outputs=(statement_name(line),)))
    for k, line in enumerate(p.lines):
        name = statement_name(line)
        for operand in sorted(used_names(line)):
            rest = tuple(re.sub(rf"\b{name}\b", operand, other) for other in p.lines[k + 1:])
            outputs = tuple(operand if o == name else o for o in p.outputs)
            if any(not o.startswith("v") for o in outputs) and not p.lines[k + 1:]:
                continue  # an input cannot be the output of an empty program
            yield prune(p.with_(lines=p.lines[:k] + rest, outputs=outputs))
    for k, line in enumerate(p.lines):
        if without_region(line) != line:
            yield p.with_(lines=p.lines[:k] + (without_region(line),) + p.lines[k + 1:])
    for k, spec in enumerate(p.inputs):
        if spec.layout != "contiguous":
            yield p.with_(inputs=p.inputs[:k] + (InputSpec(spec.name, spec.shape),) + p.inputs[k + 1:])
    for k, spec in enumerate(p.inputs):
        for j, d in enumerate(spec.shape):
            for smaller in _smaller(d):
                shape = spec.shape[:j] + (smaller,) + spec.shape[j + 1:]
                new = InputSpec(spec.name, shape, spec.layout)
                yield p.with_(inputs=p.inputs[:k] + (new,) + p.inputs[k + 1:])
    if p.dtype != "torch.float32":
        yield p.with_(dtype="torch.float32")
    if p.dynamic:
        yield p.with_(dynamic=False)


def _weight(p: Program) -> tuple:
    """Smaller is simpler: statements, outputs, autocast regions, inputs, elements, strided
    inputs, a dtype other than fp32, dynamic."""
    numel = sum(_prod(i.shape) for i in p.inputs)
    strided = sum(i.layout != "contiguous" for i in p.inputs)
    regions = sum(without_region(line) != line for line in p.lines)
    return (len(p.lines), len(p.outputs), regions, len(p.inputs), numel, strided, p.dtype != "torch.float32",
            p.dynamic)


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def shrink(program: Program, fails: Callable[[Program], bool], budget: int = 60,
           on_step: Callable[[Program], None] | None = None) -> tuple[Program, int]:
    """The smallest failing program found from `program` (which must fail), and the number of
    candidates compiled. `fails(candidate)` compiles and checks one candidate."""
    best, calls = program, 0
    seen = {best}
    improved = True
    while improved and calls < budget:
        improved = False
        for cand in candidates(best):
            if cand in seen or not cand.lines:
                continue
            seen.add(cand)
            if not _weight(cand) < _weight(best):
                continue
            if not runs_eagerly(cand):
                continue
            calls += 1
            if fails(cand):
                best, improved = cand, True
                if on_step is not None:
                    on_step(best)
                break
            if calls >= budget:
                break
    return best, calls
