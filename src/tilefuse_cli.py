"""The `tilefuse` console script: parses the command line without importing tilefuse.

Importing the `tilefuse` package imports torch and registers the torch.compile backend: seconds
on a cold machine. This module owns what must not wait for that: the argument parser of every
command, `--help`, `--version`, the checks of arguments that need no registry, and
`tilefuse config` (the knob registry, `tilefuse/config.py`, is loaded by path: it imports only
the standard library and `tilefuse/errors.py`). Only then does it import `tilefuse.cli`, which
runs the command.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import sys
import textwrap
import types
import warnings
from pathlib import Path
from typing import NoReturn

PROG = "tilefuse"
_STANDALONE = "tilefuse_standalone"  # the package's directory, without running its __init__
_CONFIG_MODULE = _STANDALONE + ".config"


# ------------------------------------------------------------------------------ the package


def package_dir() -> Path:
    """The `tilefuse` package's directory, found without executing its `__init__`."""
    spec = importlib.util.find_spec("tilefuse")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{PROG}: error: the tilefuse package is not importable")
    return Path(next(iter(spec.submodule_search_locations)))


def version() -> str:
    """The installed distribution's version, else `__version__` of the package's source
    (`tilefuse/_version.py`)."""
    from importlib.metadata import PackageNotFoundError, version as dist_version

    try:
        return dist_version("tilefuse")
    except PackageNotFoundError:
        pass
    text = (package_dir() / "_version.py").read_text(encoding="utf-8")
    found = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", text, re.M)
    return found.group(1) if found else "unknown"


def load_config(show_warnings: bool = False):
    """`tilefuse/config.py` as a standalone module: the registry and the environment's values
    (a bad `TILEFUSE_*` value raises its `ConfigError` here, naming the variable). It is loaded
    as a module of a stand-in package over the same directory, whose `__init__` never runs, so
    that its import of `.errors` finds `tilefuse/errors.py` (standard library only) by path."""
    if _CONFIG_MODULE in sys.modules:
        return sys.modules[_CONFIG_MODULE]
    if _STANDALONE not in sys.modules:
        package = types.ModuleType(_STANDALONE)
        package.__path__ = [str(package_dir())]
        sys.modules[_STANDALONE] = package
    spec = importlib.util.spec_from_file_location(_CONFIG_MODULE, package_dir() / "config.py")
    if spec is None or spec.loader is None:
        raise SystemExit(f"{PROG}: error: cannot load {package_dir() / 'config.py'}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[_CONFIG_MODULE] = module  # dataclasses look their module up while it runs
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_CONFIG_MODULE]
        raise
    if show_warnings:
        for w in caught:
            print(f"{PROG}: warning: {w.message}", file=sys.stderr)
    return module


def find_cxx() -> str | None:
    """The C++ compiler the CPU backend would use (the search of backends/cpu/toolchain.py)."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx) or (cxx if os.path.isfile(cxx) else None)
    return next(filter(None, (shutil.which(n) for n in ("c++", "g++", "clang++"))), None)


# ------------------------------------------------------------------------------ the parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name.strip(), value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="tilefuse: a PyTorch compiler with semantic fusion.",
        epilog=f"`{PROG} COMMAND --help` describes a command.")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    p.add_argument("-v", "--verbose", action="store_true", dest="version_verbose",
                   help="with --version: also the torch, Triton and Python versions and the C++ compiler")
    sub = p.add_subparsers(dest="command")

    def command(name: str, help: str, **kw) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, help=help, description=help, **kw)
        parser.set_defaults(command_parser=parser)
        return parser

    # parsed by the benchmark itself (main() hands it the rest of the command line)
    command("bench", "run the benchmark: workloads x backends (`tilefuse bench --help` lists its options)",
            add_help=False)

    e = command("explain", "run a Python script as `python SCRIPT ARGS...` would, then print what "
                           "tilefuse compiled (graphs, kernels, fusion, externs)")
    e.add_argument("--logs", metavar="CHANNELS", help="also log these compiler stages while the script runs "
                                                      "(comma-separated, e.g. fusion,code; or all)")
    e.add_argument("-o", "--option", action="append", type=_setting, default=[], metavar="NAME=VALUE",
                   help="set a knob for the run (repeatable; `tilefuse config` lists them)")
    e.add_argument("--verbose", action="store_true", help="also print each graph's IR, fusion decisions "
                                                          "and kernel sources")
    e.add_argument("script", help="the Python script to run")
    e.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")

    c = command("cache", "show or clear what tilefuse keeps on disk (kernels, tuning results, ...)")
    c.add_argument("action", choices=["info", "clear"])
    c.add_argument("--json", action="store_true", help="machine-readable output")

    o = command("ops", "list the ATen ops tilefuse generates code for; --sweep runs PyTorch's OpInfo "
                       "samples through tilefuse and prints the coverage")
    o.add_argument("--sweep", action="store_true", help="run the op_db sweep (needs the expecttest package)")
    o.add_argument("--dtypes", help="with --sweep: comma-separated (default: float32,bfloat16,int64)")
    o.add_argument("--samples", type=_positive_int, help="with --sweep: samples per op and dtype (default: 2)")
    o.add_argument("--op", action="append", help="with --sweep: only this OpInfo name (repeatable)")
    o.add_argument("--json", metavar="FILE", help="with --sweep: write every result to this file")

    z = command("fuzz", "differential fuzzing: random programs compiled and compared with eager")
    z.add_argument("--cases", type=_positive_int, default=100, help="programs to try (default: %(default)s)")
    z.add_argument("--seed", type=_int, default=0, help="(default: %(default)s)")
    z.add_argument("--max-ops", type=_positive_int, default=6, help="statements per program (default: %(default)s)")
    z.add_argument("--out", default="tilefuse-fuzz", metavar="DIR",
                   help="where reproducers are written (default: %(default)s)")
    z.add_argument("--no-shrink", action="store_true", help="do not shrink failing cases")

    k = command("config", "list every knob: environment variable, allowed values, default, current value")
    k.add_argument("--markdown", action="store_true", help="the Markdown table of the README")

    command("version", "print the versions of tilefuse, torch, Triton and Python, and the C++ compiler")
    return p


# ------------------------------------------------------------------------------ running


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if argv[:1] == ["bench"]:  # the benchmark parses its own options
        _check_environment()
        from tilefuse.bench import main as bench_main

        return bench_main(argv[1:]) or 0
    args = parser.parse_args(argv)
    if args.version or args.command == "version":
        print(_version_text(verbose=args.version_verbose or args.command == "version"))
        return 0
    if args.command is None:
        parser.error("a command is required")
    if args.command == "config":
        return _config(args)
    _check_environment()
    _check_arguments(args, argv)
    import tilefuse.cli

    return tilefuse.cli.run(args)


def _quiet_broken_pipe(run):
    """`tilefuse config | head`: a closed pipe ends the output, not in a traceback."""
    def wrapped(*args, **kw):
        try:
            return run(*args, **kw)
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
    return wrapped


def _fail(message: str) -> NoReturn:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _check_environment() -> None:
    """A bad `TILEFUSE_*` value: exit 2 naming it, before the package (and torch) is imported."""
    try:
        load_config()
    except ValueError as err:  # ConfigError
        _fail(str(err))


def _check_arguments(args, argv: list[str]) -> None:
    """Checks that need no registry (`tilefuse.cli` checks op names and dtypes)."""
    error = args.command_parser.error
    if args.command == "ops" and not args.sweep:
        given = [f"--{n}" for n in ("dtypes", "samples", "op", "json") if getattr(args, n)]
        if given:
            error(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} only with --sweep")
    if args.command == "ops" and args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        if os.path.isdir(args.json) or not os.path.isdir(folder):
            error(f"--json {args.json!r}: not a file in an existing directory")
    if args.command == "fuzz" and os.path.exists(args.out) and not os.path.isdir(args.out):
        error(f"--out {args.out!r} exists and is not a directory")
    if args.command == "explain":
        args.args = _script_args(argv, args)
        _check_script(args.script)
        config = load_config()
        try:
            if args.logs is not None:
                config.knob("logs").parse(args.logs, "--logs")
            for name, value in args.option:
                config.knob(name).parse(value, f"--option {name}")
        except (ValueError, TypeError) as err:  # ConfigError, UnknownOptionError
            error(str(err))


def _script_args(argv: list[str], args) -> list[str]:
    """The script's arguments: argparse drops a `--` right after the script, `python` does not."""
    n = len(args.args)
    if len(argv) >= n + 2 and argv[-n - 1] == "--" and argv[-n - 2] == args.script:
        return ["--", *args.args]
    return args.args


def _check_script(script: str) -> None:
    """A script that cannot be run: one line, exit 2 (as `python` does, without a traceback)."""
    why = "is a directory, not a Python script" if os.path.isdir(script) else None
    if why is None:
        try:
            with open(script, "rb"):
                pass
        except OSError as err:
            why = f"cannot be read: {err.strerror or err}"
    if why:
        _fail(f"explain: script {script!r} {why}")


def _version_text(verbose: bool) -> str:
    lines = [f"{PROG} {version()}"]
    if verbose:
        from importlib.metadata import PackageNotFoundError, version as dist_version

        for name in ("torch", "triton"):
            try:
                lines.append(f"{name} {dist_version(name)}")
            except PackageNotFoundError:
                lines.append(f"{name}: not installed")
        lines.append(f"Python {sys.version.split()[0]} ({sys.executable})")
        cxx = find_cxx()
        lines.append(f"C++ compiler: {cxx or 'none found (set CXX, or install g++ or clang++)'}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ tilefuse config


@_quiet_broken_pipe
def _config(args) -> int:
    try:
        config_mod = load_config(show_warnings=True)
    except ValueError as err:  # ConfigError
        _fail(str(err))
    if args.markdown:
        print(config_mod.knob_table())
        return 0
    rows = []
    for k in config_mod.KNOBS.values():
        env = k.env + "".join(f" (also TILEFUSE_{a.upper()})" for a in k.aliases)
        rows.append((k.name, env, f"{k.type.__name__}: {k.allowed()}", repr(k.default),
                     repr(getattr(config_mod.config, k.name)), config_mod.config.source_of(k.name), k.doc))
    if sys.stdout.isatty():
        _config_table(rows)
    else:
        for name, env, allowed, default, value, source, doc in rows:
            print(f"{name} = {value}  ({'default' if source == 'default' else 'from ' + source})")
            print(f"    {env} · {allowed} · default {default}")
            print(textwrap.fill(doc, 100, initial_indent="    ", subsequent_indent="    "))
    return 0


def _config_table(rows) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="tilefuse knobs: set one with its environment variable, or tilefuse.config.NAME = VALUE",
                  show_lines=True, expand=True)
    table.add_column("knob", overflow="fold")
    table.add_column("value", overflow="fold")
    table.add_column("what it does", ratio=1)
    for name, env, allowed, default, value, source, doc in rows:
        origin = "default" if source == "default" else f"from {source}\ndefault {default}"
        table.add_row(f"[bold]{name}[/]\n[dim]{env}[/]", f"{value}\n[dim]{origin}[/]",
                      f"{doc}\n[dim]{allowed}[/]")
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main())
