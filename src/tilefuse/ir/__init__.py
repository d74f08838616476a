"""Graph IR: dtypes, scalar expressions, reduction monoids, nodes, printer, verifier and reference
interpreter."""
from . import dtypes
from .dtypes import DType
from .bounds import IndexCheckError
from .expr import (Binary, Cast, CheckedIndex, Const, Expr, Index, Load, Unary, Var, Where, binary, cast, const,
                   out_index, red_index, size_symbol, unary, where)
from .graph import (Constant, Extern, ExternResult, Graph, Input, Node, Pointwise, Reduce, ScalarInput,
                    Scatter, TensorArg)
from .monoid import MONOIDS, Monoid, monoid
from .verify import IRVerificationError, verify

__all__ = [
    "dtypes", "DType", "Expr", "Const", "Index", "Load", "Var", "Unary", "Binary", "Where", "Cast", "CheckedIndex",
    "IndexCheckError",
    "const", "cast", "unary", "binary", "where", "out_index", "red_index", "size_symbol",
    "Monoid", "MONOIDS", "monoid",
    "Graph", "Node", "Input", "ScalarInput", "Constant", "Pointwise", "Reduce", "Scatter", "Extern",
    "ExternResult", "TensorArg", "verify", "IRVerificationError",
]
