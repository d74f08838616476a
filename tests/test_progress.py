"""A graph compile's progress line (progress.py): shown on a terminal only, after the compile
has run for a while, with plans done, tuned and built, and erased when the graph is done; a
compile's summary line (schedules by source) goes to the `compile_time` log."""
import io
import logging

import torch

import tilefuse
from tilefuse import progress as progress_mod
from tilefuse.compile_profile import report_text
from tilefuse.config import config


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_nothing_is_written_off_a_terminal():
    out = io.StringIO()
    p = progress_mod.CompileProgress("forward0", 3, stream=out, show_after=0.0)
    p.done = 2
    p.now("tuning k")
    p.close()
    assert out.getvalue() == ""


def test_a_short_compile_writes_nothing():
    out = Terminal()
    p = progress_mod.CompileProgress("forward0", 3, stream=out, show_after=60.0)
    p.now("planning k")
    p.close()
    assert out.getvalue() == ""


def test_the_line_counts_and_is_erased(monkeypatch):
    monkeypatch.setattr(progress_mod, "REDRAW_S", 0.0)
    out = Terminal()
    p = progress_mod.CompileProgress("forward0", 7, stream=out, show_after=0.0)
    p.done, p.built = 3, 2
    p.tuning("forward_mm_3")(4, 8, 41.25e-6)
    text = out.getvalue()
    assert "compiling forward0: 3/7 kernel plans, 0 tuned, 2 built" in text
    assert "tuning forward_mm_3: 4 runs, best 41.2 us" in text
    p.close()
    assert out.getvalue().endswith("\r")  # blanked, the cursor back at the line's start
    assert out.getvalue().rsplit("\r", 2)[-2].strip() == ""


def test_a_compile_on_a_terminal_shows_its_plans(monkeypatch):
    monkeypatch.setattr(progress_mod, "SHOW_AFTER_S", 0.0)
    monkeypatch.setattr(progress_mod, "REDRAW_S", 0.0)
    monkeypatch.setattr(progress_mod.CompileProgress.__init__, "__defaults__", (None, 0.0))
    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)

    def f(x, w):
        return torch.softmax(x @ w, -1) * x.mean()

    x, w = torch.randn(37, 24), torch.randn(24, 24)
    torch._dynamo.reset()
    out = tilefuse.compile(f)(x, w)
    torch.testing.assert_close(out, f(x, w), rtol=1e-4, atol=1e-5)
    lines = term.getvalue().split("\r")
    shown = [ln for ln in lines if "kernel plans" in ln]
    assert shown and "compiling forward" in shown[-1], lines
    total = int(shown[-1].split("/")[1].split()[0])
    assert any(f"{total}/{total} kernel plans" in ln for ln in shown)
    assert lines[-1] == "" and lines[-2].strip() == ""  # erased at the end


def test_the_compile_time_log_names_where_schedules_came_from(caplog):
    def f(x):
        return torch.softmax(x, -1) + 1

    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="tilefuse.compiler"), config.patch(logs="compile_time"):
        tilefuse.compile(f)(torch.randn(9, 40))
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "tilefuse.compiler")
    assert "schedules: 1 by the rules" in text, text


def test_report_text_without_tuning_counts():
    class Report:
        graph_name, stage_seconds, kernels, externs = "g", {"total": 1.0}, [], []

    assert report_text(Report()).startswith("g: 1.000 s, 0 kernel(s), 0 distinct, 0 extern(s)")
