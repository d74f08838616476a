"""Triton helper functions that generated kernels may call, and the math-function table.

On the GPU, transcendental functions come from libdevice. The Triton interpreter (used on
CPU for tests) cannot run libdevice, so there the same functions are spelled with core
`tl` operations; a function with no such spelling raises `InterpretUnsupported`.
"""
from __future__ import annotations


class InterpretUnsupported(NotImplementedError):
    pass


def _philox_source(note: str, wrapping: list) -> str:
    """`_philox_uniform(seed, offset)`: ir.philox's rand(seed, offset), Philox4x32-10 on the
    counter (offset, 0, 0) keyed by the seed; `wrapping` holds the round's four wrapping uint32
    steps (the low words of the two products, the two key steps)."""
    steps = "\n".join("        " + line for line in wrapping)
    return f"""
@triton.jit
def _philox_uniform(seed, offset):
    # ir.philox's rand(seed, offset){note}
    seed = tl.cast(seed, tl.int64)
    offset = tl.cast(offset, tl.int64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = (offset & 0xFFFFFFFF).to(tl.uint32)
    c1 = ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c2 = c0 * 0
    c3 = c0 * 0
    round_a = tl.full([], 0xD2511F53, tl.uint32)
    round_b = tl.full([], 0xCD9E8D57, tl.uint32)
    key_a = tl.full([], 0x9E3779B9, tl.uint32)
    key_b = tl.full([], 0xBB67AE85, tl.uint32)
    for _ in tl.static_range(10):
        n0 = tl.umulhi(round_b, c2) ^ c1 ^ k0
        n2 = tl.umulhi(round_a, c0) ^ c3 ^ k1
{steps}
        c0 = n0
        c2 = n2
    return (c0 >> 8).to(tl.float32) * 5.9604644775390625e-08
"""


# name -> source of a @triton.jit helper; emitted only when a kernel uses it
HELPERS = {
    "grouped_program": """
@triton.jit
def _grouped_program(axis: tl.constexpr, group: tl.constexpr, reverse: tl.constexpr):
    # tile.ir.ProgramId.group: the program at this launch position (axis 0 fastest) is block
    # `launch // count` (reversed: counted from the last) of batch element `first + launch % count`
    blocks = tl.num_programs(0)
    launch = tl.program_id(1) * blocks + tl.program_id(0)
    first = (launch // (group * blocks)) * group
    count = tl.minimum(tl.num_programs(1) - first, group)
    rest = launch - first * blocks
    if axis == 0:
        block = rest // count
        if reverse:
            block = blocks - 1 - block
        return block
    return first + rest % count
""",
    "maximum": """
@triton.jit
def _maximum(a, b):
    return tl.where((a > b) | (a != a), a, b)
""",
    "minimum": """
@triton.jit
def _minimum(a, b):
    return tl.where((a < b) | (a != a), a, b)
""",
    "max": """
@triton.jit
def _max_combine(a, b):
    return tl.where((a > b) | (a != a), a, b)
""",
    "min": """
@triton.jit
def _min_combine(a, b):
    return tl.where((a < b) | (a != a), a, b)
""",
    "fmax": """
@triton.jit
def _fmax_combine(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
""",
    "fmin": """
@triton.jit
def _fmin_combine(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)
""",
    "prod": """
@triton.jit
def _prod_combine(a, b):
    return a * b
""",
    "argmax": """
@triton.jit
def _argmax_combine(v1, i1, v2, i2):
    nan1 = v1 != v1
    nan2 = v2 != v2
    better = (v2 > v1) | (nan2 & ~nan1)
    tie = ((v1 == v2) | (nan1 & nan2)) & (i2 < i1)
    take = better | tie
    return tl.where(take, v2, v1), tl.where(take, i2, i1)
""",
    "argmin": """
@triton.jit
def _argmin_combine(v1, i1, v2, i2):
    nan1 = v1 != v1
    nan2 = v2 != v2
    better = ((v2 < v1) & ~nan1) | (nan2 & ~nan1)
    tie = ((v1 == v2) | (nan1 & nan2)) & (i2 < i1)
    take = better | tie
    return tl.where(take, v2, v1), tl.where(take, i2, i1)
""",
    "floordiv": """
@triton.jit
def _floordiv(a, b):
    q = a // b
    return q - (((a % b) != 0) & ((a < 0) != (b < 0))).to(q.dtype)
""",
    "remainder": """
@triton.jit
def _remainder(a, b):
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)
""",
    "fmod_gpu": """
@triton.jit
def _fmod(a, b):
    return libdevice.fmod(a, b)
""",
    "fmod_interp": """
@triton.jit
def _fmod(a, b):
    # no libdevice in the interpreter: divide in float64 (exact enough for fp32 and lower),
    # then bring the remainder to a's sign and below |b| as fmod requires
    a64 = a.to(tl.float64)
    b64 = b.to(tl.float64)
    q = a64 / b64
    q = tl.where(q < 0, tl.ceil(q), tl.floor(q))
    r = a64 - q * b64
    babs = tl.where(b64 < 0, -b64, b64)
    r = tl.where((r != 0) & ((r < 0) != (a64 < 0)), tl.where(a64 < 0, r - babs, r + babs), r)
    return r.to(a.dtype)
""",
    "fremainder": """
@triton.jit
def _fremainder(a, b):
    r = _fmod(a, b)
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)
""",
    "ffloordiv": """
@triton.jit
def _ffloordiv(a, b):
    r = _fmod(a, b)
    div = (a - r) / b
    div = tl.where((r != 0) & ((b < 0) != (r < 0)), div - 1.0, div)
    fl = tl.floor(div)
    fl = tl.where(div - fl > 0.5, fl + 1.0, fl)
    return tl.where(b == 0, a / b, fl)
""",
    "philox": _philox_source(
        "",
        ["c1 = round_b * c2", "c3 = round_a * c0", "k0 = k0 + key_a", "k1 = k1 + key_b"]),
    "philox_interp": _philox_source(
        "\n    # (the interpreter's numpy warns on a wrapping uint32 product: the low words and the\n"
        "    # key steps come from uint64 arithmetic here)",
        ["c1 = ((c2.to(tl.uint64) * 0xCD9E8D57) & 0xFFFFFFFF).to(tl.uint32)",
         "c3 = ((c0.to(tl.uint64) * 0xD2511F53) & 0xFFFFFFFF).to(tl.uint32)",
         "k0 = ((k0.to(tl.uint64) + 0x9E3779B9) & 0xFFFFFFFF).to(tl.uint32)",
         "k1 = ((k1.to(tl.uint64) + 0xBB67AE85) & 0xFFFFFFFF).to(tl.uint32)"]),
    "ipow": """
@triton.jit
def _ipow(a, b):
    one = a * 0 + 1
    result = one
    base = a
    e = tl.where(b < 0, 0, b)
    for _ in range(64):
        result = tl.where((e & 1) != 0, result * base, result)
        base = base * base
        e = e >> 1
    # a negative exponent (PyTorch's integer pow): 1 for 1, ±1 for -1, 0 otherwise
    negative = tl.where(a == 1, one, tl.where(a == -1, tl.where((b & 1) != 0, -one, one), one * 0))
    return tl.where(b < 0, negative, result)
""",
    "pow_interp": """
@triton.jit
def _pow_interp(a, b):
    # selections only, no & or ~: the interpreter types a comparison of scalars (an exponent
    # computed per program) as float data, which numpy's bitwise ops refuse
    mag = tl.exp2(b * tl.log2(tl.abs(a)))
    b_int = tl.where(tl.floor(b) == b, True, False)
    odd = tl.where(b_int, tl.where((tl.abs(b) % 2) == 1, True, False), False)
    neg = tl.where(a < 0, True, False)
    signed = tl.where(neg, tl.where(odd, -mag, mag), mag)
    res = tl.where(neg, tl.where(b_int, signed, float("nan")), signed)
    res = tl.where(a == 0, tl.where(b > 0, 0.0, tl.where(b == 0, 1.0, float("inf"))), res)
    return tl.where(b == 0, 1.0, tl.where(a == 1, 1.0, res))  # pow(1, nan) = pow(nan, 0) = 1, as in C
""",
    "tanh_interp": """
@triton.jit
def _tanh_interp(x):
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)
""",
    "bf16_rtne": """
@triton.jit
def _bf16_rtne(x):
    # the Triton interpreter truncates fp32 -> bf16; round to nearest even as GPUs do
    x = x.to(tl.float32)
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (((bits >> 16) & 1) + 0x7FFF)
    y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.where(x != x, x.to(tl.bfloat16), y)
""",
    "round_interp": """
@triton.jit
def _round_interp(x):
    r = tl.floor(x + 0.5)
    half = (r - x) == 0.5
    odd = (r % 2) != 0
    return tl.where(half & odd, r - 1.0, r)
""",
}

# unary op -> (gpu spelling, interpreter spelling); "{x}" is the operand
UNARY = {
    "exp": ("tl.exp({x})", None),
    "exp2": ("tl.exp2({x})", None),
    "log": ("tl.log({x})", None),
    "log2": ("tl.log2({x})", None),
    "log10": ("libdevice.log10({x})", "(tl.log2({x}) * 0.30102999566398120)"),
    "log1p": ("libdevice.log1p({x})", "tl.log(1.0 + {x})"),
    "expm1": ("libdevice.expm1({x})", "(tl.exp({x}) - 1.0)"),
    "sqrt": ("tl.sqrt_rn({x})", "tl.sqrt({x})"),
    "rsqrt": ("tl.rsqrt({x})", None),
    "sin": ("tl.sin({x})", None),
    "cos": ("tl.cos({x})", None),
    "tan": ("libdevice.tan({x})", "(tl.sin({x}) / tl.cos({x}))"),
    "sinh": ("libdevice.sinh({x})", "((tl.exp({x}) - tl.exp(-{x})) * 0.5)"),
    "cosh": ("libdevice.cosh({x})", "((tl.exp({x}) + tl.exp(-{x})) * 0.5)"),
    "tanh": ("libdevice.tanh({x})", "_tanh_interp({x})"),
    # the hardware tanh (sm_75+, relative error < 2^-10.9); used only where the inputs are
    # bf16/fp16, whose own resolution (2^-8 / 2^-11) it does not exceed
    "tanh_approx": ('tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [{x}], dtype=tl.float32, '
                    'is_pure=True, pack=1)', "_tanh_interp({x})"),
    "asinh": ("libdevice.asinh({x})", None),
    "acosh": ("libdevice.acosh({x})", "tl.log({x} + tl.sqrt({x} * {x} - 1.0))"),
    "atanh": ("libdevice.atanh({x})", "(0.5 * tl.log((1.0 + {x}) / (1.0 - {x})))"),
    "asin": ("libdevice.asin({x})", None),
    "acos": ("libdevice.acos({x})", None),
    "atan": ("libdevice.atan({x})", None),
    "sigmoid": ("tl.sigmoid({x})", None),
    "erf": ("tl.erf({x})", None),
    "erfc": ("libdevice.erfc({x})", "(1.0 - tl.erf({x}))"),
    "lgamma": ("libdevice.lgamma({x})", None),
    "floor": ("tl.floor({x})", None),
    "ceil": ("tl.ceil({x})", None),
    "round": ("libdevice.nearbyint({x})", "_round_interp({x})"),
    "trunc": ("libdevice.trunc({x})", "tl.where({x} < 0, tl.ceil({x}), tl.floor({x}))"),
    "abs": ("tl.abs({x})", None),
}

INTERP_HELPERS_FOR = {"tanh": "tanh_interp", "tanh_approx": "tanh_interp", "round": "round_interp"}


def unary_call(op: str, x: str, interpret: bool) -> tuple[str, str | None]:
    """(source, helper needed or None) for a transcendental unary op."""
    gpu, interp = UNARY[op]
    if interpret:
        if interp is None:
            if gpu.startswith("libdevice"):
                raise InterpretUnsupported(f"{op} has no Triton-interpreter spelling")
            return gpu.format(x=x), None
        return interp.format(x=x), INTERP_HELPERS_FOR.get(op)
    return gpu.format(x=x), None
