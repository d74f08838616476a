"""PNG plots of a benchmark report (matplotlib, the `bench` extra): speed-up over eager per
workload and backend, and each backend's fraction of the device's measured roofline."""
from __future__ import annotations

from pathlib import Path

from .speedups import speedups


def _grouped_bars(ax, workloads, backends, value, ylabel, title):
    width = 0.8 / max(1, len(backends))
    for i, b in enumerate(backends):
        xs = [j + (i - (len(backends) - 1) / 2) * width for j in range(len(workloads))]
        ys = [value(w, b) or float("nan") for w in workloads]  # n/a: no bar
        ax.bar(xs, ys, width, label=b)
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads, rotation=45, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")
    ax.grid(axis="y", alpha=0.3)


def write_plots(report: dict, out_dir: str | Path) -> tuple[list[Path], str | None]:
    """Write speedup.png and roofline.png into out_dir; returns (paths, None), or ([], why)
    when matplotlib is missing or nothing ran. n/a rows are drawn as empty bars."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # the bench extra is not installed
        return [], f"matplotlib is not importable ({type(e).__name__}); pip install -e '.[bench]'"
    results = [r for r in report["results"] if r["status"] == "ok"]
    if not results:
        return [], "no backend ran"
    meta = report["meta"]
    workloads = list(dict.fromkeys(r["workload"] for r in results))
    backends = list(dict.fromkeys(r["backend"] for r in results))
    roof = {(r["workload"], r["backend"]): r.get("roofline") for r in results}
    speed = speedups(report)
    where = f"{meta['device_name']}, {meta['dtype']}, {meta['sizes']} sizes"
    paths = []
    for name, value, ylabel, title in (
            ("speedup.png", lambda w, b: speed.get((w, b)), "speed-up over eager (×)",
             f"Speed-up over eager — {where}"),
            ("roofline.png", lambda w, b: (roof.get((w, b)) or 0.0) * 100,
             "% of measured roofline", f"Fraction of the roofline — {where}")):
        fig, ax = plt.subplots(figsize=(max(8.0, 0.6 * len(workloads) * len(backends) / 2), 5))
        _grouped_bars(ax, workloads, backends, value, ylabel, title)
        if name == "speedup.png":  # ratios: a log axis shows 0.5× as far from 1 as 2×
            ax.set_yscale("log")
            ax.axhline(1.0, color="black", linewidth=0.8)
        fig.tight_layout()
        path = Path(out_dir) / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths, None
