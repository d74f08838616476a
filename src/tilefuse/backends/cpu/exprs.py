"""Scalar expressions of the tile IR printed as C++.

A tile expression describes one element; the statement printer (`codegen.py`) places it in
a loop nest over the tile and tells this printer how to spell each name at the current
element (`ref(name)`: an array element, a scalar, or an index `base + i`). Semantics follow
PyTorch (and the Triton backend): NaN-propagating max/min, Python floor division and
remainder, round half to even, fp32 math for bf16/fp16 values with rounding to the value's
dtype after each operation.
"""
from __future__ import annotations

import math

import sympy

from ...ir import dtypes as dt
from ...ir.expr import Binary, Cast, Const, Expr, Index, Unary, Var, Where
from ..dispatch import handler


class CppUnsupported(NotImplementedError):
    """The C++ backend cannot print this tile IR (the kernel falls back to the interpreter)."""


CTYPE = {
    "bool": "bool", "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
    "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t", "float16": "float",
    "bfloat16": "float", "float32": "float", "float64": "double",
}
#: element type of a buffer in memory (low-precision floats are raw 16-bit patterns)
STORAGE = dict(CTYPE, float16="uint16_t", bfloat16="uint16_t", bool="uint8_t")

_INFIX = {"add": "+", "sub": "-", "mul": "*", "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">",
          "ge": ">=", "bitwise_and": "&", "bitwise_or": "|", "bitwise_xor": "^"}
_VECTOR_MATH = {"exp": "tf_expf", "exp2": "tf_exp2f", "tanh": "tf_tanhf", "tanh_approx": "tf_tanhf",
                "sigmoid": "tf_sigmoidf", "erf": "tf_erff"}
_STD = {"exp", "exp2", "log", "log2", "log10", "log1p", "expm1", "sqrt", "sin", "cos", "tan", "asin", "acos",
        "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "erf", "erfc", "lgamma", "floor", "ceil",
        "trunc"}


def ctype(dtype) -> str:
    try:
        return CTYPE[dtype.name]
    except KeyError:
        raise CppUnsupported(f"dtype {dtype} has no C++ spelling") from None


def round_to(x: str, dtype) -> str:
    """`x` (a float or double value) rounded to a low-precision dtype; unchanged otherwise."""
    if dtype == dt.bfloat16:
        return f"tf_round_bf16((float)({x}))"
    if dtype == dt.float16:
        return f"tf_round_h_d((double)({x}))"
    return x


def _int_literal(v: int) -> str:
    if -(2**31) <= v < 2**31:
        return str(v)
    if v == -(2**63):
        return "INT64_MIN"
    if v >= 2**63:
        return f"{v}ULL"
    return f"{v}LL"


def const(value, dtype) -> str:
    if dtype.is_bool:
        return "true" if value and value != "nan" else "false"
    if dtype.is_float:
        suffix = "" if dtype == dt.float64 else "f"
        if value == "nan":
            return "NAN"
        v = float(value)
        if math.isinf(v):
            return "INFINITY" if v > 0 else "(-INFINITY)"
        text = repr(v)
        if "e" not in text and "." not in text:
            text += ".0"
        return f"{text}{suffix}" if v >= 0 else f"({text}{suffix})"
    return _int_literal(int(value))


def narrow_ints(kernel) -> frozenset:
    """The kernel's int64 values defined as a cast of a bool or of a signed integer of at most
    32 bits (a comparison widened for `one_hot`, an int32 index): their value fits int32."""
    from ...tile.ir import Assign, Let, statements

    out = set()
    assigned = {s.name for s in statements(kernel.body) if isinstance(s, Assign)}
    for s in statements(kernel.body):
        if s.__class__ is Let and s.name in assigned:
            continue
        if isinstance(s, Let) and isinstance(s.value, Cast) and s.value.dtype == dt.int64:
            src = s.value.x.dtype
            if src.is_bool or (src.is_int and src.kind == "i" and src.itemsize <= 4) or \
                    (src.is_int and src.kind == "u" and src.itemsize < 4):
                out.add(s.name)
    return frozenset(out)


class ExprPrinter:
    """Prints expressions; `ref(name)` spells a tile variable or index symbol at the current
    element of the loop nest."""

    def __init__(self, ref, aligned=None, narrow=frozenset()):
        self.ref = ref
        #: int64 tile values that hold a narrower integer or a bool (`narrow_ints`)
        self.narrow = narrow
        #: arange name -> (block, the element's offset inside the block as C++) for aranges whose
        #: start is a multiple of their block: `(x + j) mod c` is `(x mod c) + j` and
        #: `floor((x + j) / c)` is `floor(x / c)` when the block divides c (a broadcast operand
        #: read at a flattened index: a loop-invariant part and a contiguous one)
        self.aligned = aligned or {}

    # ---------------------------------------------------------------- index arithmetic
    def _aligned_split(self, e):
        if isinstance(e, sympy.Mod):
            x, c = e.args
        else:
            x, c = e.args[0].as_numer_denom()
        if not (x.is_Symbol and x.name in self.aligned and c.is_Integer and int(c) > 0):
            return None
        block, lane = self.aligned[x.name]
        if not x.is_nonnegative:  # (tile symbols are: plain operators, loop-invariant to the compiler)
            return None
        c = int(c)
        if c % block == 0:
            if isinstance(e, sympy.Mod):
                return f"(({x.name} % {c}) + {lane})"
            return f"({x.name} / {c})"
        if c + block >= 2**31:
            return None
        # the block start's quotient and remainder once per block; the lane's part in 32 bits,
        # which a vector loop divides by a constant (a 64-bit division it does lane by lane: a
        # bias over rows of 1000 took 174 µs for 64 rows where eager took 18)
        low = f"(int32_t)(({x.name} % {c}) + {lane})"
        if isinstance(e, sympy.Mod):
            return f"((int64_t)({low} % {c}))"
        return f"(({x.name} / {c}) + (int64_t)({low} / {c}))"

    def index(self, e) -> str:
        e = sympy.sympify(e)
        f = self.index
        if e.is_Integer:
            return _int_literal(int(e))
        if e.is_Rational or e.is_Float:
            return repr(float(e))
        if e.is_Symbol:
            return self.ref(e.name)
        if e.is_Add:
            return "(" + " + ".join(f(a) for a in e.args) + ")"
        if e.is_Mul:
            num, den = e.as_numer_denom()
            if den != 1:
                return f"((double)({f(num)}) / (double)({f(den)}))"
            coeff, rest = e.as_coeff_Mul()
            if coeff == -1:
                return f"(-{f(rest)})"
            return "(" + " * ".join(f(a) for a in e.args) + ")"
        if e.is_Pow and e.exp.is_Integer and int(e.exp) > 0:
            return "(" + " * ".join([f(e.base)] * int(e.exp)) + ")"
        if e.is_Pow:  # float powers of sizes (SDPA's d ** -0.25 with a symbolic head dim)
            return f"(float)tfm_pow((double)({f(e.base)}), (double)({f(e.exp)}))"
        if isinstance(e, (sympy.floor, sympy.Mod)):
            split = self._aligned_split(e)
            if split is not None:
                return split
        if isinstance(e, (sympy.floor, sympy.ceiling)) and e.args[0].has(sympy.Float):
            # a size computed in floats (interpolate's floor(1.5 * s0)): in double, as PyTorch
            fn = "tfm_floor" if isinstance(e, sympy.floor) else "tfm_ceil"
            return f"((int64_t){fn}((double)({f(e.args[0])})))"
        if isinstance(e, sympy.floor):
            num, den = e.args[0].as_numer_denom()
            if num.is_nonnegative and den.is_positive:
                return f"({f(num)} / {f(den)})"
            return f"tf_floordiv<int64_t>({f(num)}, {f(den)})"
        if isinstance(e, sympy.ceiling):
            num, den = e.args[0].as_numer_denom()
            return f"tf_ceildiv<int64_t>({f(num)}, {f(den)})"
        if isinstance(e, sympy.Mod):
            a, m = e.args
            if a.is_nonnegative and m.is_positive:
                return f"({f(a)} % {f(m)})"
            return f"tf_remainder<int64_t>({f(a)}, {f(m)})"
        if isinstance(e, (sympy.Min, sympy.Max)):
            fn = "tf_imin" if isinstance(e, sympy.Min) else "tf_imax"
            out = f(e.args[0])
            for a in e.args[1:]:
                out = f"{fn}<int64_t>({out}, {f(a)})"
            return out
        raise CppUnsupported(f"cannot print index expression {e} as C++")

    # ---------------------------------------------------------------- expressions
    def expr(self, e: Expr) -> str:
        return handler(_EXPR, e, CppUnsupported, "cannot print {} as C++")(self, e)

    def _var(self, e: Var) -> str:
        return self.ref(e.name)

    def _const(self, e: Const) -> str:
        return const(e.value, e.dtype)

    def _index(self, e: Index) -> str:
        text = self.index(e.expr)
        return text if e.dtype == dt.int64 else f"(({ctype(e.dtype)})({text}))"

    def _cast(self, e: Cast) -> str:
        if e.dtype.is_float and e.x.dtype == dt.int64 and isinstance(e.x, Var) and e.x.name in self.narrow:
            # (through int32, exactly: x86 before AVX-512 has no vector int64 -> float conversion,
            # and one such cast kept a whole loop scalar: `one_hot(i).float()`)
            return self.cast(f"(int32_t)({self.expr(e.x)})", dt.int32, e.dtype)
        return self.cast(self.expr(e.x), e.x.dtype, e.dtype)

    def _where(self, e: Where) -> str:
        return f"(({self.expr(e.cond)}) ? ({ctype(e.dtype)})({self.expr(e.a)}) : ({ctype(e.dtype)})({self.expr(e.b)}))"

    def _unary(self, e: Unary) -> str:
        return self._rounded(self.unary(e), e.dtype)

    def _binary(self, e: Binary) -> str:
        return self._rounded(self.binary(e), e.dtype)

    @staticmethod
    def _rounded(text: str, dtype) -> str:
        if dtype.is_low_precision:
            return round_to(text, dtype)
        if dtype.is_int or dtype.is_bool:
            return f"(({ctype(dtype)})({text}))"  # C++ promotes narrow integers to int
        return text

    @staticmethod
    def cast(x: str, src, dst) -> str:
        if dst.is_bool:
            return f"(({x}) != 0)"
        if dst.is_low_precision:
            if src == dst:
                return x
            if src == dt.float64:
                return round_to(x, dst) if dst == dt.float16 else f"tf_round_bf16((float)({x}))"
            return round_to(f"(float)({x})", dst)
        if dst.is_float:
            return f"(({ctype(dst)})({x}))"
        if src.is_float and (dst.kind == "u" or dst.itemsize < 4):
            return f"(({ctype(dst)})(int64_t)({x}))"  # out-of-range floats wrap, as on x86 eager
        return f"(({ctype(dst)})({x}))"

    def unary(self, e: Unary) -> str:
        x = self.expr(e.x)
        op, t = e.op, e.x.dtype
        if op == "neg":
            return f"(-{x})"
        if op == "reciprocal":
            return f"(({ctype(e.dtype)})1 / {x})"
        if op == "logical_not":
            return f"(({x}) == 0)"
        if op == "bitwise_not":
            return f"(!({x}))" if t.is_bool else f"(~{x})"
        if op == "isnan":
            return f"(({x}) != ({x}))" if t.is_float else "false"
        if op == "isinf":
            return f"(tfm_fabs({x}) == INFINITY)" if t.is_float else "false"
        if op == "sign":
            return f"tf_sign<{ctype(e.dtype)}>({x})"
        if not t.is_float:
            if op in ("floor", "ceil", "round", "trunc"):
                return x
            if op == "abs":
                return f"(({x}) < 0 ? -({x}) : ({x}))"
            x = f"(float)({x})"  # math on integers (the lowering normally casts first)
        single = t != dt.float64
        if op == "abs":
            return f"tfm_fabs({x})"
        if op == "round":
            return f"tfm_nearbyint({x})"
        if op == "rsqrt":
            return f"(1.0f / tfm_sqrt({x}))" if single else f"(1.0 / tfm_sqrt({x}))"
        if single and op in _VECTOR_MATH:
            return f"{_VECTOR_MATH[op]}({x})"
        if op == "sigmoid":
            return f"(1.0 / (1.0 + tfm_exp(-{x})))"
        if op == "tanh_approx":
            return f"tfm_tanh({x})"
        if op in _STD:
            return f"tfm_{op}({x})"
        raise CppUnsupported(f"unary op {op} has no C++ spelling")

    def binary(self, e: Binary) -> str:
        a, b = self.expr(e.a), self.expr(e.b)
        op, t = e.op, e.dtype
        if op in _INFIX:
            return f"({a} {_INFIX[op]} {b})"
        # (bitwise on bools: both sides are pure and eager evaluates both; the short-circuit
        # `&&` is control flow, and GCC 12 turns a row-uniform operand of one into a select on
        # a scalar condition that it cannot vectorise, keeping the whole loop scalar)
        if op == "logical_and":
            return f"((bool)({a}) & (bool)({b}))"
        if op == "logical_or":
            return f"((bool)({a}) | (bool)({b}))"
        if op == "logical_xor":
            return f"((bool)({a}) != (bool)({b}))"
        if op == "truediv":
            return f"({a} / {b})"
        if op == "rand":
            return f"tf_philox_uniform((int64_t)({a}), (int64_t)({b}))"
        ct = ctype(t)
        if op in ("maximum", "minimum"):
            return f"tf_{op[:3]}<{ct}>({a}, {b})"
        if t.is_float:
            if op == "fmod":
                return f"tfm_fmod(({ct})({a}), ({ct})({b}))"
            if op == "mod":
                return f"tf_fremainder<{ct}>({a}, {b})"
            if op == "floordiv":
                return f"tf_ffloordiv<{ct}>({a}, {b})"
            if op == "pow":
                return f"tfm_pow(({ct})({a}), ({ct})({b}))"
            if op == "atan2":
                return f"tfm_atan2(({ct})({a}), ({ct})({b}))"
            if op == "copysign":
                return f"tfm_copysign(({ct})({a}), ({ct})({b}))"
        else:
            if op == "floordiv":
                return f"tf_floordiv<{ct}>({a}, {b})"
            if op == "mod":
                return f"tf_remainder<{ct}>({a}, {b})"
            if op == "fmod":
                return f"tf_ifmod<{ct}>({a}, {b})"
            if op == "pow":
                return f"tf_ipow<{ct}>({a}, {b})"
            if op == "lshift":
                return f"tf_shl<{ct}, {ctype(e.b.dtype)}>({a}, {b})"
            if op == "rshift":
                return f"tf_shr<{ct}, {ctype(e.b.dtype)}>({a}, {b})"
        raise CppUnsupported(f"binary op {op} on {t} has no C++ spelling")


#: expression node -> its printer (one handler per type)
_EXPR = {Var: ExprPrinter._var, Const: ExprPrinter._const, Index: ExprPrinter._index, Cast: ExprPrinter._cast,
         Where: ExprPrinter._where, Unary: ExprPrinter._unary, Binary: ExprPrinter._binary}
