"""What a new user meets first: torch.compile's mode= and options=, tilefuse.compile's checks,
explain's summary (forward and backward, keyword inputs, graph breaks), last_compilations,
the debug directory, logging through Python's and PyTorch's conventions, reproducers."""
import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tilefuse
from tilefuse.config import ConfigError, UnknownOptionError

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


class Block(nn.Module):
    """A pre-norm transformer block (d=64), as the issue's 4,525-line explain measured."""

    def __init__(self, d=64, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, causal=True):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def _close(out, ref, eager):
    err = (out.double() - ref).abs().max().item()
    assert err <= 2 * (eager.double() - ref).abs().max().item() + 1e-5, err


@pytest.mark.parametrize("mode", ["default", "max-autotune", "max-autotune-no-cudagraphs", None])
def test_torch_compile_modes_run(mode):
    fn = lambda x, w: torch.softmax(x @ w, -1) * 2  # noqa: E731
    x, w = torch.randn(7, 13), torch.randn(13, 9)
    torch._dynamo.reset()
    out = torch.compile(fn, backend="tilefuse", mode=mode)(x, w)
    _close(out, fn(x.double(), w.double()), fn(x, w))
    expected = {"default": {}, None: {}, "max-autotune": {"autotune": "max", "cuda_graphs": True},
                "max-autotune-no-cudagraphs": {"autotune": "max"}}[mode]
    assert tilefuse.last_compilations(1).reports[0].settings == expected


def test_reduce_overhead_turns_cuda_graphs_on_and_explain_says_where_they_are_not_used():
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = torch.compile(lambda x: x.exp() + 1, backend="tilefuse", mode="reduce-overhead")
        x = torch.randn(6)
        for _ in range(3):
            torch.testing.assert_close(f(x), x.exp() + 1)
    assert not [w for w in caught if "reduce-overhead" in str(w.message)]
    report = tilefuse.last_compilations(1).reports[0]
    assert report.settings == {"cuda_graphs": True}
    assert report.cuda_graphs == "not used: the graph runs on cpu tensors"
    assert "CUDA graphs: not used" in str(tilefuse.last_compilations(1))


def test_torch_compile_options_are_tilefuse_knobs():
    torch._dynamo.reset()
    x = torch.randn(5, 11)
    f = torch.compile(lambda a: a.sum(-1) * a.amax(-1), backend="tilefuse",
                      options={"autotune": "0", "target": "cpu", "index_checks": "off"})
    torch.testing.assert_close(f(x), x.sum(-1) * x.amax(-1))
    assert tilefuse.last_compilations(1).reports[0].settings == {"autotune": "0", "target": "cpu",
                                                                 "index_checks": False}


@pytest.mark.parametrize("options, error", [({"autotun": "0"}, UnknownOptionError),
                                            ({"verify": "banana"}, ConfigError)])
def test_bad_torch_compile_options_raise_and_never_fall_back(options, error):
    torch._dynamo.reset()
    with tilefuse.config.patch(fallback="eager"):
        with pytest.raises(Exception) as caught:
            torch.compile(lambda a: a.cos(), backend="tilefuse", options=options)(torch.randn(3))
    inner = getattr(caught.value, "inner_exception", caught.value)
    assert isinstance(inner, error), caught.value
    assert list(options)[0] in str(inner)


def test_tilefuse_compile_checks_options_before_any_call():
    fn = lambda a: a * 2  # noqa: E731
    with pytest.raises(TypeError, match="did you mean 'autotune'"):
        tilefuse.compile(fn, autotun="0")
    with pytest.raises(ValueError, match="TILEFUSE|autotune"):
        tilefuse.compile(fn, options={"autotune": "fast"})
    with pytest.raises(ValueError, match="mode="):
        tilefuse.compile(fn, mode="turbo")
    with pytest.raises(TypeError, match="target="):
        tilefuse.compile(fn, backend="cpu")


def test_tilefuse_compile_as_decorator_with_options():
    @tilefuse.compile(mode="max-autotune", target="cpu")
    def f(a, b):
        return torch.tanh(a) @ b

    a, b = torch.randn(6, 10), torch.randn(10, 3)
    _close(f(a, b), torch.tanh(a.double()) @ b.double(), torch.tanh(a) @ b)


def test_explain_summary_of_a_training_block_fits_a_screen_and_has_the_backward():
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(2, 9, 64)
    ex = tilefuse.explain(block, x, causal=True)  # keyword input
    names = [r.graph_name for r in ex.reports]
    assert any(n.startswith("forward") for n in names) and any(n.startswith("backward") for n in names)
    assert all(p.grad is None for p in block.parameters())  # explain did not run the backward
    text = str(ex)
    assert len(text.splitlines()) <= 80, text
    assert "backward" in text and "kernel" in text and "time:" in text
    assert '#include' not in text and "@triton.jit" not in text  # sources only on request
    verbose = ex.format(verbose=True)
    prelude_marker = "--- prelude"
    assert 1 <= verbose.count(prelude_marker) <= 2  # each backend's prelude once, not per kernel
    first = ex.kernels[0]
    assert first.name in verbose and ex.source(first.name).strip()
    with pytest.raises(KeyError, match="no kernel"):
        ex.source("no_such_kernel")


def test_explain_reports_graph_breaks_with_dynamos_reason_and_the_line():
    def f(x):
        y = x.sin()
        if y.sum() > 0:  # data-dependent branch: a graph break
            return y.cos()
        return y.tan()

    torch._dynamo.reset()
    ex = tilefuse.explain(f, torch.randn(8))
    assert ex.graph_breaks, str(ex)
    brk = ex.graph_breaks[0]
    assert "test_front_door.py" in brk.where and "branch" in brk.reason.lower()
    assert "graph breaks:" in str(ex)
    # Dynamo's graph-break logger is left as it was
    log = logging.getLogger("torch._dynamo.symbolic_convert.__graph_breaks")
    assert not any(type(h).__name__ == "_Collector" for h in log.handlers)


def test_last_compilations_without_recompiling():
    torch._dynamo.reset()
    f = torch.compile(lambda a: (a * 3).relu().sum(0), backend="tilefuse")
    x = torch.randn(4, 6)
    f(x)
    last = tilefuse.last_compilations(1)
    assert len(last.reports) == 1 and last.reports[0].kernels
    f(x)  # no new graph
    assert tilefuse.last_compilations(1).reports[0] is last.reports[0]
    f(torch.randn(4, 6, dtype=torch.float64))  # a new graph
    assert tilefuse.last_compilations(1).reports[0] is not last.reports[0]


def test_debug_dir_dumps_each_graph(tmp_path):
    torch._dynamo.reset()
    with tilefuse.config.patch(debug_dir=str(tmp_path)):
        f = torch.compile(lambda a, b: torch.softmax(a + b, -1), backend="tilefuse")
        f(torch.randn(3, 17), torch.randn(17))
    runs = list(tmp_path.iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("run-")
    graph_dir = next(runs[0].iterdir())
    for name in ("summary.txt", "fx_graph.py", "graph_ir.txt", "plans.txt"):
        assert (graph_dir / name).read_text().strip(), name
    assert list((graph_dir / "kernels").iterdir()) and list((graph_dir / "tile_ir").iterdir())


def test_records_reach_a_users_handler_without_tilefuse_logs(caplog):
    torch._dynamo.reset()
    with caplog.at_level(logging.DEBUG, logger="tilefuse"):
        torch.compile(lambda a: a.exp().sum(-1), backend="tilefuse")(torch.randn(3, 5))
    channels = {r.name for r in caplog.records}
    assert {"tilefuse.ir", "tilefuse.fusion"} <= channels, channels


def _run(script: str, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("TILEFUSE_LOGS", "TORCH_LOGS"))}
    full.update(PYTHONPATH=SRC, **env)
    return subprocess.run([sys.executable, "-c", script], env=full, capture_output=True, text=True, timeout=300)


SCRIPT = "import torch, tilefuse; torch.compile(lambda x: (x * 2).sum(-1), backend='tilefuse')(torch.randn(3, 50))"


def test_torch_logs_plus_tilefuse_shows_tilefuse_records():
    out = _run(SCRIPT, TORCH_LOGS="+tilefuse")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "def forward" in out.stderr  # the graph IR, through PyTorch's own handler


def test_torch_logs_takes_one_channel_by_its_package():
    out = _run(SCRIPT, TORCH_LOGS="+tilefuse.fusion,+tilefuse.compiler")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "def forward" not in out.stderr  # the graph IR channel (tilefuse.ir) stays quiet
    assert "kernel(s)" in out.stderr and "reduction" in out.stderr  # compile time and fusion


def test_tilefuse_logs_prints_only_the_channels_asked_for():
    out = _run(SCRIPT, TILEFUSE_LOGS="fusion")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "[tilefuse.fusion]" in out.stderr
    assert "[tilefuse.graph]" not in out.stderr and "[tilefuse.code]" not in out.stderr


def test_reproducer_records_the_knobs_that_were_set(tmp_path):
    from tilefuse.failure import reproducer_source

    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    source = reproducer_source(gm, [torch.randn(3)], knobs={"autotune": "0", "cache_dir": "/x", "matmul": "aten"})
    assert "autotune='0'" in source and "matmul='aten'" in source and "fallback='error'" in source
    assert "cache_dir" not in source


def test_logs_in_options_print_for_that_compile_and_leave_the_loggers_alone():
    script = ("import logging, torch, tilefuse\n"
              "levels = [(n, logging.getLogger(n).level, logging.getLogger(n).propagate) for n in "
              "('tilefuse', 'tilefuse.fusion')]\n"
              "torch.compile(lambda x: (x * 2).sum(-1), backend='tilefuse', options={'logs': 'fusion'})(torch.randn(3, 5))\n"
              "assert levels == [(n, logging.getLogger(n).level, logging.getLogger(n).propagate) for n, _, _ in levels]\n")
    out = _run(script)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "[tilefuse.fusion]" in out.stderr and "[tilefuse.graph]" not in out.stderr


def test_a_failing_debug_dump_never_breaks_a_compile(tmp_path, monkeypatch):
    from tilefuse import explanation

    def broken(self, verbose=False):
        raise RuntimeError("a broken summary")

    monkeypatch.setattr(explanation.Explanation, "format", broken)
    torch._dynamo.reset()
    with tilefuse.config.patch(debug_dir=str(tmp_path), fallback="error"):
        x = torch.randn(4, 7)
        torch.testing.assert_close(torch.compile(lambda a: a.tanh() * 2, backend="tilefuse")(x), x.tanh() * 2)


def test_the_interpreter_asked_for_without_triton_is_a_configuration_error():
    script = ("import sys; sys.modules['triton'] = None\n"
              "import torch, tilefuse\n"
              "from tilefuse.config import ConfigError\n"
              "try:\n"
              "    tilefuse.compile(lambda x: x * 2, target='interpret', fallback='eager')(torch.randn(3))\n"
              "except Exception as err:\n"
              "    assert isinstance(getattr(err, 'inner_exception', err), ConfigError), err\n"
              "    print('refused:', getattr(err, 'inner_exception', err))\n"
              "else:\n"
              "    raise SystemExit('ran eagerly')\n")
    out = _run(script)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "target='interpret' cannot run here" in out.stdout
