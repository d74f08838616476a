"""`fusion.masking.vanishes_when_masked` answers by evaluating the expressions on random values;
every layer of a model asks it the same question about other buffers, so the answer is
remembered by the question's shape. Renamed buffers share an answer; a different question —
another structure, or one buffer read in two roles — does not."""
import math

import sympy

from tilefuse.fusion import masking
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import Const, Index, Load, binary, unary, where
from tilefuse.ir.monoid import MAX, SUM

i, j = sympy.symbols("i0 r0", integer=True, nonnegative=True)
F32 = dt.float32


def _scores(s: str, keep: str):
    masked = where(Load(keep, (Index(i), Index(j)), dt.bool_), Load(s, (Index(i), Index(j)), F32),
                   Const(-math.inf, F32))
    return masked


def _weights(masked, row_max: str):
    return unary("exp", binary("sub", masked, Load(row_max, (Index(i), Index(sympy.Integer(0))), F32)))


def test_a_renamed_question_is_answered_once(monkeypatch):
    calls = []
    real = masking._vanishes_when_masked
    monkeypatch.setattr(masking, "_vanishes_when_masked", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(masking, "_VANISHES_MEMO", {})
    first = _scores("buf10", "keep")
    second = _scores("buf90", "keep7")
    assert masking.vanishes_when_masked(_weights(first, "buf11"), first, SUM)
    assert masking.vanishes_when_masked(_weights(second, "buf91"), second, SUM)
    assert len(calls) == 1  # the second layer's question is the first's, renamed


def test_a_different_question_is_not_conflated(monkeypatch):
    monkeypatch.setattr(masking, "_VANISHES_MEMO", {})
    masked = _scores("s", "keep")
    assert masking.vanishes_when_masked(_weights(masked, "m"), masked, SUM)
    # the same shape but the body reads the scores unmasked: a skipped tile would change it
    unmasked = Load("s", (Index(i), Index(j)), F32)
    assert not masking.vanishes_when_masked(_weights(unmasked, "m"), masked, SUM)
    # the same shape with the row max read from the scores' own buffer: renamed in order of
    # appearance, it is another question (the body reads the scores outside the mask)
    assert not masking.vanishes_when_masked(_weights(masked, "s"), masked, SUM)
    # and another combiner is another question
    assert masking.vanishes_when_masked(masked, masked, MAX) is not None
