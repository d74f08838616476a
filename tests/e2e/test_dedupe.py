"""Identical kernels are tuned and built once (issue #16): a stack of identical blocks
compiles as many distinct kernels as one block, each C++ kernel is built once, `explain`
lists every kernel under its own name, and the results match eager under the fp64 rule."""
import copy

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from tilefuse import dedupe
from tilefuse.backends.cpu import toolchain
from tilefuse.compare import compare_outputs
from tilefuse.check.compile_profile import compile_profile

pytestmark = pytest.mark.skipif(toolchain.find_compiler() is None, reason="no C++ compiler")


class Block(torch.nn.Module):
    def __init__(self, d=24):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 2 * d)
        self.fc2 = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x)))) * torch.sigmoid(x)


def _stack(layers):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block() for _ in range(layers)]).eval()


def _distinct(explanation):
    """The kernels with a build of their own (ATen's matmuls build nothing)."""
    return [k for k in explanation.kernels if not getattr(k, "shares", "") and k.kind not in ("aten-matmul", "empty")]


def _explain(model, x, target, tmp_path, monkeypatch):
    """explain() of `model(x)` from a cold start: no earlier kernel to share, a fresh C++ cache;
    also returns how many C++ libraries were built."""
    dedupe.clear()
    builds = []
    real = toolchain.build
    monkeypatch.setattr(toolchain, "build", lambda source, cxx: builds.append(source) or real(source, cxx))
    with torch.no_grad():
        e = tilefuse.explain(model, x, options={"target": target, "cache_dir": str(tmp_path / target)})
    return e, builds


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_identical_layers_compile_once(target, tmp_path, monkeypatch):
    if target == "interpret":
        pytest.importorskip("triton")
    x = torch.randn(5, 7, 24)
    one, _ = _explain(_stack(1), x, target, tmp_path / "one", monkeypatch)
    three, builds = _explain(_stack(3), x, target, tmp_path / "three", monkeypatch)
    generated = [k for k in three.kernels if k.kind not in ("aten-matmul", "empty")]
    assert len(generated) >= 3 * len([k for k in one.kernels if k.kind not in ("aten-matmul", "empty")]) - 3
    # the 3-layer graph has no kernel that the 1-layer graph does not
    assert len(_distinct(three)) == len(_distinct(one)) < len(three.kernels)
    if target == "cpu":  # one C++ build per distinct generated kernel
        assert len(builds) == len(_distinct(three))
    # every kernel keeps its own name; a duplicate names the kernel it shares
    names = [k.name for k in three.kernels]
    assert len(set(names)) == len(names)
    for k in three.kernels:
        if k.shares:
            assert k.shares in names and k.shares != k.name
    text = str(three)
    shared = [k for k in three.kernels if k.shares]
    assert f"{len(three.kernels)} kernel(s) ({len(three.kernels) - len(shared)} distinct)" in text
    assert "= " in text and "shared with" in text

    model = _stack(3)
    with torch.no_grad():
        ref = copy.deepcopy(model).double()(x.double())
        eager = model(x)
        compiled = torch.compile(model, backend="tilefuse", options={"target": target})(x)
    assert compare_outputs(compiled, eager, ref) is None


def test_compile_profile_structure(tmp_path):
    dedupe.clear()
    with torch.no_grad(), tilefuse.config.patch(cache_dir=str(tmp_path)):
        # every function: under load Dynamo's and AOTAutograd's frames can fill any fixed top-N
        prof = compile_profile(_stack(2), torch.randn(3, 24), top=None)
    [report] = prof.explanation.reports
    assert {"lower", "passes", "fusion", "tile"} <= set(report.stage_seconds)
    assert prof.functions and all(len(row) == 4 for row in prof.functions)
    assert any("compiler.py" in f and "compile_ir" in f for f, *_ in prof.functions)
    from tilefuse.compile_profile import report_text

    text = report_text(report)
    assert report.graph_name in text and "distinct" in text and "stages:" in text


def test_compile_time_channel(tmp_path, caplog):
    import logging

    dedupe.clear()
    with caplog.at_level(logging.INFO, logger="tilefuse.compiler"), torch.no_grad(), \
            tilefuse.config.patch(cache_dir=str(tmp_path), logs="compile_time"):
        torch.compile(_stack(2), backend="tilefuse")(torch.randn(3, 24))
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "tilefuse.compiler")
    assert "distinct" in text and "stages:" in text and "fusion" in text
