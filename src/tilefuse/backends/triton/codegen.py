"""Tile IR → Triton source.

`generate(kernel, interpret)` returns the text of a Python module holding one `@triton.jit`
kernel and the helpers it uses. Buffer parameters are named `ptr_<buffer>`; sizes and strides
keep their names; block sizes are `tl.constexpr` parameters. Index checks are
`tl.device_assert`s (the launcher enables them). Each statement and expression type has one
handler (`_STMT`, `_EXPR`); index arithmetic is printed by `indexing.py`.
"""
from __future__ import annotations

from ...ir import dtypes as dt
from ...ir.expr import Binary, Cast, Const, Expr, Index, Unary, Var, Where
from ...ir.monoid import SUM
from ...tile.ir import (Arange, ArgReduceTile, Assign, BroadcastTile, Check, Comment, DescriptorLoad, DotTile, For,
                        Full, Let, LoadTile, MakeDescriptor, ProgramId, ReduceTile, StoreTile, TileKernel,
                        TransposeTile, check_message)
from ...tile.variants import all_kernels
from ..dispatch import handler
from .helpers import HELPERS, InterpretUnsupported, unary_call
from .indexing import format_sympy

TL_DTYPE = {
    "bool": "tl.int1", "uint8": "tl.uint8", "uint16": "tl.uint16", "uint32": "tl.uint32", "uint64": "tl.uint64", "int8": "tl.int8", "int16": "tl.int16", "int32": "tl.int32",
    "int64": "tl.int64", "float16": "tl.float16", "bfloat16": "tl.bfloat16", "float32": "tl.float32",
    "float64": "tl.float64",
}

_INFIX = {"add": "+", "sub": "-", "mul": "*", "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">",
          "ge": ">=", "logical_and": "&", "logical_or": "|", "logical_xor": "^", "bitwise_and": "&",
          "bitwise_or": "|", "bitwise_xor": "^", "lshift": "<<", "rshift": ">>"}


def _const(value, dtype) -> str:
    if value == "nan":
        return 'float("nan")'
    if dtype.is_bool:
        return "True" if value else "False"
    if dtype.is_float:
        v = float(value)
        if v == float("inf"):
            return 'float("inf")'
        if v == float("-inf"):
            return 'float("-inf")'
        return repr(v)
    return str(int(value))


class TritonPrinter:
    def __init__(self, interpret: bool):
        self.interpret = interpret
        self.helpers: set[str] = set()
        self.uses_libdevice = False
        self.uses_descriptors = False  # device-side tensor descriptors need an allocator at launch
        self.stores = 0

    def expr(self, e: Expr) -> str:
        s = self._expr(e)
        if self.interpret and e.dtype.is_bool and isinstance(e, (Cast, Unary, Binary)):
            # the interpreter types a comparison of scalars (a value loaded at one address) as
            # its left operand (float32, int32) around numpy bools, and splatting it to a block
            # (a mask, a where) then makes float or int data that it rejects: re-type as int1
            s = f"tl.where({s}, True, False)"
        return s

    def _expr(self, e: Expr) -> str:
        return handler(_EXPR, e, TypeError)(self, e)

    def _var(self, e: Var) -> str:
        return e.name

    def _const(self, e: Const) -> str:
        if e.dtype.is_int and not -2**31 <= int(e.value) < 2**31:
            # a typed scalar: a bare literal is converted to the other operand's int32
            return f"tl.full([], {int(e.value)}, {TL_DTYPE[e.dtype.name]})"
        return _const(e.value, e.dtype)

    def _index(self, e: Index) -> str:
        return format_sympy(e.expr, self.helpers)

    def _cast(self, e: Cast) -> str:
        x = self.expr(e.x)
        if e.dtype.is_bool:
            return f"({x} != 0)"
        if isinstance(e.x, Const):  # a literal has no .to(): a scalar of the target dtype
            if self.interpret and e.dtype == dt.bfloat16:
                return self.cast(f"tl.full([], {x}, tl.float32)", e.dtype, dt.float32)
            return f"tl.full([], {x}, {TL_DTYPE[e.dtype.name]})"
        if isinstance(e.x, Index) and e.dtype.is_int:
            # an index may be a Python int (a constant; the interpreter's loop variables): no .to()
            return f"tl.cast({x}, {TL_DTYPE[e.dtype.name]})"
        return self.cast(x, e.dtype, e.x.dtype)

    def _where(self, e: Where) -> str:
        return f"tl.where({self.expr(e.cond)}, {self.expr(e.a)}, {self.expr(e.b)})"

    def cast(self, x: str, dtype, from_dtype=None) -> str:
        if self.interpret and dtype == dt.bfloat16 and from_dtype != dt.bfloat16:
            self.helpers.add("bf16_rtne")
            if from_dtype is not None and not from_dtype.is_float:
                x = f"({x}).to(tl.float32)"  # the interpreter's integer -> bf16 cast gives garbage
            return f"_bf16_rtne({x})"
        return f"({x}).to({TL_DTYPE[dtype.name]})"

    def _interp_bf16(self, e) -> bool:
        """Under the interpreter bf16 data is numpy uint16: comparisons, max/min and arithmetic
        on it compare or add bit patterns (-1 < -2, NaN == NaN, -0 != 0). An op with a bf16
        operand is computed on its exact fp32 upcast, its bf16 result rounded back (exact)."""
        return self.interpret and any(x.dtype == dt.bfloat16 for x in (
            (e.x,) if isinstance(e, Unary) else (e.a, e.b)))

    def _upcast(self, e: Expr) -> str:
        s = self.expr(e)
        return f"({s}).to(tl.float32)" if e.dtype == dt.bfloat16 and not isinstance(e, Const) else s

    def unary(self, e: Unary) -> str:
        if self._interp_bf16(e):
            s = self._unary(Unary(e.op, Var(self._upcast(e.x), dt.float32), dt.float32 if e.dtype == dt.bfloat16
                                  else e.dtype))
            return self.cast(s, dt.bfloat16, dt.float32) if e.dtype == dt.bfloat16 else s
        return self._unary(e)

    def binary(self, e: Binary) -> str:
        if self._interp_bf16(e):
            a, b = (Var(self._upcast(x), dt.float32) if x.dtype == dt.bfloat16 and not isinstance(x, Const) else x
                    for x in (e.a, e.b))
            s = self._binary(Binary(e.op, a, b, dt.float32 if e.dtype == dt.bfloat16 else e.dtype))
            return self.cast(s, dt.bfloat16, dt.float32) if e.dtype == dt.bfloat16 else s
        return self._binary(e)

    def _unary(self, e: Unary) -> str:
        x = self.expr(e.x)
        op = e.op
        if op == "neg":
            return f"(-{x})"
        if op == "reciprocal":
            return f"(1.0 / {x})"
        if op == "logical_not":
            return f"({x} == 0)"
        if op == "bitwise_not":
            return f"(~{x})"
        if op == "isnan":
            return f"({x} != {x})"
        if op == "isinf":
            return f"(tl.abs({x}) == float(\"inf\"))"
        if op == "sign":
            t = TL_DTYPE[e.dtype.name]
            return f"(({x} > 0).to({t}) - ({x} < 0).to({t}))"
        if op in ("floor", "ceil", "round", "trunc") and not e.x.dtype.is_float:
            return x
        if op == "abs" and not e.x.dtype.is_float:
            return f"tl.where({x} < 0, -{x}, {x})"
        if op in ("sigmoid",) and self.interpret:
            return f"(1.0 / (1.0 + tl.exp(-{x})))"
        src, helper = unary_call(op, x, self.interpret)
        if helper:
            self.helpers.add(helper)
        if "libdevice" in src:
            self.uses_libdevice = True
        return src

    def _binary(self, e: Binary) -> str:
        a, b = self.expr(e.a), self.expr(e.b)
        op = e.op
        if self.interpret and e.dtype.is_bool and op in ("logical_and", "logical_or", "logical_xor", "bitwise_and",
                                                          "bitwise_or", "bitwise_xor"):
            # the interpreter combines a scalar bool with a block of bools into int32 data typed
            # int1 (numpy then rejects it as a mask or operand): combine int8s, compare back
            a8, b8 = (str(int(bool(x.value))) if isinstance(x, Const) else f"({s}).to(tl.int8)"
                      for x, s in ((e.a, a), (e.b, b)))
            return f"(({a8} {_INFIX[op]} {b8}) != 0)"
        if op in _INFIX:
            return f"({a} {_INFIX[op]} {b})"
        if op == "truediv":
            return f"({a} / {b})"
        if op in ("floordiv", "mod", "fmod") and e.dtype.is_float:
            # PyTorch's float floor_divide/remainder are built on an exact fmod
            self.helpers.add("fmod_interp" if self.interpret else "fmod_gpu")
            self.uses_libdevice |= not self.interpret
            if op == "fmod":
                return f"_fmod({a}, {b})"
            self.helpers.add("ffloordiv" if op == "floordiv" else "fremainder")
            return f"_ffloordiv({a}, {b})" if op == "floordiv" else f"_fremainder({a}, {b})"
        if op == "floordiv":
            self.helpers.add("floordiv")
            return f"_floordiv({a}, {b})"
        if op == "mod":
            self.helpers.add("remainder")
            return f"_remainder({a}, {b})"
        if op == "fmod":
            return f"({a} % {b})"
        if op in ("maximum", "minimum") and e.dtype.is_float:
            # one max.NaN / min.NaN instruction: NaN propagates as in eager
            return f"tl.{op}({a}, {b}, propagate_nan=tl.PropagateNan.ALL)"
        if op == "maximum":
            self.helpers.add("maximum")
            return f"_maximum({a}, {b})"
        if op == "minimum":
            self.helpers.add("minimum")
            return f"_minimum({a}, {b})"
        if op == "pow":
            if not e.dtype.is_float:
                self.helpers.add("ipow")
                return f"_ipow({a}, {b})"
            if self.interpret:
                self.helpers.add("pow_interp")
                return f"_pow_interp({a}, {b})"
            self.uses_libdevice = True
            return f"libdevice.pow({a}, {b})"
        if op == "atan2":
            if self.interpret:
                raise InterpretUnsupported("atan2 has no Triton-interpreter spelling")
            self.uses_libdevice = True
            return f"libdevice.atan2({a}, {b})"
        if op == "rand":
            self.helpers.add("philox_interp" if self.interpret else "philox")
            return f"_philox_uniform({a}, {b})"
        if op == "copysign":
            return f"tl.where(({b} < 0) | ((1.0 / {b}) < 0), -tl.abs({a}), tl.abs({a}))"
        raise NotImplementedError(f"binary op {op}")

    # ------------------------------------------------------------------ statements
    def stmts(self, stmts, indent: int, out: list) -> None:
        pad = "    " * indent
        for s in stmts:
            handler(_STMT, s, TypeError)(self, s, pad, indent, out)

    def _program_id(self, s: ProgramId, pad: str, indent: int, out: list) -> None:
        wide = ".to(tl.int64)" if s.wide else ""
        if s.group:
            self.helpers.add("grouped_program")
            out.append(f"{pad}{s.name} = _grouped_program({s.axis}, {s.group}, {s.reverse}){wide}")
            return
        pid = f"tl.program_id({s.axis}){wide}"
        out.append(f"{pad}{s.name} = tl.num_programs({s.axis}){wide} - 1 - {pid}" if s.reverse else f"{pad}{s.name} = {pid}")

    def _arange(self, s: Arange, pad: str, indent: int, out: list) -> None:
        rng = f"tl.arange(0, {s.block})"
        if s.ndim == 2:
            rng += "[:, None]" if s.axis == 0 else "[None, :]"
        start = self.expr(s.start)
        out.append(f"{pad}{s.name} = {start} + {rng}" if start != "0" else f"{pad}{s.name} = {rng}")

    def _let(self, s, pad: str, indent: int, out: list) -> None:  # (and Assign)
        out.append(f"{pad}{s.name} = {self.expr(s.value)}")

    def _full(self, s: Full, pad: str, indent: int, out: list) -> None:
        shape = ", ".join(str(d) for d in s.shape)
        out.append(f"{pad}{s.name} = tl.full([{shape}], {_const(s.value, s.dtype)}, {TL_DTYPE[s.dtype.name]})")

    def _broadcast(self, s: BroadcastTile, pad: str, indent: int, out: list) -> None:
        shape = ", ".join(str(d) for d in s.shape)
        out.append(f"{pad}{s.name} = tl.broadcast_to({self.expr(s.value)}, [{shape}])")

    def _transpose(self, s: TransposeTile, pad: str, indent: int, out: list) -> None:
        out.append(f"{pad}{s.name} = tl.trans({self.expr(s.value)})")

    def _load(self, s: LoadTile, pad: str, indent: int, out: list) -> None:
        ptr = f"ptr_{s.buffer} + {self.expr(s.offset)}"
        hint = f", eviction_policy=\"evict_{s.eviction}\"" if s.eviction and not self.interpret else ""
        if s.mask is not None:
            # pointer and mask may be tiles of different (broadcastable) shapes
            out.append(f"{pad}{s.name}_p, {s.name}_m = tl.broadcast({ptr}, {self.expr(s.mask)})")
            out.append(f"{pad}{s.name} = tl.load({s.name}_p, {s.name}_m, other=0{hint})")
        else:
            out.append(f"{pad}{s.name} = tl.load({ptr}{hint})")

    def _store(self, s: StoreTile, pad: str, indent: int, out: list) -> None:
        if isinstance(s.value, Const):  # a bare literal has no .to(): a scalar of the stored dtype
            v = f"tl.full([], {self.expr(s.value)}, {TL_DTYPE[s.dtype.name]})"
        else:
            v = self.cast(self.expr(s.value), s.dtype, s.value.dtype)
        ptr = f"ptr_{s.buffer} + {self.expr(s.offset)}"
        self.stores += 1
        p_, v_ = f"st{self.stores}_p", f"st{self.stores}_v"
        out.append(f"{pad}{p_}, {v_} = tl.broadcast({ptr}, {v})")
        if s.mask is not None:
            m_ = f"st{self.stores}_m"
            out.append(f"{pad}{p_}, {m_} = tl.broadcast({p_}, {self.expr(s.mask)})")
            out.append(f"{pad}{v_}, {m_} = tl.broadcast({v_}, {m_})")
            out.append(f"{pad}tl.store({p_}, {v_}, {m_})")
        else:
            out.append(f"{pad}tl.store({p_}, {v_})")

    def _reduce(self, s: ReduceTile, pad: str, indent: int, out: list) -> None:
        v = self.expr(s.value)
        keep = "[:, None]" if s.axis == 1 else "[None, :]"
        m = s.combiner
        if m == SUM:
            red = f"tl.sum({v}, {s.axis})"
        elif m.extremum and s.dtype.is_float and self.interpret:
            # the interpreter runs a custom combine pairwise in Python (seconds per
            # call); its tl.max/min are vectorised but drop NaN: put NaN back
            has_nan = f"(tl.max(({v} != {v}).to(tl.int32), {s.axis}) > 0)"
            red = f"tl.where({has_nan}, float('nan'), tl.{m.name}({v}, {s.axis}))"
        else:
            helper = m.name  # HELPERS: _prod_combine, _max_combine, _min_combine; floats _fmax_/_fmin_combine
            if m.extremum and s.dtype.is_float:
                helper = "f" + m.name
            fn = f"_{helper}_combine"
            self.helpers.add(helper)
            red = f"tl.reduce({v}, {s.axis}, {fn})"
        out.append(f"{pad}{s.name} = {red}{keep}")

    def _arg_reduce(self, s: ArgReduceTile, pad: str, indent: int, out: list) -> None:
        self.helpers.add(s.combiner.name)
        v, i = self.expr(s.value), self.expr(s.index)
        keep = "[:, None]" if s.axis == 1 else "[None, :]"
        out.append(f"{pad}_, {s.name} = tl.reduce(({v}, tl.broadcast_to({i}, {v}.shape).to(tl.int64)), "
                   f"{s.axis}, _{s.combiner.name}_combine)")
        out.append(f"{pad}{s.name} = {s.name}{keep}")

    def _dot(self, s: DotTile, pad: str, indent: int, out: list) -> None:
        a, b = self.expr(s.a), self.expr(s.b)
        if s.input_dtype is not None and s.input_dtype.is_low_precision:
            t = TL_DTYPE[s.input_dtype.name]
            out.append(f"{pad}{s.name} = tl.dot(({a}).to({t}), ({b}).to({t}), {self.expr(s.acc)})")
        else:
            # fp32 operands: full precision like eager (the default would be TF32,
            # which the interpreter emulates too); fp64 ones into an fp64 accumulator
            t = TL_DTYPE[(s.input_dtype or dt.float32).name]
            # (Triton 3.6's tl.dot returns fp32 unless `out_dtype` says otherwise, and rejects an
            # fp64 accumulator then; later versions take the accumulator's type)
            wide = ", out_dtype=tl.float64" if t == "tl.float64" else ""
            out.append(f"{pad}{s.name} = tl.dot(({a}).to({t}), ({b}).to({t}), "
                       f"{self.expr(s.acc)}, input_precision=\"ieee\"{wide})")

    def _make_descriptor(self, s: MakeDescriptor, pad: str, indent: int, out: list) -> None:
        self.uses_descriptors = True
        base = self.expr(s.base)
        ptr = f"ptr_{s.buffer}" + (f" + {base}" if base != "0" else "")
        shape = ", ".join(self.expr(d) for d in s.shape)
        strides = ", ".join(self.expr(d) for d in s.strides)
        out.append(f"{pad}{s.name} = tl.make_tensor_descriptor({ptr}, shape=[{shape}], strides=[{strides}], "
                   f"block_shape=[{s.block[0]}, {s.block[1]}])")

    def _descriptor_load(self, s: DescriptorLoad, pad: str, indent: int, out: list) -> None:
        at = ", ".join(self.expr(o) for o in s.offsets)
        load = f"{s.descriptor}.load([{at}])"
        out.append(f"{pad}{s.name} = {f'tl.trans({load})' if s.transpose else load}")

    def _for(self, s: For, pad: str, indent: int, out: list) -> None:
        if s.flatten:
            out.append(f"{pad}for {s.var} in tl.range({self.expr(s.start)}, {self.expr(s.stop)}, {s.step}, "
                       f"flatten=True):")
        else:
            out.append(f"{pad}for {s.var} in range({self.expr(s.start)}, {self.expr(s.stop)}, {s.step}):")
        self.stmts(s.body, indent + 1, out)

    def _check(self, s: Check, pad: str, indent: int, out: list) -> None:
        # compiled only in debug mode: the launcher builds kernels with checks that way
        out.append(f"{pad}tl.device_assert({self.expr(s.ok)}, {check_message(s)!r})")

    def _comment(self, s: Comment, pad: str, indent: int, out: list) -> None:
        out.append(f"{pad}# {s.text}")


#: expression node -> its printer
_EXPR = {Var: TritonPrinter._var, Const: TritonPrinter._const, Index: TritonPrinter._index, Cast: TritonPrinter._cast,
         Where: TritonPrinter._where, Unary: TritonPrinter.unary, Binary: TritonPrinter.binary}
#: statement -> its printer
_STMT = {ProgramId: TritonPrinter._program_id, Arange: TritonPrinter._arange, Let: TritonPrinter._let,
         Assign: TritonPrinter._let, Full: TritonPrinter._full, BroadcastTile: TritonPrinter._broadcast,
         TransposeTile: TritonPrinter._transpose,
         LoadTile: TritonPrinter._load, StoreTile: TritonPrinter._store, ReduceTile: TritonPrinter._reduce,
         ArgReduceTile: TritonPrinter._arg_reduce, DotTile: TritonPrinter._dot,
         MakeDescriptor: TritonPrinter._make_descriptor, DescriptorLoad: TritonPrinter._descriptor_load,
         For: TritonPrinter._for, Check: TritonPrinter._check, Comment: TritonPrinter._comment}

def generate(kernel: TileKernel, interpret: bool = False) -> str:
    """The module of one kernel, with its size variants (`tile.variants`) after it."""
    p = TritonPrinter(interpret)
    functions = "".join(_function(k, p) for k in all_kernels(kernel))
    head = ["import triton", "import triton.language as tl"]
    if p.uses_libdevice:
        head.append("from triton.language.extra import libdevice")
    helper_src = "".join(HELPERS[h] for h in sorted(p.helpers))
    return "\n".join(head) + "\n" + helper_src + functions


def _function(kernel: TileKernel, p: TritonPrinter) -> str:
    body: list[str] = []
    p.stmts(kernel.body, 1, body)
    params = [f"ptr_{q.name}" if q.kind == "buffer" else q.name for q in kernel.params]
    params += [f"{k}: tl.constexpr" for k in kernel.constexprs]
    sig = f"def {kernel.name}({', '.join(params)}):"
    return "\n\n@triton.jit\n" + sig + "\n" + "\n".join(body) + "\n"


__all__ = ["generate", "format_sympy", "InterpretUnsupported"]
