"""The target value (`tile.target`, `backends.targets`): what the tile layer and the tuner ask
a backend, instead of naming a device or comparing backend names."""
from __future__ import annotations

import ast
import os
from dataclasses import replace

import torch

from tilefuse.backends.targets import target_for
from tilefuse.tile.common import LoweringOptions
from tilefuse.tile.target import Machine, Target

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src", "tilefuse")


def test_a_target_is_a_value_of_its_machine_facts():
    a = Target.gpu(sm_count=132, tma=True)
    b = replace(a, generate=lambda k: "source", timer=object)  # operations are not its identity
    assert a == b and hash(a) == hash(b)
    assert "generate" not in repr(b) and "sm_count=132" in repr(b)
    assert a != Target.gpu(sm_count=66, tma=True)
    assert Target.cpu().on_cpu and not Target.interpreter().on_cpu and Target.interpreter().interpret
    assert LoweringOptions().target == Target.gpu()


def test_each_backend_supplies_its_target():
    cpu = target_for("cpu", torch.device("cpu"))
    assert cpu.machine is Machine.CPU and cpu.limits.stack_bytes and cpu.title == "C++"
    assert all(callable(op) for op in (cpu.generate, cpu.load, cpu.load_variant, cpu.check, cpu.timer, cpu.require))
    assert cpu.fallback == target_for("interpret", torch.device("cpu"))  # what C++ cannot print runs there
    interp = cpu.fallback
    assert interp.interpret and interp.machine is Machine.GPU and interp.sm_count == 0 and not interp.tma
    timer = cpu.timer(torch.device("cpu"))
    calls = []
    assert timer(lambda: calls.append(1)) >= 0 and len(calls) == 5  # the median of five calls


def _names_a_device(path: str, cuda: bool) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        if cuda and isinstance(node, ast.Attribute) and node.attr == "cuda":
            found.append(f"{path}:{node.lineno}: .cuda")
        if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in ("cpu", "triton", "interpret", "gpu")
                                                 for c in [node.left, *node.comparators]):
            found.append(f"{path}:{node.lineno}: compares with a backend's name")
    return found


def test_the_tile_layer_and_the_tuner_ask_the_target():
    """The tile layer names no device and no backend; the tuner compares no backend names (it
    times the GPU's ceilings itself, `tune.cost`)."""
    found = []
    for layer in ("tile", "tune"):
        root = os.path.join(SRC, layer)
        for f in sorted(os.listdir(root)):
            if f.endswith(".py"):
                found += _names_a_device(os.path.join(root, f), cuda=layer == "tile")
    assert found == [], "\n".join(found)
