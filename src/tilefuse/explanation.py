"""`tilefuse.explain` reports: what each compiled graph became, and why.

`str(explanation)` is a summary that fits a screen for a transformer block: per graph (forward,
backward) the kernels with their kind, the ops they hold and the user's source lines, externs
with their reasons, compile time per stage; then graph breaks with Dynamo's reasons. The rest
is on request: `verbose=True` adds each graph's IR, every fusion decision, what each kernel's
lowering and tuning decided (its plan's notes) and every kernel's source (a shared prelude
printed once); `.source("kernel name")` gives one kernel's source.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_OPS_WIDTH = 36
_FROM_WIDTH = 28
_TAG = re.compile(r"^(?P<tag>[A-Za-z0-9]+(?:_[A-Za-z0-9]+)*?_[0-9a-f]{6})_(?P<rest>.+)$")


def graph_tag_of(name: str) -> tuple[str, str]:
    """(graph tag, the rest) of a kernel name `<graph>_<fingerprint>_<kind>_<ops>_<k>`
    (`ir.identifiers.graph_tag`); ("", name) for a name without one."""
    found = _TAG.match(name)
    return (found.group("tag"), found.group("rest")) if found else ("", name)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


def split_prelude(source: str, name: str) -> tuple[str, str]:
    """(prelude, kernel) of a generated source: the helpers and headers every kernel of a
    backend shares, and the kernel's own definition (from its decorator or signature on)."""
    lines = source.splitlines()
    for k, line in enumerate(lines):
        stripped = line.lstrip()
        # (a C++ kernel starts with its range function, `backends.cpu.codegen.RANGE_SUFFIX`)
        if stripped.startswith((f"def {name}(", f'extern "C" void {name}(',
                                f'extern "C" void __attribute__((noinline)) {name}__programs(')):
            start = k - 1 if k > 0 and lines[k - 1].lstrip().startswith("@") else k
            return "\n".join(lines[:start]).strip("\n"), "\n".join(lines[start:])
    return "", source


def _counted(kernels: int, distinct: int) -> str:
    return f"{kernels} kernel(s)" + (f" ({distinct} distinct)" if distinct != kernels else "")


def _build(k, short, here) -> str:
    """Whose tuning and build a kernel uses: `= <kernel>` (identical to it), or its own, with
    how many others share it."""
    if getattr(k, "shares", ""):
        return f"= {short(k.shares)}" if k.shares in here and k.shares != k.name else f"= {k.shares} (earlier graph)"
    n = getattr(k, "shared_by", 0)
    return f"own, shared with {n} other(s)" if n else "own"


def _lines_of(kernel) -> str:
    """`model.py:12-14, 20` from the kernel's source lines (`file:line[ in fn: code]`)."""
    by_file: dict[str, list[int]] = {}
    for entry in getattr(kernel, "source_lines", None) or []:
        where = str(entry).split(" ", 1)[0]
        file, _, line = where.rpartition(":")
        if line.isdigit():
            by_file.setdefault(file.rsplit("/", 1)[-1], []).append(int(line))
    parts = []
    for file, numbers in by_file.items():
        numbers = sorted(set(numbers))
        parts.append(f"{file}:{numbers[0]}" + (f"-{numbers[-1]}" if len(numbers) > 1 else ""))
    return ", ".join(parts)


def _lowering_notes(report) -> list[str]:
    """The notes its kernels' lowering and tuning added to their plans (the key tiles a flash
    kernel skips, its row tiles, its re-basing, the tuned schedule), each once, in kernel order:
    what the fusion decisions, made before lowering, cannot say."""
    seen = set(report.decisions)
    out = []
    for k in report.kernels:
        for n in getattr(k, "notes", None) or ():
            if n not in seen:
                seen.add(n)
                out.append(n)
    return out


@dataclass
class Explanation:
    reports: list  # CompileReport per graph (forward, backward, ...)
    first_call_seconds: float = 0.0
    graph_breaks: list = field(default_factory=list)  # frontend.graph_breaks.GraphBreak
    verbose: bool = False

    @property
    def kernels(self) -> list:
        return [k for r in self.reports for k in r.kernels]

    @property
    def externs(self) -> list:
        return [e for r in self.reports for e in r.externs]

    @property
    def graphs(self) -> list[str]:
        return [r.graph_ir for r in self.reports]

    def kernel(self, name: str):
        """The kernel called `name`: its full name, or the name the summary shows (without
        the graph tag) when one kernel has it."""
        exact = [k for k in self.kernels if k.name == name]
        short = [k for k in self.kernels if graph_tag_of(k.name)[1] == name]
        found = exact or short
        if len(found) == 1:
            return found[0]
        if found:
            raise KeyError(f"{name!r} names a kernel in several graphs: use one of "
                           f"{', '.join(k.name for k in found)}")
        known = ", ".join(k.name for k in self.kernels) or "none"
        raise KeyError(f"no kernel {name!r} in this explanation (kernels: {known})")

    def source(self, name: str, prelude: bool = False) -> str:
        """One kernel's generated source (without the backend's shared prelude unless asked)."""
        k = self.kernel(name)
        head, body = split_prelude(k.source, k.name)
        return f"{head}\n\n{body}" if prelude and head else body

    def __str__(self) -> str:
        return self.format(self.verbose)

    def format(self, verbose: bool = False) -> str:
        kernels = sum(len(r.kernels) for r in self.reports)
        externs = sum(len(r.externs) for r in self.reports)
        distinct = sum(1 for k in self.kernels if not getattr(k, "shares", ""))
        head = (f"tilefuse: {len(self.reports)} graph(s), {_counted(kernels, distinct)}, {externs} extern(s), "
                f"{len(self.graph_breaks)} graph break(s)")
        if self.first_call_seconds:
            head += f"; first call {_seconds(self.first_call_seconds)}"
        out = [head]
        for r in self.reports:
            out.append("")
            out.extend(self._graph(r, verbose))
        if self.graph_breaks:
            out += ["", "graph breaks:"]
            out.extend(f"  {b}" for b in self.graph_breaks)
        if verbose:
            out.extend(self._sources())
        elif kernels:
            out += ["", "sources: explain(..., verbose=True), or .source(name) for one kernel"]
        return "\n".join(out)

    def _graph(self, r, verbose: bool) -> list[str]:
        total = r.stage_seconds.get("total")
        distinct = sum(1 for k in r.kernels if not getattr(k, "shares", ""))
        line = (f"{r.graph_name} · target {r.backend or 'n/a'} · {_counted(len(r.kernels), distinct)}, "
                f"{len(r.externs)} extern(s)")
        if total is not None:
            line += f" · compile {_seconds(total)}"
        out = [line]
        failure = getattr(r, "failure", "")
        if failure:
            out.append(f"  compilation failed: {failure} (the graph ran as the fallback knob says)")
        if getattr(r, "runs_as_written", ""):
            out.append(f"  runs as written: {r.runs_as_written} (eager PyTorch raises this error when the graph runs)")
        if getattr(r, "cuda_graphs", ""):
            out.append(f"  CUDA graphs: {r.cuda_graphs}")
        for formula in getattr(r, "index_formulas", ()):
            out.append(f"  computed from indices, not read (guarded per call): {formula}")
        if getattr(r, "cached", ""):
            out.append(f"  loaded from the graph cache ({r.cached}): the kernels of the compile that stored it")
        tags = {graph_tag_of(k.name)[0] for k in r.kernels}
        tag = tags.pop() if len(tags) == 1 else ""
        if tag:
            out.append(f"  kernels are named {tag}_<name below>")
        if r.kernels:
            short = (lambda n: graph_tag_of(n)[1] if tag and graph_tag_of(n)[0] == tag else n)
            rows: list[tuple[str, ...]] = [
                (short(k.name), k.kind, _clip(", ".join(getattr(k, "ops", None) or k.nodes), _OPS_WIDTH),
                 _clip(_lines_of(k), _FROM_WIDTH)) for k in r.kernels]
            titles: tuple[str, ...] = ("kernel", "kind", "ops", "from")
            if any(getattr(k, "shares", "") or getattr(k, "shared_by", 0) for k in r.kernels):
                here = {k.name for k in r.kernels}
                rows = [row + (_build(k, short, here),) for row, k in zip(rows, r.kernels)]
                titles += ("build",)
            widths = [max(len(row[c]) for row in rows + [titles]) for c in range(len(titles))]
            fmt = "  " + "  ".join(f"{{:<{w}}}" for w in widths)
            out.append(fmt.format(*titles).rstrip())
            out.extend(fmt.format(*row).rstrip() for row in rows)
        for name, target, reason in r.externs:
            out.append(f"  extern {name}: {target} — {reason}")
        times = [f"{k} {_seconds(v)}" for k, v in r.stage_seconds.items() if k != "total"]
        if times:
            out.append("  time: " + " · ".join(times))
        refusals = [d for d in r.decisions if d.split(": ", 1)[-1].startswith(("not ", "cannot", "refus"))]
        if verbose:
            out += ["  --- graph IR ---"] + ["  " + x for x in r.graph_ir.splitlines()]
            if r.decisions:
                out.append("  --- fusion decisions ---")
                out.extend(f"  {d}" for d in r.decisions)
            lowered = _lowering_notes(r)
            if lowered:
                out.append("  --- lowering notes ---")
                out.extend(f"  {n}" for n in lowered)
        elif r.decisions:
            out.append(f"  {len(r.decisions)} fusion decision(s), {len(refusals)} refusal(s) (verbose=True lists them)")
        return out

    def _sources(self) -> list[str]:
        out, preludes = [], {}
        for k in self.kernels:
            if not k.source:
                continue
            head, body = split_prelude(k.source, k.name)
            if head and head not in preludes:
                preludes[head] = k.name
                out += ["", f"--- prelude (shared by the kernels below it; first used by {k.name}) ---", head]
            out += ["", f"--- {k.name} source ---", body]
        return out
