"""`TILEFUSE_DEBUG_DIR`: every compiled graph written out as plain files to read and diff.

    <debug_dir>/run-<date>-<time>-<pid>/<graph>/
        summary.txt      what `tilefuse.explain` prints for the graph
        fx_graph.py      the ATen FX graph tilefuse received
        graph_ir.txt     the graph IR after the passes
        plans.txt        the kernel plans and every fusion decision
        tile_ir/<kernel>.txt, kernels/<kernel>.py|.cpp

One run directory per process, so processes never write into each other's files. A dump that
fails is logged and skipped: it never breaks a compile.
"""
from __future__ import annotations

import os
import time

from . import logs

_run_dir: dict[tuple, str] = {}  # (debug_dir, pid) -> this process's run directory


def run_directory(debug_dir: str) -> str:
    key = (debug_dir, os.getpid())
    if key not in _run_dir:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        _run_dir[key] = os.path.join(debug_dir, f"run-{stamp}-{os.getpid()}")
    return _run_dir[key]


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")


def dump_graph(debug_dir: str, report, gm=None) -> str | None:
    """Write one graph's files; return its directory (None if writing failed)."""
    from .explanation import Explanation

    where = os.path.join(run_directory(debug_dir), report.graph_name)
    try:
        _write(os.path.join(where, "summary.txt"), Explanation([report]).format(verbose=False))
        if gm is not None:
            _write(os.path.join(where, "fx_graph.py"), gm.print_readable(print_output=False))
        _write(os.path.join(where, "graph_ir.txt"), report.graph_ir)
        _write(os.path.join(where, "plans.txt"), report.plans + "\n\n# fusion decisions\n" + "\n".join(report.decisions))
        for k in report.kernels:
            if k.tile_ir:
                _write(os.path.join(where, "tile_ir", f"{k.name}.txt"), k.tile_ir)
            if k.source and k.kind not in ("aten-matmul", "empty"):
                suffix = ".cpp" if 'extern "C"' in k.source else ".py"
                _write(os.path.join(where, "kernels", k.name + suffix), k.source)
        return where
    except Exception as err:  # noqa: BLE001 - a dump is a courtesy: it never breaks a compile
        logs.info("runtime", "could not write %s under the debug directory: %s: %s", report.graph_name,
                  type(err).__name__, err)
        return None
