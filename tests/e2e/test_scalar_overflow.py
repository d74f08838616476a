"""Scalars a tensor's type cannot hold: where eager PyTorch refuses them (`fill_`, `full`,
`masked_fill`, `clamp`, `hardtanh`, `add`'s alpha, `scalar_tensor` for `where`, an integer
tensor's `pow` exponent), the compiled program raises eager's own error; where eager takes them
(an unsigned type takes negatives down to −max, a float type takes infinities and NaN), the
compiled program computes what eager computes. Integer types and fp32 are checked; fp16 and
bf16 are not (eager's verdict there depends on the device and the tensor's size) and convert
to ±inf.

The oracle is eager PyTorch running the graph tilefuse is given: AOTAutograd's trace with
tilefuse's decompositions, run op by op. (The trace may already have converted a scalar: fp16's
`masked_fill(m, 1e5)`, which eager refuses, is traced as `scalar_tensor(1e5, dtype=float16)`,
which eager takes; every backend of `torch.compile` sees the latter.) Each case is compared
with that run, never with a hard-coded verdict."""
import random
import warnings

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd

import tilefuse
from tilefuse.api import _decompositions
from tilefuse.errors import TilefuseFallbackWarning

MASK = torch.tensor([True, False, True, False, False])
OPS = {
    "masked_fill": lambda x, v: x.masked_fill(MASK, v),
    "full": lambda x, v: torch.full((5,), v, dtype=x.dtype) + x,
    "fill_": lambda x, v: x.clone().fill_(v),
    "clamp_max": lambda x, v: x.clamp(max=v),
    "add_alpha": lambda x, v: torch.add(x, x, alpha=v),
    "where": lambda x, v: torch.where(MASK, x, v),
    "hardtanh": lambda x, v: torch.nn.functional.hardtanh(x, -1.0, v),
    "pow": lambda x, v: x ** v,
}
DTYPES = [torch.uint8, torch.int8, torch.int32, torch.int64, torch.float32, torch.float64]
VALUES = [300, -1, -255, -256, 2 ** 40, 2 ** 63 - 1, 1.5, -1.0, 1e5, 2.0 ** 63, 1e39, float("inf"), float("nan")]


def _run(fn, x, v):
    try:
        return fn(x, v), None
    except RuntimeError as err:
        return None, str(err).splitlines()[0]


def _traced_eager(fn):
    """`fn` as the graph tilefuse would be given, run eagerly op by op."""
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False,
                         backend=aot_autograd(fw_compiler=lambda gm, _: gm.forward, decompositions=_decompositions()))


def _cases(op, rng):
    """Every dtype with up to four values drawn by `rng`: two eager refuses for overflow and two
    it takes, where there are such (values eager refuses for another reason, as a float alpha
    for an integer tensor, are left out: tracing refuses them before tilefuse sees the graph)."""
    out = []
    for dtype in DTYPES:
        x = torch.tensor([3, 0, 7, 1, 2]).to(dtype)
        # (a list, not a dict by value: -1 == -1.0 and 2**63 == 2.0**63 would share an entry)
        errors = [_run(_traced_eager(OPS[op]), x, v)[1] for v in VALUES]
        refused = [v for v, err in zip(VALUES, errors) if err is not None and "without overflow" in err]
        taken = [v for v, err in zip(VALUES, errors) if err is None]
        picked = rng.sample(refused, min(2, len(refused))) + rng.sample(taken, min(2, len(taken)))
        out += [(dtype, v) for v in picked]
    return out


@pytest.mark.parametrize("op", sorted(OPS))
def test_out_of_range_scalars_behave_as_in_eager(op):
    fn = OPS[op]
    seed = random.randrange(2 ** 32)  # drawn afresh, named in any failure
    for dtype, value in _cases(op, random.Random(seed)):
        x = torch.tensor([3, 0, 7, 1, 2]).to(dtype)
        want, want_err = _run(_traced_eager(fn), x, value)
        torch._dynamo.reset()
        # (static: a value that changes between calls would become a symbol, which is not checked)
        compiled = torch.compile(fn, backend="tilefuse", dynamic=False,
                                 options={"fallback": "error", "graph_cache": False})
        got, got_err = _run(compiled, x, value)
        where = f"{op}({dtype}, {value!r}) (seed {seed})"
        if want_err is not None:
            assert got_err == want_err, f"{where}: eager raised {want_err!r}, compiled {got_err or got!r}"
        else:
            assert got_err is None, f"{where}: eager gave {want}, compiled raised {got_err!r}"
            # (bf16/fp16 `x + alpha·y` may round its product before the sum in eager's CPU kernel)
            torch.testing.assert_close(got, want, equal_nan=True, atol=0, rtol=2 ** -7, msg=where)


def test_the_error_is_explained_and_needs_no_fallback():
    x = torch.tensor([3, 0, 7], dtype=torch.uint8)
    torch._dynamo.reset()
    fn = lambda x: x.masked_fill(x > 2, 300)  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="uint8_t without overflow"):
            torch.compile(fn, backend="tilefuse")(x)
    assert not [w for w in caught if issubclass(w.category, TilefuseFallbackWarning)]
    text = str(tilefuse.last_compilations(1))
    assert "runs as written: value cannot be converted to type uint8_t without overflow" in text


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_fills_convert_as_ieee_says(dtype):
    """fp16/bf16 are not checked: a value beyond their range becomes ±inf (eager on a CPU takes
    it for a one-element tensor and refuses it for larger ones; CUDA refuses it)."""
    x = torch.tensor([3, 0, 7, 1, 2]).to(dtype)
    torch._dynamo.reset()
    fn = lambda x: (torch.full((5,), -1e39, dtype=x.dtype) + x, x.masked_fill(MASK, 1e39))  # noqa: E731
    low, filled = torch.compile(fn, backend="tilefuse", options={"fallback": "error"})(x)
    assert torch.isneginf(low).all()
    assert torch.isposinf(filled[MASK]).all() and torch.equal(filled[~MASK], x[~MASK])


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int64])
def test_negative_integer_powers_raise_as_in_eager(dtype):
    x = torch.tensor([3, 0, 2]).to(dtype)
    exponent = -random.randint(1, 9)
    with pytest.raises(RuntimeError) as want:
        _traced_eager(lambda x: x ** exponent)(x)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError) as got:
        torch.compile(lambda x: x ** exponent, backend="tilefuse", dynamic=False, options={"fallback": "error"})(x)
    assert str(got.value).splitlines()[0] == str(want.value).splitlines()[0] == \
        "Integers to negative integer powers are not allowed."
