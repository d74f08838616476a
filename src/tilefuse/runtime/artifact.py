"""Compiled graphs as plain JSON: the encoding the graph cache stores (`graph_cache.py`).

`encode(value) -> bytes` and `decode(bytes) -> value` cover what a compiled graph is made of:
None, bools, ints, floats (inf and nan too), strings, bytes, lists, tuples, dicts, sets; sympy
expressions (each distinct subexpression once, rebuilt unevaluated from its class and
arguments: the tree as it was stored); torch dtypes, devices, small CPU tensors and ATen operators (by their
qualified name, looked up in `torch.ops`); and tilefuse's own objects:

* a dataclass or enum defined in tilefuse: its attributes (those named in the class's
  `__tilefuse_transient__` are left out and read back as None);
* an object whose class defines `__tilefuse_reduce__() -> args`: rebuilt by calling the class
  (or its `__tilefuse_rebuild__`, for interned values such as a reduction's `Monoid`) with
  those arguments (a launcher: `TritonKernel(kernel, source, interpret)` imports its module from
  the kernel cache, as a compile does);
* a function marked with `@artifact_function`.

Objects referenced twice come back as one object (a memo, as pickle keeps one), cycles
included. Anything else raises `ArtifactError` while encoding (the graph is then not cached).

Nothing is unpickled: decoding builds only those types, resolving tilefuse classes and
functions by name in tilefuse's own modules and sympy classes in sympy's; any other name in a
file is refused (`ArtifactError`). The files are trusted as the kernel cache's are (the kernel
sources a decoded launcher imports come from the same private, checksummed directory).
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import enum
import functools
import gc
import importlib
import json
import math
import types

import sympy

#: modules whose classes and marked functions a file may name
_OWN = ("tilefuse.",)
#: modules whose sympy classes (functions of expressions) a file may name
_SYMPY = ("sympy.", "tilefuse.", "torch.utils._sympy.")
#: FX's immutable lists and dicts (in extern calls' arguments) are stored as plain ones
_FX_COLLECTIONS = "torch.fx.immutable_collections"
#: texts at least this long are stored once however often they are referenced
_SHARED_TEXT = 256
#: tensors larger than this are not stored (a lifted constant is small; a weight is an input)
MAX_TENSOR_BYTES = 16 << 20


class ArtifactError(ValueError):
    """A value that cannot be encoded, or a file that does not decode."""


def artifact_function(fn):
    """Mark a module-level function as one a stored graph may refer to (a launcher)."""
    fn.__tilefuse_artifact__ = True
    return fn


def encode(value) -> bytes:
    # as in `decode`: the encoder's memo keeps every container it makes alive, so the collector
    # would promote them and scan the whole heap, over and over (0.31 of 0.37 s for a 12-layer
    # GPT-2's graph on a CPU)
    with _collector_paused():
        enc = _Encoder()
        body = enc.value(value)
        return json.dumps({"format": 1, "sympy": enc.sym_table, "value": body}, separators=(",", ":"),
                          allow_nan=False).encode()


def decode(data: bytes):
    # the many small containers a file makes would start a full cyclic collection of the
    # process's heap (torch, sympy, Dynamo: 0.15 s for a 67 kB file); nothing here is a cycle
    # the collector must find meanwhile
    with _collector_paused():
        return _decode(data)


@contextlib.contextmanager
def _collector_paused():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _decode(data: bytes):
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise ArtifactError(f"not an encoded artifact: {err}") from None
    if not isinstance(doc, dict) or doc.get("format") != 1:
        raise ArtifactError("unknown artifact format")
    dec = _Decoder(doc["sympy"])
    try:
        return dec.value(doc["value"])
    except ArtifactError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
        raise ArtifactError(f"malformed artifact: {type(err).__name__}: {err}") from None


def _name_of(obj) -> str:
    return f"{obj.__module__}:{obj.__qualname__}"


@functools.lru_cache(maxsize=4096)
def _resolve(name: str, prefixes: tuple):
    module, _, qualname = name.partition(":")
    if not module.startswith(prefixes) or not qualname or "<" in qualname:
        raise ArtifactError(f"a stored graph names {name!r}, outside what it may name")
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        raise ArtifactError(f"{name}: {err}") from None
    return obj


def _own_class(cls) -> bool:
    return isinstance(cls, type) and cls.__module__.startswith(_OWN) and "<" not in cls.__qualname__


class _Encoder:
    def __init__(self):
        self.memo: dict[int, int] = {}  # id(object) -> its number
        self.alive: list = []  # the memo's objects, kept alive while encoding (ids stay unique)
        self.sym_table: list = []
        self.sym_ids: dict[int, int] = {}  # id(expr) -> its entry
        self.sym_keys: dict[str, int] = {}  # an entry's text -> its number (equal trees stored once)
        self.sym_alive: list = []

    def _remember(self, obj) -> int:
        n = len(self.alive)
        self.memo[id(obj)] = n
        self.alive.append(obj)
        return n

    def value(self, v):
        if type(v) is str and len(v) >= _SHARED_TEXT:  # a kernel's source, held by each copy of it
            if id(v) in self.memo:
                return ["r", self.memo[id(v)]]
            return ["x", self._remember(v), v]
        if v is None or isinstance(v, (bool, str)) and not isinstance(v, enum.Enum):
            return v  # (a str enum — a plan's kind — is stored as its enum, below: it decodes typed)
        if type(v) is int:
            return v
        if type(v) is float:
            return v if math.isfinite(v) else ["f", repr(v)]
        if id(v) in self.memo:
            return ["r", self.memo[id(v)]]
        if isinstance(v, sympy.Basic):
            return ["y", self.sym(v)]
        if type(v) is tuple:
            return ["t", [self.value(x) for x in v]]
        if type(v) is list or isinstance(v, list) and type(v).__module__ == _FX_COLLECTIONS:
            n = self._remember(v)
            return ["l", n, [self.value(x) for x in v]]
        if type(v) is dict or isinstance(v, dict) and type(v).__module__ == _FX_COLLECTIONS:
            n = self._remember(v)
            return ["d", n, [[self.value(k), self.value(x)] for k, x in v.items()]]
        if type(v) in (set, frozenset):
            return ["s" if type(v) is set else "fs", [self.value(x) for x in v]]
        if type(v) is bytes:
            return ["b", base64.b64encode(v).decode()]
        special = self.torch_value(v)
        if special is not None:
            return special
        cls = type(v)
        if isinstance(v, types.FunctionType):
            if getattr(v, "__tilefuse_artifact__", False) and v.__module__.startswith(_OWN):
                return ["fn", _name_of(v)]
            raise ArtifactError(f"cannot store the function {v.__module__}.{v.__qualname__}")
        if not _own_class(cls):
            raise ArtifactError(f"cannot store a {cls.__module__}.{cls.__qualname__}")
        if isinstance(v, enum.Enum):
            return ["e", _name_of(cls), self.value(v.value)]
        reduce = getattr(cls, "__tilefuse_reduce__", None)
        if reduce is not None:
            args = [self.value(a) for a in reduce(v)]
            return ["R", self._remember(v), _name_of(cls), args]
        if not dataclasses.is_dataclass(cls) or not hasattr(v, "__dict__"):
            raise ArtifactError(f"cannot store a {_name_of(cls)} (neither a dataclass nor reducible)")
        n = self._remember(v)
        transient = getattr(cls, "__tilefuse_transient__", ())
        state = [[k, self.value(x)] for k, x in vars(v).items() if k not in transient]
        return ["o", n, _name_of(cls), state, list(transient)]

    def torch_value(self, v):
        import torch

        if isinstance(v, torch.dtype):
            return ["dt", str(v).removeprefix("torch.")]
        if isinstance(v, torch.device):
            return ["dev", str(v)]
        if isinstance(v, torch._ops.OpOverload):
            return ["op", v.name()]
        if isinstance(v, torch.Tensor):
            if type(v) is not torch.Tensor and not isinstance(v, torch.nn.Parameter) or v.layout != torch.strided:
                raise ArtifactError(f"cannot store a {type(v).__name__} ({v.layout})")
            nbytes = v.numel() * v.element_size()
            if nbytes > MAX_TENSOR_BYTES:
                raise ArtifactError(f"a constant of {nbytes} bytes is too large to store")
            data = v.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            return ["T", str(v.dtype).removeprefix("torch."), list(v.shape), str(v.device),
                    base64.b64encode(data).decode()]
        return None

    def sym(self, e) -> int:
        found = self.sym_ids.get(id(e))
        if found is not None:
            return found
        if isinstance(e, sympy.Symbol):  # (Dummy and Wild are refused: their identity is not their name)
            if type(e) is not sympy.Symbol:
                raise ArtifactError(f"cannot store a sympy {type(e).__name__}")
            given = getattr(e, "_assumptions_orig", None)  # (as created; sympy derives the rest alike)
            given = e.assumptions0 if given is None else given
            entry = ["S", e.name, {k: v for k, v in given.items() if v is not None}]
        elif isinstance(e, sympy.Integer):
            entry = ["I", str(int(e))]
        elif isinstance(e, sympy.Rational):
            entry = ["Q", str(e.p), str(e.q)]
        elif isinstance(e, sympy.Float):
            sign, man, exp, bc = e._mpf_
            entry = ["F", [sign, str(int(man)), exp, bc], e._prec]
        else:
            if not type(e).__module__.startswith(_SYMPY) or "<" in type(e).__qualname__ or \
                    not _resolvable(type(e)):
                raise ArtifactError(f"cannot store the sympy function {type(e).__qualname__}")
            entry = ["A", _name_of(type(e)), [self.sym(a) for a in e.args]]
        key = repr(entry)
        n = self.sym_keys.get(key)
        if n is None:
            n = self.sym_keys[key] = len(self.sym_table)
            self.sym_table.append(entry)
        self.sym_ids[id(e)] = n
        self.sym_alive.append(e)
        return n


def _resolvable(cls) -> bool:
    try:
        return _resolve(_name_of(cls), _SYMPY) is cls
    except ArtifactError:
        return False


class _Decoder:
    def __init__(self, sym_table: list):
        self.objects: dict[int, object] = {}
        self.syms: list = []
        for entry in sym_table:
            self.syms.append(self._sym(entry))

    def _sym(self, entry):
        tag = entry[0]
        if tag == "S":
            return sympy.Symbol(entry[1], **{k: bool(v) for k, v in entry[2].items()})
        if tag == "I":
            return sympy.Integer(int(entry[1]))
        if tag == "Q":
            return sympy.Rational(int(entry[1]), int(entry[2]))
        if tag == "F":
            sign, man, exp, bc = entry[1]
            return sympy.Float._new((int(sign), int(man), int(exp), int(bc)), int(entry[2]))
        if tag == "A":
            cls = _resolve(entry[1], _SYMPY)
            if not (isinstance(cls, type) and issubclass(cls, sympy.Basic)):
                raise ArtifactError(f"{entry[1]} is not a sympy class")
            args = [self.syms[k] for k in entry[2]]
            try:  # the stored tree as it was (evaluating again costs, and changes nothing)
                return cls(*args, evaluate=False)
            except TypeError:  # a class without the option
                return cls(*args)
        raise ArtifactError(f"unknown sympy entry {tag!r}")

    def value(self, v):
        if not isinstance(v, list):
            if isinstance(v, float) or v is None or isinstance(v, (bool, int, str)):
                return v
            raise ArtifactError(f"unexpected {type(v).__name__} in an artifact")
        tag = v[0]
        if tag == "r":
            return self.objects[v[1]]
        if tag == "y":
            return self.syms[v[1]]
        if tag == "x":
            if not isinstance(v[2], str):
                raise ArtifactError("a shared text that is not text")
            self.objects[v[1]] = v[2]
            return v[2]
        if tag == "f":
            return float(v[1])
        if tag == "t":
            return tuple(self.value(x) for x in v[1])
        if tag == "l":
            out: list = []
            self.objects[v[1]] = out
            out.extend(self.value(x) for x in v[2])
            return out
        if tag == "d":
            d: dict = {}
            self.objects[v[1]] = d
            for k, x in v[2]:
                d[self.value(k)] = self.value(x)
            return d
        if tag in ("s", "fs"):
            items = [self.value(x) for x in v[1]]
            return set(items) if tag == "s" else frozenset(items)
        if tag == "b":
            return base64.b64decode(v[1])
        if tag in ("dt", "dev", "op", "T"):
            return self.torch_value(v)
        if tag == "fn":
            fn = _resolve(v[1], _OWN)
            if not getattr(fn, "__tilefuse_artifact__", False):
                raise ArtifactError(f"{v[1]} is not a function a stored graph may name")
            return fn
        if tag == "e":
            cls = _resolve(v[1], _OWN)
            if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
                raise ArtifactError(f"{v[1]} is not an enum")
            return cls(self.value(v[2]))
        if tag == "R":
            cls = _resolve(v[2], _OWN)
            if not (isinstance(cls, type) and "__tilefuse_reduce__" in dir(cls)):
                raise ArtifactError(f"{v[2]} cannot be rebuilt from arguments")
            build = getattr(cls, "__tilefuse_rebuild__", cls)  # (a class may intern its values)
            obj = build(*(self.value(a) for a in v[3]))
            self.objects[v[1]] = obj
            return obj
        if tag == "o":
            cls = _resolve(v[2], _OWN)
            if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
                raise ArtifactError(f"{v[2]} is not a dataclass")
            obj = object.__new__(cls)
            self.objects[v[1]] = obj
            for k, x in v[3]:
                object.__setattr__(obj, k, self.value(x))
            for k in v[4]:
                object.__setattr__(obj, k, None)
            return obj
        raise ArtifactError(f"unknown tag {tag!r}")

    def torch_value(self, v):
        import torch

        tag = v[0]
        if tag == "dt":
            dtype = getattr(torch, v[1], None)
            if not isinstance(dtype, torch.dtype):
                raise ArtifactError(f"unknown dtype {v[1]!r}")
            return dtype
        if tag == "dev":
            return torch.device(v[1])
        if tag == "op":
            namespace, _, rest = v[1].partition("::")
            op, _, overload = rest.partition(".")
            try:
                return getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")
            except (AttributeError, RuntimeError) as err:
                raise ArtifactError(f"operator {v[1]} not found: {err}") from None
        dtype = getattr(torch, v[1], None)
        if not isinstance(dtype, torch.dtype):
            raise ArtifactError(f"unknown dtype {v[1]!r}")
        data = bytearray(base64.b64decode(v[4]))
        flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        tensor = flat.view(dtype).reshape(v[2]) if data else torch.empty(v[2], dtype=dtype)
        return tensor.to(v[3])


__all__ = ["ArtifactError", "artifact_function", "encode", "decode", "MAX_TENSOR_BYTES"]
