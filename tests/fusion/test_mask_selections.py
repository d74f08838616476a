"""Comparisons of a two-valued selection read as the condition they test (`masking._condition`):
`where(c, 1, 0) == 0` is `not c` — nanoGPT's `tril == 0` once the buffer is a formula — and a
comparison is read with its constants as the program rounds them."""
import sympy

from tilefuse.fusion.masking import _condition
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import Binary, Const, Index, Where

I, J = sympy.Symbol("i", integer=True, nonnegative=True), sympy.Symbol("j", integer=True, nonnegative=True)
CAUSAL = Binary("le", Index(J), Index(I), dt.bool_)  # (j <= i: live)


def _select(on_true, on_false, dtype=dt.float32):
    return Where(CAUSAL, Const(on_true, dtype), Const(on_false, dtype), dtype)


def _cmp(op, sel, value, dtype=dt.float32):
    return Binary(op, sel, Const(value, dtype), dt.bool_)


def test_the_side_a_comparison_matches_picks_the_condition_or_its_negation():
    assert _condition(_cmp("eq", _select(1.0, 0.0), 1.0)) == CAUSAL
    assert _condition(_cmp("ne", _select(1.0, 0.0), 0.0)) == CAUSAL
    negated = _condition(_cmp("eq", _select(1.0, 0.0), 0.0))
    assert negated == Binary("gt", Index(J), Index(I), dt.bool_)
    assert _condition(_cmp("ne", _select(1.0, 0.0), 1.0)) == negated
    # a boolean compared with 0 or 1
    assert _condition(Binary("eq", CAUSAL, Const(0, dt.int64), dt.bool_)) == negated
    assert _condition(Binary("eq", CAUSAL, Const(1, dt.int64), dt.bool_)) == CAUSAL


def test_a_comparison_both_or_neither_side_matches_is_left_alone():
    for e in (_cmp("eq", _select(1.0, 1.0), 1.0), _cmp("eq", _select(1.0, 0.0), 2.0),
              _cmp("eq", _select("nan", 0.0), 0.0)):
        assert _condition(e) == e, e


def test_constants_are_compared_as_the_program_rounds_them():
    # 1 + 1e-9 is 1.0 in fp32: `m != 1.0` holds nowhere, so it is no mask on positions
    e = _cmp("ne", _select(1.0 + 1e-9, 1.0), 1.0)
    assert _condition(e) == e
    # 1.001 rounds to 1.0 in bf16 as well
    e = _cmp("ne", _select(1.001, 1.0, dt.bfloat16), 1.0, dt.bfloat16)
    assert _condition(e) == e
    assert _condition(_cmp("ne", _select(1.01, 1.0, dt.bfloat16), 1.0, dt.bfloat16)) == CAUSAL
