"""The graph cache's encoding (`runtime.artifact`): every kind of value a compiled graph holds
comes back equal (sympy trees exactly as stored, shared objects shared), and nothing outside
tilefuse's and sympy's own names decodes."""
import dataclasses
import enum
import json
import math

import pytest
import sympy
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import Binary, Const, Load
from tilefuse.ir.graph import Constant, Graph, Input
from tilefuse.runtime import artifact
from tilefuse.runtime.artifact import ArtifactError, decode, encode
from tilefuse.runtime.compiled import KernelStep


def roundtrip(value):
    return decode(encode(value))


def _tree(e):
    """A sympy tree as nested (type, children) pairs, each leaf with its value (not srepr: it
    prints a symbol's assumptions in the order of whichever equal symbol sympy cached first,
    which depends on the tests run before). Min, Max, And and Or hold their arguments as a set and list
    them in an order that depends on the same cache, so their children compare as a multiset."""
    if not e.args:
        return (type(e), e)
    children = [_tree(a) for a in e.args]
    if isinstance(e, sympy.core.operations.LatticeOp):
        children.sort(key=repr)
    return (type(e), tuple(children))


def test_plain_values():
    value = {"a": [1, -2**70, 0.5, -0.0, float("inf"), float("-inf"), None, True, "s"],
             (1, "k"): (b"\x00\xff", {3, 4}, frozenset({"x"})), 7: []}
    back = roundtrip(value)
    assert back == value
    assert math.copysign(1, back["a"][3]) == -1 and type(back[(1, "k")]) is tuple
    assert math.isnan(roundtrip(float("nan")))


s0, s1 = sympy.symbols("s0 s1", integer=True, positive=True)
x = sympy.Symbol("x")


@st.composite
def expressions(draw, depth=3):
    leaves = st.sampled_from([s0, s1, x, sympy.Integer(3), sympy.Integer(-7), sympy.Rational(2, 3),
                              sympy.Float(0.1), sympy.S.Half])
    if depth == 0:
        return draw(leaves)
    a, b = draw(expressions(depth=depth - 1)), draw(expressions(depth=depth - 1))
    make = draw(st.sampled_from([
        lambda a, b: a + b, lambda a, b: a * b, lambda a, b: a - 2 * b, lambda a, b: sympy.floor(a / (b + 11)),
        lambda a, b: sympy.Max(a, b), lambda a, b: sympy.Min(a, 5), lambda a, b: sympy.Mod(s0 * 3 + 1, s1 + 2),
        lambda a, b: sympy.Piecewise((a, sympy.Lt(s0, 4)), (b, True)),
        lambda a, b: a, lambda a, b: sympy.exp(a) if a.is_finite else a,
    ]))
    return make(a, b)


@settings(max_examples=60, deadline=None)
@given(expressions())
def test_sympy_trees_come_back_as_stored(e):
    back = roundtrip(e)
    assert back == e and _tree(back) == _tree(e)
    assert back.free_symbols == e.free_symbols
    assert all(a.assumptions0 == b.assumptions0 for a, b in zip(sorted(back.free_symbols, key=str),
                                                                 sorted(e.free_symbols, key=str)))


def test_relations_and_booleans():
    values = [sympy.Eq(s0, s1 + 1), sympy.Lt(s0 * 2, s1), sympy.And(sympy.Ge(s0, 2), sympy.Ne(s1, 3)), sympy.true,
              sympy.S.NaN, sympy.zoo, -sympy.oo, sympy.pi * s0]
    back = roundtrip(values)
    assert back == values and [_tree(v) for v in back] == [_tree(v) for v in values]


def test_long_texts_referenced_twice_are_stored_once():
    source = "def kernel():\n" + "    x = 1\n" * 100
    doc = encode([source, source, {"a": source}, "short", "short"])
    assert doc.count(b"x = 1") == 100 and decode(doc) == [source, source, {"a": source}, "short", "short"]


def test_equal_subtrees_are_stored_once():
    e = (s0 * 64 + s1) * (s0 * 64 + s1 + 1)
    doc = json.loads(encode([e, e + 1, s0 * 64]))
    entries = [repr(x) for x in doc["sympy"]]
    assert len(entries) == len(set(entries))


def test_a_dummy_symbol_is_refused():
    with pytest.raises(ArtifactError):
        encode(sympy.Dummy("d") + 1)


def test_ir_objects_shared_and_cyclic():
    graph = Graph(name="g")
    inp = graph.add(Input("a", dt.float32, (s0, 4), position=0))
    graph.inputs.append(inp)
    body = Binary("add", Load("a", (sympy.Symbol("i0"), 1), dt.float32), Const(2.5, dt.float32), dt.float32)
    graph.add(Constant("c", dt.float32, (3,), value=torch.tensor([1.0, -2.0, 3.5])))
    holder = [graph, body, body]
    holder.append(holder)  # a cycle
    back = roundtrip(holder)
    g = back[0]
    assert g.inputs[0] is g.nodes["a"] and g.nodes["a"].shape == (s0, 4)
    assert back[1] == body and back[1] is back[2] and back[3] is back
    assert torch.equal(g.nodes["c"].value, torch.tensor([1.0, -2.0, 3.5]))


def test_interned_values_come_back_as_themselves():
    from tilefuse.ir.graph import Reduce
    from tilefuse.ir.monoid import ARGMAX, MAX, SUM

    node = Reduce("r", dt.float32, (s0,), ranges=(7,), combiner=MAX, body=Const(1.0, dt.float32))
    back = roundtrip([SUM, ARGMAX, node])
    assert back[0] is SUM and back[1] is ARGMAX and back[2].combiner is MAX


def test_transient_attributes_are_left_out():
    step = KernelStep("k", None, ["out"], ["a"], keep=object())
    back = roundtrip(step)
    assert back.keep is None and back.writes == ["out"] and back.reads == ["a"]


def test_reducible_objects_are_rebuilt_by_their_class():
    from tilefuse.runtime.dispatch import SizeDispatch
    from tilefuse.tile.variants import SizeVariants

    launch = KernelStep("inner", None, [], [])  # any storable value stands for a launcher here
    variants = SizeVariants(extent=s0 * 4, bounds=(64,), kernels=[])
    d = SizeDispatch(variants, launch, [launch])
    back = roundtrip([d, d])
    assert isinstance(back[0], SizeDispatch) and back[0] is back[1]
    assert back[0].launcher is back[0].alternatives[0]
    assert back[0].value({s0: 3, "s0": 3}) == 12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool,
                                   torch.complex64])
def test_tensors(dtype):
    t = (torch.randn(5, 7) * 10).to(dtype).t()  # not contiguous
    back = roundtrip(t)
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)
    assert torch.equal(roundtrip(torch.empty(0, 3, dtype=dtype)), torch.empty(0, 3, dtype=dtype))


def test_large_tensors_are_refused(monkeypatch):
    monkeypatch.setattr(artifact, "MAX_TENSOR_BYTES", 100)
    with pytest.raises(ArtifactError, match="too large"):
        encode(torch.randn(100))


def test_torch_names():
    ops = [torch.ops.aten.convolution.default, torch.ops.aten.add.Tensor, torch.ops.aten.sort.default]
    assert roundtrip(ops) == ops
    assert roundtrip([torch.bfloat16, torch.device("cpu")]) == [torch.bfloat16, torch.device("cpu")]


@dataclasses.dataclass
class NotOurs:
    a: int = 1


class Colour(enum.Enum):
    RED = 1


def test_foreign_values_are_refused():
    for value in (NotOurs(), Colour.RED, print, lambda: 1, object(), torch.nn.Linear(2, 2)):
        with pytest.raises(ArtifactError):
            encode(value)


def _doc(value, sym=()):
    return json.dumps({"format": 1, "sympy": list(sym), "value": value}).encode()


@pytest.mark.parametrize("doc", [
    _doc(["fn", "os:system"]),  # a function outside tilefuse
    _doc(["fn", "tilefuse.cache.disk:cache_key"]),  # a tilefuse function not marked storable
    _doc(["o", 0, "tilefuse.runtime.compiled:CompiledGraph", [], []]),  # not a dataclass
    _doc(["R", 0, "tilefuse.ir.graph:Input", []]),  # a class that is not rebuilt from arguments
    _doc(["R", 0, "subprocess:Popen", [["l", 1, ["ls"]]]]),
    _doc(["y", 0], [["A", "builtins:eval", []]]),  # a sympy entry naming something else
    _doc(["y", 0], [["A", "tilefuse.cache.disk:DiskCache", []]]),
    _doc(["e", "tilefuse.ir.graph:Graph", 1]),
    _doc(["zz"]),
    b"not json",
    b'{"format": 2, "sympy": [], "value": 1}',
])
def test_files_naming_anything_else_are_refused(doc):
    with pytest.raises(ArtifactError):
        decode(doc)
