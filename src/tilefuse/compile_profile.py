"""Where a graph's compile time went: the `compile_time` log channel's report (time per stage,
the slowest kernels, kernels against distinct ones) and a cProfile of a whole compile for tests
and investigations."""
from __future__ import annotations

import cProfile
import pstats

#: the stages in pipeline order (the report lists any other after them)
STAGES = ("graph cache", "lower", "passes", "fusion", "tune", "tile", "codegen", "load", "store")
#: the tune stage's phases (`tune.tuner.TuneOutcome.phases`)
TUNE_PHASES = ("rank", "check", "submit", "build", "measure")


_SOURCES = {"measured": "measured", "cache": "from the tuning cache", "model": "by the cost model",
            "rules": "by the rules"}


def report_text(report, top: int = 5) -> str:
    """A multi-line summary of one graph's `CompileReport`."""
    times = report.stage_seconds
    total = times.get("total", sum(v for k, v in times.items() if k != "total"))
    distinct = sum(1 for k in report.kernels if not k.shares)
    order = [s for s in STAGES if s in times] + [s for s in times if s not in STAGES and s != "total"]
    if getattr(report, "cached", ""):
        return (f"{report.graph_name}: {total:.3f} s, loaded from the graph cache ({report.cached}): "
                f"{len(report.kernels)} kernel(s), {distinct} distinct, {len(report.externs)} extern(s)")
    tuning = getattr(report, "tuning", {})
    tuned = (", schedules: " + ", ".join(f"{n} {_SOURCES.get(k, k)}" for k, n in sorted(tuning.items()))
             if tuning else "")
    lines = [f"{report.graph_name}: {total:.3f} s, {len(report.kernels)} kernel(s), {distinct} distinct, "
             f"{len(report.externs)} extern(s){tuned}",
             "  stages: " + " · ".join(f"{s} {times[s]:.3f} s" for s in order)]
    phases = getattr(report, "tune_phases", {})
    if phases:
        lines.append("  tune: " + " · ".join(f"{p} {phases[p]:.3f} s" for p in TUNE_PHASES if p in phases))
    slow = sorted(report.kernels, key=lambda k: -(k.compile_seconds + k.tune_seconds))[:top]
    for k in slow:
        shared = f" (= {k.shares})" if k.shares else (f" (shared by {k.shared_by})" if k.shared_by else "")
        lines.append(f"  {k.compile_seconds:.3f} s  {k.name}{shared}")
    return "\n".join(lines)


def cprofile(fn, *args, top: int | None = 20, sort: str = "cumulative", **kwargs):
    """(fn's result, the `top` functions of a cProfile of the call, every one for None):
    [(function, calls, own seconds, cumulative seconds)], function as `file:line(name)`."""
    prof = cProfile.Profile()
    result = prof.runcall(fn, *args, **kwargs)
    stats = pstats.Stats(prof)
    stats.sort_stats(sort)
    rows = []
    for func in stats.fcn_list[:top]:
        calls, _, own, cumulative, _ = stats.stats[func]
        rows.append((f"{func[0]}:{func[1]}({func[2]})", calls, own, cumulative))
    return result, rows


__all__ = ["report_text", "cprofile", "STAGES", "TUNE_PHASES"]
