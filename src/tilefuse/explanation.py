"""`tilefuse.explain` reports: what each compiled graph became, and why."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Explanation:
    reports: list  # CompileReport per graph (forward, backward, ...)
    first_call_seconds: float = 0.0

    @property
    def kernels(self) -> list:
        return [k for r in self.reports for k in r.kernels]

    @property
    def externs(self) -> list:
        return [e for r in self.reports for e in r.externs]

    @property
    def graphs(self) -> list[str]:
        return [r.graph_ir for r in self.reports]

    def __str__(self) -> str:
        out = []
        for r in self.reports:
            out.append(f"=== {r.graph_name} (backend: {r.backend or 'n/a'}) ===")
            out.append("--- graph IR ---")
            out.append(r.graph_ir)
            out.append(f"--- {len(r.kernels)} kernel(s), {len(r.externs)} extern(s) ---")
            for k in r.kernels:
                out.append(f"{k.name} [{k.kind}]: {', '.join(k.nodes)}")
                out.extend(f"    {n}" for n in k.notes)
            for name, target, reason in r.externs:
                out.append(f"extern {name}: {target} — {reason}")
            if r.decisions:
                out.append("--- fusion decisions ---")
                out.extend(f"  {d}" for d in r.decisions)
            out.append("--- compile time per stage ---")
            out.append("  " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r.stage_seconds.items()))
            for k in r.kernels:
                out.append(f"--- {k.name} source ---")
                out.append(k.source)
        return "\n".join(out)
