"""Pointwise lowerings against eager (fp64 rule; exact for integer/bool results)."""

import pytest
import torch
import torch.nn.functional as F
from lowering_harness import check, noncontig, positive, rand

F32, BF16 = torch.float32, torch.bfloat16
DTYPES = [F32, BF16]


def unit(*shape, dtype=F32):
    return rand(*shape, dtype=dtype, low=-0.95, high=0.95)


# (name, fn, input maker)
UNARY = [
    ("exp", torch.exp, rand), ("exp2", torch.exp2, rand), ("expm1", torch.expm1, rand),
    ("log", torch.log, positive), ("log2", torch.log2, positive), ("log10", torch.log10, positive),
    ("log1p", torch.log1p, positive), ("sqrt", torch.sqrt, positive), ("rsqrt", torch.rsqrt, positive),
    ("sin", torch.sin, rand), ("cos", torch.cos, rand), ("tan", torch.tan, unit),
    ("asin", torch.asin, unit), ("acos", torch.acos, unit), ("atan", torch.atan, rand),
    ("sinh", torch.sinh, rand), ("cosh", torch.cosh, rand), ("tanh", torch.tanh, rand),
    ("asinh", torch.asinh, rand), ("acosh", lambda x: torch.acosh(x + 2), positive), ("atanh", torch.atanh, unit),
    ("sigmoid", torch.sigmoid, rand), ("erf", torch.erf, rand), ("erfc", torch.erfc, rand),
    ("reciprocal", torch.reciprocal, positive), ("lgamma", torch.lgamma, positive),
    ("neg", torch.neg, rand), ("abs", torch.abs, rand), ("sign", torch.sign, rand),
    ("floor", lambda x: torch.floor(x * 3), rand), ("ceil", lambda x: torch.ceil(x * 3), rand),
    ("trunc", lambda x: torch.trunc(x * 3), rand), ("round", lambda x: torch.round(x * 3), rand),
    ("round_decimals", lambda x: torch.round(x * 7, decimals=1), rand),
    ("round_neg_decimals", lambda x: torch.round(x * 300, decimals=-1), rand),
    ("relu", torch.relu, rand), ("square", torch.square, rand), ("frac", torch.frac, rand),
    ("isnan", lambda x: torch.isnan(torch.log(x)), rand), ("isinf", lambda x: torch.isinf(1 / x.round()), rand),
    ("isfinite", lambda x: torch.isfinite(torch.log(x)), rand), ("signbit", torch.signbit, rand),
    ("logical_not", torch.logical_not, lambda *s, dtype: rand(*s, dtype=dtype).round()),
    ("pow2", lambda x: x ** 2, rand), ("pow3", lambda x: x ** 3, rand), ("pow_half", lambda x: x ** 0.5, positive),
    ("pow_m1", lambda x: x ** -1, positive), ("pow_m2", lambda x: x ** -2, positive),
    ("pow_mhalf", lambda x: x ** -0.5, positive), ("pow_frac", lambda x: x ** 1.7, positive),
    ("pow_0", lambda x: x ** 0, rand), ("rpow", lambda x: 2.5 ** x, rand),
    ("nan_to_num", lambda x: torch.nan_to_num(torch.log(x) / x.round()), rand),
    ("nan_to_num_args", lambda x: torch.nan_to_num(torch.log(x) / x.round(), nan=1.5, posinf=9.0, neginf=-7.0), rand),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,fn,make", UNARY, ids=[u[0] for u in UNARY])
def test_unary(name, fn, make, dtype):
    check(fn, make(7, 13, dtype=dtype))


ACTIVATIONS = [
    ("gelu", F.gelu), ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh")), ("silu", F.silu),
    ("hardtanh", F.hardtanh), ("hardtanh_args", lambda x: F.hardtanh(x, -0.5, 2.0)),
    ("leaky_relu", F.leaky_relu), ("leaky_relu_slope", lambda x: F.leaky_relu(x, 0.2)), ("elu", F.elu),
    ("elu_alpha", lambda x: F.elu(x, alpha=0.7)), ("selu", F.selu), ("celu", lambda x: F.celu(x, 1.3)),
    ("softplus", F.softplus), ("softplus_beta", lambda x: F.softplus(x * 10, beta=2, threshold=5)),
    ("mish", F.mish), ("hardswish", F.hardswish), ("hardsigmoid", F.hardsigmoid), ("relu6", F.relu6),
    ("logsigmoid", F.logsigmoid), ("threshold", lambda x: F.threshold(x, 0.3, -2.0)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,fn", ACTIVATIONS, ids=[a[0] for a in ACTIVATIONS])
def test_activation(name, fn, dtype):
    check(fn, rand(5, 33, dtype=dtype))


BINARY = [
    ("add", torch.add), ("add_alpha", lambda a, b: torch.add(a, b, alpha=0.5)), ("sub", torch.sub),
    ("sub_alpha", lambda a, b: torch.sub(a, b, alpha=2)), ("mul", torch.mul), ("div", torch.div),
    ("div_trunc", lambda a, b: torch.div(a, b, rounding_mode="trunc")),
    ("div_floor", lambda a, b: torch.div(a, b, rounding_mode="floor")),
    ("floor_divide", torch.floor_divide), ("remainder", torch.remainder), ("fmod", torch.fmod),
    ("pow", lambda a, b: torch.pow(a.abs() + 0.5, b)), ("maximum", torch.maximum), ("minimum", torch.minimum),
    ("fmax", torch.fmax), ("fmin", torch.fmin), ("atan2", torch.atan2), ("copysign", torch.copysign),
    ("hypot", torch.hypot), ("lerp", lambda a, b: torch.lerp(a, b, 0.3)),
    ("lerp_big", lambda a, b: torch.lerp(a, b, 0.8)), ("lerp_tensor", lambda a, b: torch.lerp(a, b, torch.sigmoid(b))),
    ("xlogy", lambda a, b: torch.xlogy(a, b.abs())), ("rsub", lambda a, b: 1.5 - a * b),
    ("addcmul", lambda a, b: torch.addcmul(a, a, b, value=0.5)),
    ("addcdiv", lambda a, b: torch.addcdiv(a, a, b.abs() + 1, value=2)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,fn", BINARY, ids=[b[0] for b in BINARY])
def test_binary_broadcast(name, fn, dtype):
    # broadcasting (7, 1, 13) with (5, 1) and a transposed operand
    a = rand(7, 1, 13, dtype=dtype)
    b = noncontig(5, 13, dtype=dtype)
    check(fn, a, b)


SCALAR_OPS = [
    ("add", lambda x: x + 0.1), ("radd", lambda x: 3 + x), ("sub", lambda x: x - 1 / 3), ("rsub", lambda x: 2 - x),
    ("mul", lambda x: x * 0.1), ("div", lambda x: x / 3), ("rdiv", lambda x: 1.5 / x), ("floordiv", lambda x: x // 0.7),
    ("mod", lambda x: x % 0.7), ("fmod", lambda x: torch.fmod(x, -0.7)), ("max", lambda x: torch.clamp(x, min=0.1)),
    ("eq", lambda x: x.round() == 1.0), ("lt", lambda x: x < 0.1), ("ge", lambda x: x >= -1 / 3),
    ("ne", lambda x: x != 0.1),
]


@pytest.mark.parametrize("dtype", DTYPES)
def test_scalar_operands(dtype):
    check(lambda x: tuple(fn(x) for _, fn in SCALAR_OPS), rand(13, 7, dtype=dtype), names=[n for n, _ in SCALAR_OPS])


def test_comparison_rounds_scalar_to_bf16():
    # 0.1 rounds to 0.10009765625 in bf16: eager compares against the rounded value
    x = torch.tensor([0.10009765625, 0.0999, 0.1, -0.1, 0.2], dtype=BF16)
    check(lambda x: (x == 0.1, x < 0.1, x > 0.1, x <= 0.1), x)


COMPARE = ["eq", "ne", "lt", "le", "gt", "ge"]


@pytest.mark.parametrize("op", COMPARE)
def test_comparison_mixed_dtypes(op):
    f = getattr(torch, op)
    a = rand(7, 13, dtype=BF16).round()
    b = rand(13, dtype=F32).round()
    i = rand(7, 1, dtype=torch.int64)
    check(lambda a, b, i: (f(a, b), f(a, i), f(i, 1.5), f(b, i), f(a, torch.tensor(1.0))), a, b, i)


INT_BINARY = [
    ("add", torch.add), ("mul", torch.mul), ("sub_alpha", lambda a, b: torch.sub(a, b, alpha=3)),
    ("div_true", torch.div), ("div_trunc", lambda a, b: torch.div(a, b, rounding_mode="trunc")),
    ("div_floor", lambda a, b: torch.div(a, b, rounding_mode="floor")), ("floor_divide", torch.floor_divide),
    ("remainder", torch.remainder), ("fmod", torch.fmod), ("maximum", torch.maximum), ("minimum", torch.minimum),
    ("bitwise_and", torch.bitwise_and), ("bitwise_or", torch.bitwise_or), ("bitwise_xor", torch.bitwise_xor),
    ("lshift", lambda a, b: a << b.abs()), ("rshift", lambda a, b: a >> b.abs()), ("pow", lambda a, b: a ** b.abs()),
    ("eq", torch.eq), ("lt", torch.lt), ("logical_and", torch.logical_and), ("logical_xor", torch.logical_xor),
    ("mixed_float", lambda a, b: a * 0.5 + b), ("abs_neg", lambda a, b: (-a).abs() + torch.sign(b)),
    ("where", lambda a, b: torch.where(a > b, a, 7)), ("clamp", lambda a, b: torch.clamp(a, -3, 4)),
    ("clamp_float", lambda a, b: torch.clamp(a, min=0.5)), ("bitwise_not", lambda a, b: ~a),
    ("floordiv_scalar", lambda a, b: a // 3), ("mod_scalar", lambda a, b: a % -4), ("affine", lambda a, b: a * 2 - 1),
    ("fmod_scalar", lambda a, b: torch.fmod(a, 3)),
    ("trunc_scalar", lambda a, b: torch.div(a, -3, rounding_mode="trunc")),
]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_integer_ops(dtype):
    """Floor vs trunc division and remainder semantics on negative operands, exact results."""
    a = torch.randint(-20, 20, (7, 13), dtype=dtype)
    b = torch.randint(1, 6, (13,), dtype=dtype) * (torch.randint(0, 2, (13,), dtype=dtype) * 2 - 1)
    check(lambda a, b: tuple(fn(a, b) for _, fn in INT_BINARY), a, b, names=[n for n, _ in INT_BINARY])


def test_bool_ops():
    a, b = rand(7, 13, dtype=torch.bool), rand(13, dtype=torch.bool)
    check(lambda a, b: (a & b, a | b, a ^ b, ~a, torch.logical_or(a, b), a.logical_not(), a + b, a * b,
                        torch.where(a, b, False)), a, b)


def test_int8_uint8():
    a = torch.randint(-100, 100, (33,), dtype=torch.int8)
    u = torch.randint(0, 255, (33,), dtype=torch.uint8)
    check(lambda a, u: (a + 1, u + 1, a * 2, u // 3, a.to(torch.float32) * u, u > 100), a, u)


def test_integer_scalars_out_of_the_tensor_types_range():
    """Eager casts an integer scalar to the tensor's integer type with wrap-around: a uint8
    tensor `== -1` compares with 255, `> 300` with 44, an int8 one `== 200` with -56."""
    u = torch.randint(0, 256, (41,), dtype=torch.uint8)
    u[:6] = torch.tensor([0, 43, 44, 45, 254, 255], dtype=torch.uint8)
    a = u.to(torch.int8)
    check(lambda u, a: (u == -1, u > 300, u < -2, u != 256, u >= -300, a == 200, a < 130, a > -129,
                        torch.where(u == -1, a, -a), (u + 300) > 100, u - 300,
                        (a.to(torch.int16) * 300) < 0, (a // 3) == -43), u, a)


def test_where_and_masked_fill():
    x, y = rand(7, 13), rand(13)
    m = rand(7, 1, dtype=torch.bool)
    check(lambda x, y, m: (torch.where(m, x, y), torch.where(x > 0, x, 0.25), torch.where(x > 0, 2, y),
                           x.masked_fill(m, -1.5), x.masked_fill(x < 0, float("-inf")),
                           x.masked_fill(m, torch.tensor(3.0))), x, y, m)


@pytest.mark.parametrize("dtype", DTYPES)
def test_clamp_variants(dtype):
    x, lo, hi = rand(7, 13, dtype=dtype), rand(13, dtype=dtype) - 1, rand(7, 1, dtype=dtype) + 1
    check(lambda x, lo, hi: (torch.clamp(x, -0.5, 0.7), torch.clamp(x, min=0.2), torch.clamp(x, max=-0.1),
                             torch.clamp(x, lo, hi), torch.clamp(x, min=lo), torch.clamp(x, max=hi),
                             torch.clamp_min(x, 0.3), torch.clamp_max(x, lo), torch.clamp(x, 1.0, -1.0)),
          x, lo, hi)


def test_special_values():
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.0, -2.5, 3.5])
    check(lambda x: (torch.relu(x), torch.clamp(x, -1, 1), torch.maximum(x, torch.zeros_like(x)), torch.sign(x),
                     torch.isnan(x), torch.isinf(x), torch.sigmoid(x), torch.exp(x), F.hardtanh(x),
                     torch.fmax(x, x.flip(0)), torch.nan_to_num(x), torch.signbit(x), x // 2, x % 2,
                     torch.where(x > 0, x, -x)), x)


CASTS = [
    (F32, BF16), (BF16, F32), (F32, torch.float16), (BF16, torch.float16), (F32, torch.int64), (F32, torch.int32),
    (F32, torch.bool), (torch.int64, F32), (torch.int64, BF16), (torch.bool, F32), (torch.int32, torch.int64),
    (F32, torch.float64), (torch.float64, F32), (torch.int64, torch.uint8),
]


@pytest.mark.parametrize("src,dst", CASTS, ids=[f"{a}-{b}".replace("torch.", "") for a, b in CASTS])
def test_cast(src, dst):
    x = rand(7, 13, dtype=src, low=-40, high=40) if src != torch.int64 else torch.randint(0, 200, (7, 13))
    if src == torch.bool:
        x = rand(7, 13, dtype=torch.bool)
    check(lambda x: (x.to(dst), x.to(dst) * 1), x)


def test_clone_copy_alias():
    x = rand(7, 13)
    rec = check(lambda x: (x.clone(), x.t().contiguous(), x.detach() * 2, torch.ops.aten.alias(x) + 1), x)
    # a clone of an input must not hand the input object back
    out, _ = __import__("lowering_harness").compile_run(lambda x: x.clone(), x)
    assert out.data_ptr() != x.data_ptr()
    assert torch.equal(out, x)


def test_noncontiguous_inputs():
    a = noncontig(13, 7, kind="s")
    b = noncontig(13, 7, kind="t")
    check(lambda a, b: torch.tanh(a) * b + a / (b.abs() + 1), a, b)


def test_zero_dim_tensors():
    s = torch.tensor(0.75)
    x = rand(7, 13, dtype=BF16)
    # a 0-d fp32 tensor does not promote a bf16 tensor
    check(lambda x, s: (x * s, x + s, s * 2, torch.where(x > s, x, s)), x, s)


@pytest.mark.parametrize("name,fn", [UNARY[0][:2], BINARY[5][:2], ACTIVATIONS[0][:2]], ids=["exp", "div", "gelu"])
def test_dynamic_shapes(name, fn):
    args = (rand(7, 13),) if name != "div" else (rand(7, 13), rand(13))
    rec = check(fn, *args, dynamic=True)
    assert any(not d.is_number for g in rec.graphs for n in g.nodes.values() for d in n.shape)


def test_dynamic_scalar_arithmetic():
    def f(x):
        n = x.shape[0]
        return x * n + x.shape[1] / 2, x / (n - 1)

    rec = check(f, rand(7, 13), dynamic=True)
    check(f, rand(9, 5), dynamic=True)


def test_float16():
    x, y = rand(7, 13, dtype=torch.float16), rand(13, dtype=torch.float16)
    check(lambda x, y: (torch.exp(x) * y, F.gelu(x), x / y, x > 0.1, torch.where(x > y, x, 0.3), x.to(BF16),
                        x.sum(1), x.softmax(-1), x @ x.t(), F.layer_norm(x, (13,)), x.var(0), x.amax(1)),
          x, y)
