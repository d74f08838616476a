"""The `tilefuse` command's work: `explain`, `cache info|clear`, `ops [--sweep]`, `fuzz`.

The command line is parsed, and what needs no registry checked, by the console script's module
`tilefuse_cli` (top level, so that `--help` does not import torch); it then calls `run(args)`
here. What needs a registry (OpInfo names, dtypes) is checked here, before any work starts.
`python -m tilefuse.cli` runs the same command.
"""
from __future__ import annotations

import dataclasses
import json
import os
import runpy
import sys
import time
import traceback


def main(argv: list[str] | None = None) -> int:
    import tilefuse_cli

    return tilefuse_cli.main(argv)


def run(args) -> int:
    """Run a parsed command (see `tilefuse_cli.build_parser`); returns the exit code."""
    return {"cache": _cache, "ops": _ops, "fuzz": _fuzz, "explain": _explain}[args.command](args)


# ------------------------------------------------------------------------------ cache


def _cache(args) -> int:
    from .config import config
    from .cache import admin

    root = os.path.abspath(os.path.expanduser(config.cache_dir))
    problem = admin.root_problem(root)
    if args.action == "clear":
        removed = admin.clear_root(root) if problem is None else []
        kept = [i for i in admin.root_contents(root) if not i.owned or i.left]
        if args.json:
            print(json.dumps({"root": root, "refused": problem, "removed": [_item_json(i) for i in removed],
                              "left_alone": [_item_json(i) for i in kept]}, indent=1))
        elif problem is not None:
            print(f"not clearing {root}: {problem}, so what is in it may not be tilefuse's; remove what "
                  f"you know to be yours, then `chmod 700 {root}` (or set TILEFUSE_CACHE_DIR elsewhere)")
        else:
            _print_cleared(root, removed, kept)
        return 1 if problem is not None or any(i.errors for i in removed) else 0
    items = admin.root_contents(root)
    if args.json:
        print(json.dumps({"root": root, "exists": os.path.isdir(root), "problem": problem,
                          "directories": [_item_json(i) for i in items]}, indent=1))
        return 0
    _print_info(root, items, problem)
    return 0


def _item_json(item) -> dict:
    out = dataclasses.asdict(item)
    for k in ("oldest", "newest"):
        if out[k] is not None:
            out[k] = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(out[k]))
    return out


def _print_info(root: str, items: list, problem: str | None) -> None:
    if not os.path.isdir(root):
        print(f"cache directory {root}: does not exist yet (nothing cached)")
        return
    print(f"cache directory {root}" + (f"\n  not used: {problem}; run `chmod 700 {root}` or set "
                                       "TILEFUSE_CACHE_DIR to a private directory" if problem else ""))
    from .cache.admin import OWNED_FILES

    owned = [i for i in items if i.owned]
    rows = [(i.name + ("" if i.name in OWNED_FILES else "/"), i.what, str(i.entries), _human(i.bytes),
             _when(i.oldest), _when(i.newest))
            for i in owned]
    rows.append(("total", "", str(sum(i.entries for i in owned)), _human(sum(i.bytes for i in owned)), "", ""))
    print(_table(("directory", "holds", "entries", "size", "oldest", "newest"), rows, right=(2, 3)))
    for i in items:
        if not i.owned or i.left:
            print(f"not cleared: {i.name}{'/' if i.owned else ''} ({i.note})")


def _print_cleared(root: str, removed: list, kept: list) -> None:
    for i in removed:
        if i.entries or i.bytes or i.errors:
            print(f"removed {i.name}/: {i.entries} entr{'y' if i.entries == 1 else 'ies'}, {_human(i.bytes)}"
                  + (f" ({i.note})" if i.errors else ""))
    entries, size = sum(i.entries for i in removed), sum(i.bytes for i in removed)
    print(f"removed {entries} entr{'y' if entries == 1 else 'ies'} ({_human(size)}) from {root}")
    for i in kept:
        print(f"left alone: {i.name}{'/' if i.owned else ''} ({i.note})")


def _human(n: int) -> str:
    size, unit = float(n), "B"
    for larger in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, larger
    return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t is not None else ""


def _table(headers, rows, right=()) -> str:
    widths = [max(len(str(r[c])) for r in (headers, *rows)) for c in range(len(headers))]
    cell = lambda c, v: str(v).rjust(widths[c]) if c in right else str(v).ljust(widths[c])  # noqa: E731
    return "\n".join("  " + "  ".join(cell(c, v) for c, v in enumerate(r)).rstrip() for r in (headers, *rows))


# ------------------------------------------------------------------------------ ops, fuzz


def _ops(args) -> int:
    if args.sweep:
        return _sweep(args)
    from .frontend import to_ir  # noqa: F401  (registers the lowerings)
    from .frontend.registry import registered_ops

    ops = registered_ops()
    for op in ops:
        print(op)
    print(f"{len(ops)} ATen ops/overloads lowered to generated code; every other op runs as an ATen extern call",
          file=sys.stderr)
    return 0


def _unknown(kind: str, bad: list[str], known) -> str:
    from .config import closest_name

    known = list(known)
    hints = []
    for name in bad:
        close = closest_name(name, known)
        hints.append(f"{name!r}" + (f" (did you mean {close!r}?)" if close else ""))
    listing = ", ".join(known) if len(known) <= 20 else f"{len(known)} names; `tilefuse ops --sweep` runs them all"
    return f"unknown {kind} {', '.join(hints)}; choose from {listing}"


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[last]}"), transient=False)


def _sweep(args) -> int:
    """Run PyTorch's OpInfo samples through tilefuse and print the coverage."""
    from .check import op_sweep

    error = args.command_parser.error
    dtypes = tuple(d.strip() for d in (args.dtypes or ",".join(op_sweep.DTYPES)).split(",") if d.strip())
    bad = [d for d in dtypes if d not in op_sweep.DTYPES]
    if bad or not dtypes:
        error("--dtypes: " + (_unknown("dtype", bad, op_sweep.DTYPES) if bad else "no dtype given"))
    try:
        infos = op_sweep.load_op_db()
    except ImportError as err:
        print(f"tilefuse ops: error: --sweep needs PyTorch's test tools ({err}); pip install expecttest",
              file=sys.stderr)
        return 1
    if args.op:
        names = {op_sweep.op_name(i) for i in infos}
        bad = [o for o in args.op if o not in names]
        if bad:
            error("--op: " + _unknown("OpInfo name", bad, sorted(names)))
        infos = [i for i in infos if op_sweep.op_name(i) in set(args.op)]
    samples = args.samples or 2
    results = []

    def write_json(complete: bool) -> None:
        # rewritten after every op (atomically), so a stopped run leaves the results so far
        if not args.json:
            return
        tmp = f"{args.json}.tmp"
        with open(tmp, "w") as f:
            json.dump({"complete": complete, "total": len(infos) * len(dtypes),
                       "results": [dataclasses.asdict(r) for r in results]}, f, indent=1)
        os.replace(tmp, args.json)

    with _progress() as bar:
        task = bar.add_task("op_db sweep", total=len(infos) * len(dtypes), last="")
        for info in infos:
            for dtype in dtypes:
                r = op_sweep.check_op(info, dtype, samples)
                results.append(r)
                write_json(False)
                bar.update(task, advance=1, last=f"{r.op} {r.dtype}: {r.status}")
    write_json(True)
    print(op_sweep.format_coverage(results))
    failing = [r for r in results if r.status in ("mismatch", "error")]
    for r in sorted(failing, key=lambda r: (r.status, r.op)):
        print(f"{r.status:>9}  {r.op} [{r.dtype}]: {r.detail}")
    if args.json:
        print(f"results written to {args.json}")
    return 1 if failing else 0


def _fuzz(args) -> int:
    """Run the differential fuzzer; failing cases are shrunk and written as scripts."""
    from .check import fuzz

    with _progress() as bar:
        task = bar.add_task(f"fuzz (seed {args.seed})", total=args.cases, last="")

        def progress(k, outcome):
            bar.update(task, advance=1, last=f"case {k}: {outcome.status}")

        report = fuzz.run_fuzz(args.cases, seed=args.seed, max_ops=args.max_ops, out_dir=args.out,
                               shrink_failures=not args.no_shrink, progress=progress)
    print(report.summary())
    for f in report.failures:
        print(f"case {f.case}: {f.outcome.status}: {f.outcome.detail}")
        print("  shrunk to:\n" + "\n".join("    " + line for line in f.shrunk.function_source().splitlines()))
        if f.reproducer:
            print(f"  reproducer: {f.reproducer}")
    return 1 if report.failures else 0


# ------------------------------------------------------------------------------ explain


def _explain(args) -> int:
    """Run the script as `python SCRIPT ARGS...` would, then print what tilefuse compiled."""
    import tilefuse
    from .config import config

    if args.logs is not None:
        config.logs = args.logs
    for name, value in args.option:
        setattr(config, name, value)
    script = os.path.abspath(args.script)
    sys.argv = [args.script, *args.args]
    sys.path.insert(0, os.path.dirname(os.path.realpath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
    except BaseException as err:  # noqa: BLE001 - reported as python would, then the summary
        tb = err.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != script:  # skip runpy's frames
            tb = tb.tb_next
        traceback.print_exception(type(err), err, tb or err.__traceback__)
        code = 1
    sys.stdout.flush()
    explanation = tilefuse.last_compilations()
    print()
    if explanation.reports:
        print(explanation.format(verbose=args.verbose))
    else:
        print("tilefuse compiled nothing: the script must call torch.compile(..., backend=\"tilefuse\") "
              "or tilefuse.compile(...), and run the compiled function")
    if isinstance(code, str):  # sys.exit("message"), as python reports it
        print(code, file=sys.stderr)
        code = 1
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
