"""Scalar element types of the IR.

The IR names dtypes by short strings so that nothing below the frontend needs PyTorch.
`promote` follows PyTorch's category rules (bool < int < float) for the few places the IR
itself combines types; the frontend takes result dtypes from PyTorch's own metadata.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str
    itemsize: int
    kind: str  # "b" bool, "i" signed int, "u" unsigned int, "f" float, "c" complex, "q" 8-bit float

    @property
    def is_float(self) -> bool:
        return self.kind == "f"

    @property
    def is_int(self) -> bool:
        return self.kind in "iu"

    @property
    def is_bool(self) -> bool:
        return self.kind == "b"

    @property
    def is_opaque(self) -> bool:
        """Carried between ATen calls only (complex, float8): kernels never compute on it."""
        return self.kind in OPAQUE_KINDS

    @property
    def is_low_precision(self) -> bool:
        return self.kind == "f" and self.itemsize < 4

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return self.name


bool_ = DType("bool", 1, "b")
uint8 = DType("uint8", 1, "u")
uint16 = DType("uint16", 2, "u")
uint32 = DType("uint32", 4, "u")
uint64 = DType("uint64", 8, "u")  # e.g. the RNG state fused attention ops return
int8 = DType("int8", 1, "i")
int16 = DType("int16", 2, "i")
int32 = DType("int32", 4, "i")
int64 = DType("int64", 8, "i")
float16 = DType("float16", 2, "f")
bfloat16 = DType("bfloat16", 2, "f")
float32 = DType("float32", 4, "f")
float64 = DType("float64", 8, "f")
#: complex values are carried between extern calls only: no kernel computes on them
complex32 = DType("complex32", 4, "c")  # torch.chalf
complex64 = DType("complex64", 8, "c")
complex128 = DType("complex128", 16, "c")

#: 8-bit floats (scaled GEMM inputs) are likewise carried between extern calls only
float8_e4m3fn = DType("float8_e4m3fn", 1, "q")
float8_e5m2 = DType("float8_e5m2", 1, "q")
float8_e4m3fnuz = DType("float8_e4m3fnuz", 1, "q")
float8_e5m2fnuz = DType("float8_e5m2fnuz", 1, "q")

#: kinds of values no generated kernel computes on (they pass between ATen calls)
OPAQUE_KINDS = "cq"

ALL = {d.name: d for d in (bool_, uint8, uint16, uint32, uint64, int8, int16, int32, int64, float16, bfloat16, float32,
                           float64, complex32, complex64, complex128, float8_e4m3fn, float8_e5m2, float8_e4m3fnuz,
                           float8_e5m2fnuz)}


def by_name(name: str) -> DType:
    try:
        return ALL[name]
    except KeyError:
        raise ValueError(f"tilefuse has no dtype {name!r}") from None


def compute_dtype(dtype: DType) -> DType:
    """The dtype arithmetic is carried out in: fp32 for fp16/bf16 (as PyTorch's CPU and
    Inductor's kernels do), the dtype itself otherwise."""
    return float32 if dtype.is_low_precision else dtype


def float_widens(src: DType, dst: DType) -> bool:
    """Converting a `src` float to `dst` is exact for every value (a widening, or no change);
    bfloat16 and float16 do not hold each other's values."""
    return src.is_float and dst.is_float and (src == dst or dst.itemsize > src.itemsize)


def value_range(dtype: DType) -> tuple:
    """(lowest, highest) value of `dtype`: ±inf for floats, 0 and 1 for bool, the integer
    bounds of the width otherwise."""
    if dtype.is_float:
        return float("-inf"), float("inf")
    if dtype.is_bool:
        return 0, 1
    bits = 8 * dtype.itemsize
    if dtype.kind == "u":
        return 0, 2 ** bits - 1
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def promote(a: DType, b: DType) -> DType:
    rank = {"b": 0, "u": 1, "i": 1, "f": 2}
    if rank[a.kind] != rank[b.kind]:
        return a if rank[a.kind] > rank[b.kind] else b
    if a == b:
        return a
    if {a, b} == {float16, bfloat16}:
        return float32
    return a if a.itemsize >= b.itemsize else b
