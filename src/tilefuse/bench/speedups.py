"""Speed-ups over eager, the figure both the report's table and its plots show."""
from __future__ import annotations


def speedups(report: dict) -> dict[tuple[str, str], float]:
    """{(workload, backend): eager p50 / backend p50} for the rows that ran."""
    results = report["results"]
    eager = {r["workload"]: r["p50_ms"] for r in results
             if r["backend"] == "eager" and r["status"] == "ok" and r["p50_ms"]}
    return {(r["workload"], r["backend"]): eager[r["workload"]] / r["p50_ms"]
            for r in results
            if r["status"] == "ok" and r["p50_ms"] and r["workload"] in eager}
