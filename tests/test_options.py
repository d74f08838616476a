"""Compile options as an immutable value (`tilefuse.config.Options`): how it is made, and that
no stage reads a compile's knob from the global configuration."""
from __future__ import annotations

import ast
import os

import pytest
import torch

import tilefuse
from tilefuse.config import KNOBS, ConfigError, Options, UnknownOptionError, config

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "tilefuse")
# the modules that make the options (the API from the configuration) or stand outside the
# compile (the configuration itself, the command line, benchmarks, correctness tools)
_MAKERS = ("config.py", "api.py", "cli.py", "__main__.py", "bench" + os.sep, "check" + os.sep)


def test_options_take_the_configuration_with_the_compile_settings_over_it():
    with config.patch(matmul="aten"):
        opts = config.options({"autotune": "0"})
    assert opts.matmul == "aten" and opts.autotune == "0"
    assert opts.flash_split == config.flash_split
    assert config.options().autotune == config.autotune  # the configuration is unchanged


def test_options_are_immutable_and_replaced_with_checked_values():
    opts = config.options()
    with pytest.raises(AttributeError, match="immutable"):
        opts.autotune = "max"
    faster = opts.replace(autotune="max", backend="cpu")  # an older name is taken too
    assert (faster.autotune, faster.target, opts.autotune) == ("max", "cpu", config.autotune)
    with pytest.raises(ConfigError):
        opts.replace(autotune="2")
    with pytest.raises(UnknownOptionError):
        opts.replace(autotuning="max")
    with pytest.raises(AttributeError, match="autotune"):
        opts.autotun  # noqa: B018 - the closest knob is named


def test_options_are_values():
    a, b = Options({"flash_split": 2}), Options({"flash_split": 2})
    assert a == b and hash(a) == hash(b) and a != Options()
    assert repr(a) == "tilefuse.Options(flash_split=2)"
    assert a.non_defaults() == {"flash_split": 2}
    assert set(a.process_settings()) == {k.name for k in KNOBS.values() if k.process}


@pytest.mark.parametrize("how", ["options", "configuration"])
def test_a_compile_runs_with_its_options(how):
    """The compile's options reach the stages whether they come from `options=` or from the
    configuration of the moment (the defaults), and a graph keeps what it was compiled with."""
    torch._dynamo.reset()
    a, b = torch.randn(33, 20), torch.randn(20, 17)
    fn = torch.compile(lambda a, b: a @ b, backend="tilefuse", options={"matmul": "aten"} if how == "options" else None)
    if how == "options":
        out = fn(a, b)
    else:
        with config.patch(matmul="aten"):
            out = fn(a, b)
    torch.testing.assert_close(out, a @ b)
    report = tilefuse.last_compilations().reports[-1]
    assert [k.kind for k in report.kernels] == ["aten-matmul"]
    torch.testing.assert_close(fn(b.T.contiguous(), a.T.contiguous()), b.T @ a.T)  # recompiled: new options


def _global_knob_reads(path: str) -> list[str]:
    tree = ast.parse(open(path).read())
    compile_knobs = {name for name, k in KNOBS.items() if not k.process}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "config" \
                and node.attr in compile_knobs:
            found.append(f"{os.path.relpath(path, SRC)}:{node.lineno}: config.{node.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "config":
            found.append(f"{os.path.relpath(path, SRC)}:{node.lineno}: getattr(config, ...)")
    return found


def test_no_stage_reads_a_compile_knob_from_the_global_configuration():
    found = []
    for root, _, files in os.walk(SRC):
        for f in files:
            path = os.path.join(root, f)
            rel = os.path.relpath(path, SRC)
            if f.endswith(".py") and not rel.startswith(_MAKERS):
                found += _global_knob_reads(path)
    assert found == [], "stages take compile knobs from their Options value:\n" + "\n".join(found)
