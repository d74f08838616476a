"""Turn a benchmark report ({"meta": ..., "results": [...]}, as `runner.run` returns it or
as read back from results.json) into a rich table, Markdown, and the files of `--out`.

Both renderings share `table_rows`, so the terminal and report.md show the same cells.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from .plots import write_plots
from .speedups import speedups

COLUMNS = ["workload", "backend", "compile s", "cold/warm s", "recomp", "p50 ms", "p99 ms", "host ms",
           "throughput", "roof", "vs eager", "peak MB", "max err", "eager err", "kern/ext",
           "ops/kern", "note"]
_RIGHT = {"compile s", "cold/warm s", "recomp", "p50 ms", "p99 ms", "host ms", "throughput", "roof",
          "vs eager", "peak MB", "max err", "eager err", "kern/ext", "ops/kern"}


def _sig(x, digits: int = 3) -> str:
    """`digits` significant digits without an exponent: 0.0346, 3.46, 346."""
    if x is None:
        return "-"
    if isinstance(x, str):  # non-finite floats are stored as strings in JSON
        return x
    if not math.isfinite(x) or x == 0:
        return str(x)
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    return f"{x:.{decimals}f}"


def _err(x) -> str:
    if x is None or isinstance(x, str):
        return "-" if x is None else x
    return f"{x:.1e}" if math.isfinite(x) else str(x)


def table_rows(report: dict) -> tuple[list[str], list[list[str]], list[str]]:
    """(column names, rows of cell strings, footnotes). n/a reasons become numbered
    footnotes (one per distinct reason) so the table stays narrow; columns that no row
    fills (cold/warm compile without --compile-latency) are left out."""
    results = report["results"]
    speed = speedups(report)
    reasons: dict[str, int] = {}
    rows = []
    for r in results:
        cells = {"workload": r["workload"], "backend": r["backend"],
                 "eager err": _err(r.get("eager_max_abs_err"))}
        if r["status"] != "ok":
            who = (f"{r['workload']} (every backend)" if r.get("scope") == "workload"
                   else r["backend"])
            reason = f"{who}: {r.get('reason') or 'unavailable'}"
            mark = reasons.setdefault(reason, len(reasons) + 1)
            cells.update({"p50 ms": "n/a", "note": f"n/a [{mark}]"})
        else:
            s = speed.get((r["workload"], r["backend"]))
            cold, warm = r.get("cold_compile_s"), r.get("warm_compile_s")
            recomp = r.get("recompiles")
            k, e = r.get("kernels"), r.get("externs")
            peak = r.get("peak_mem_bytes")
            roof = r.get("roofline")
            cells.update({
                "compile s": _sig(r["compile_s"]) if r["backend"] != "eager" else "-",
                "cold/warm s": f"{_sig(cold)}/{_sig(warm)}" if cold is not None else "",
                "recomp": "-" if recomp is None else
                          f"{recomp} ({r['dynamic_served']}/{r['dynamic_sizes']})",
                "p50 ms": _sig(r["p50_ms"]),
                "p99 ms": _sig(r["p99_ms"]),
                "host ms": _sig(r.get("host_ms")) if r.get("host_ms") is not None else "",
                "throughput": f"{_sig(r['throughput'])} {r['throughput_unit']}",
                "roof": "-" if roof is None else f"{100 * roof:.0f}%",
                "vs eager": f"{s:.2f}×" if s else "-",
                "peak MB": "-" if peak is None else _sig(peak / 2**20),
                "max err": _err(r["max_abs_err"]),
                "kern/ext": "-" if k is None else f"{k}/{e}",
                "ops/kern": _sig(r.get("fusion_ratio")),
                "note": "MISMATCH vs fp64" if r.get("correct") is False else "",
            })
        rows.append(cells)
    columns = [c for c in COLUMNS if any(cells.get(c) for cells in rows) or c in
               ("workload", "backend", "p50 ms", "note")]
    notes = [f"[{i}] {text}" for text, i in reasons.items()]
    return columns, [[cells.get(c, "") for c in columns] for cells in rows], notes


def _header_lines(meta: dict) -> list[str]:
    return [f"device: {meta['device']} — {meta['device_name']}",
            f"torch {meta['torch']}, triton {meta.get('triton', 'n/a')}, "
            f"tilefuse {meta.get('tilefuse', 'n/a')}, python {meta.get('python', '?')}",
            f"dtype {meta['dtype']}, sizes {meta['sizes']}; timing: {meta.get('timing', '')}",
            f"date: {meta['date']}"]


def render_table(report: dict):
    """A rich renderable: the results table (titled with device, dtype and sizes) followed by
    the footnotes that give each n/a reason."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    meta = report["meta"]
    columns, rows, notes = table_rows(report)
    table = Table(title=f"tilefuse bench — {meta['device_name']}, {meta['dtype']}, "
                        f"{meta['sizes']} sizes",
                  caption="\n".join(_header_lines(meta)[1:3]))
    for c in columns:
        table.add_column(c, justify="right" if c in _RIGHT else "left",
                         no_wrap=c != "note")
    for cells in rows:
        note = cells[columns.index("note")]
        style = "yellow" if note.startswith("n/a") else "red" if note else None
        table.add_row(*cells, style=style)
    return Group(table, *[Text(n, style="yellow") for n in notes])


METRICS_NOTE = (
    "compile s = wall time of the first call in this process (user's on-disk caches); "
    "cold/warm s = first call in a fresh process with empty cache directories / with the "
    "caches the cold run filled (--compile-latency); recomp = recompiles over the dynamic "
    "sweep (batch or sequence axis at ½, ¾, 1½ of its size) and (sizes served without "
    "recompiling / sizes tried); throughput = compulsory bytes (inputs read once, outputs "
    "written once) or matrix-product flops per p50 call; roof = ideal time under the "
    "measured roofline / p50; peak MB = peak allocated during one steady-state call above "
    "what was allocated before it; max err = max |out − fp64 reference| (a backend must be "
    "no further from fp64 than eager, up to a few ulps: MISMATCH otherwise); kern/ext = "
    "generated kernels / library calls; ops/kern = core-ATen ops per launched kernel.")


def to_markdown(report: dict, plots: list | None = None) -> str:
    """report.md: header (device, versions, date), the results table, n/a reasons, and a
    note on how it was measured."""
    meta = report["meta"]
    columns, rows, notes = table_rows(report)

    def line(cells):
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    align = ["---:" if c in _RIGHT else "---" for c in columns]
    out = ["# tilefuse bench", ""]
    out += [f"- {h}" for h in _header_lines(meta)]
    out += ["", line(columns), "| " + " | ".join(align) + " |"]
    out += [line(r) for r in rows]
    if notes:
        out += [""] + [f"- {n}" for n in notes]
    out += ["", "## Workloads and sizes", "", "| workload | size | fields |", "| --- | --- | --- |"]
    for name, s in meta.get("sizes_by_workload", {}).items():
        out.append(f"| {name} | {'×'.join(str(v) for v in s['size'])} | {s['fields']} |")
    c = meta.get("ceilings") or {}
    if c:
        out += ["", f"Measured ceilings: copy {c['copy_gbps']:.1f} GB/s, matmul "
                    f"{c['matmul_tflops']:.3f} TFLOP/s ({c['how']})."]
    out += ["", METRICS_NOTE, ""]
    if plots:
        out += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(out)


def progress_line(r: dict) -> str:
    """One line of rich markup for a finished result, printed while the run goes on."""
    from rich.markup import escape

    head = f"  {r['workload']:<17} {r['backend']:<21}"
    if r["status"] != "ok":
        reason = r["reason"] if len(r["reason"]) <= 80 else r["reason"][:77] + "..."
        return f"{head} [yellow]n/a[/] {escape(reason)}"
    mark = "  [red]MISMATCH vs fp64[/]" if r.get("correct") is False else ""
    return (f"{head} p50 {_sig(r['p50_ms'])} ms  compile {_sig(r['compile_s'])} s  "
            f"err {_err(r['max_abs_err'])}{mark}")


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def merge_reports(reports: list[dict]) -> dict:
    """One report from several runs of the same device, dtype and sizes (a benchmark split
    into parts): results concatenated; a (workload, backend) pair measured by several runs
    keeps the first run's figures, and later runs only fill the metrics it lacks (a second
    run with `--compile-latency` adds cold and warm compile times without mixing timings of
    different runs); the first run's meta, with the workloads and backends of all of them."""
    if not reports:
        raise ValueError("nothing to merge")
    first = reports[0]["meta"]
    for r in reports[1:]:
        m = r["meta"]
        for key in ("device", "dtype", "sizes"):
            if m.get(key) != first.get(key):
                raise ValueError(f"cannot merge runs with different {key}: {first.get(key)!r} and {m.get(key)!r}")
    pairs: dict = {}
    for r in reports:
        for res in r["results"]:
            key = (res["workload"], res["backend"])
            if key not in pairs:
                pairs[key] = dict(res, na=dict(res.get("na") or {}))
                continue
            have = pairs[key]
            if have.get("status") != "ok" and res.get("status") == "ok":
                pairs[key] = dict(res, na=dict(res.get("na") or {}))
                continue
            for field, value in res.items():
                if have.get(field) is None and value is not None and field != "na":
                    have[field] = value
                    have["na"].pop(field, None)
    meta = dict(first)
    from .workloads import WORKLOADS

    seen = list(dict.fromkeys(w for r in reports for w in r["meta"].get("workloads", [])))
    meta["workloads"] = [w for w in WORKLOADS if w in seen] + [w for w in seen if w not in WORKLOADS]
    meta["backends"] = list(dict.fromkeys(b for r in reports for b in r["meta"].get("backends", [])))
    meta["sizes_by_workload"] = {k: v for r in reports for k, v in r["meta"].get("sizes_by_workload", {}).items()}
    meta["merged_runs"] = len(reports)
    order = {w: k for k, w in enumerate(meta["workloads"])}
    border = {b: k for k, b in enumerate(meta["backends"])}
    results = sorted(pairs.values(), key=lambda x: (order.get(x["workload"], 1 << 30), border.get(x["backend"], 1 << 30)))
    return {"meta": meta, "results": results}


def write_json(report: dict, out_dir: str | Path) -> Path:
    """results.json alone (written after every pair while a run is in progress)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(_json_safe(report), indent=2) + "\n")
    tmp.replace(path)
    return path


def write_outputs(report: dict, out_dir: str | Path) -> tuple[Path, Path, list[Path]]:
    """Write results.json, the PNG plots (when matplotlib is importable; otherwise the
    report says why) and report.md into out_dir (created); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "results.json", out / "report.md"
    plots, why = write_plots(report, out)
    if why:
        report["meta"]["plots"] = why
    json_path.write_text(json.dumps(_json_safe(report), indent=2) + "\n")
    md_path.write_text(to_markdown(report, plots) +
                       (f"\nPlots not written: {why}\n" if why else ""))
    return json_path, md_path, plots
