"""The `tilefuse` command as a user meets it: fast help, version and argument errors (torch not
imported), exit code 2 naming every bad argument, `config`, `cache info|clear` after a real
compile, `explain SCRIPT ARGS...`.

Commands run in a subprocess through the console script's module (`tilefuse_cli.main`), with
this checkout's `src` first on PYTHONPATH; checks that need torch anyway run in this process.
Speed is checked by what was imported, never by wall time.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tilefuse
import tilefuse_cli
from tilefuse.config import KNOBS, knob_table
from tilefuse.cache import disk as cache

SRC = Path(__file__).resolve().parents[1] / "src"
_RUN = """
import sys, tilefuse_cli
try:
    code = tilefuse_cli.main(sys.argv[1:])
except SystemExit as e:
    code = e.code
sys.stdout.flush()
print("IMPORTED", *sorted(m for m in ("torch", "triton", "tilefuse") if m in sys.modules), file=sys.stderr)
sys.exit(code)
"""


class Run:
    def __init__(self, proc: subprocess.CompletedProcess):
        self.code = proc.returncode
        self.out = proc.stdout
        *err, marker = proc.stderr.rstrip("\n").split("\n") or [""]
        self.err = "\n".join(err)
        self.imported = marker.split()[1:] if marker.startswith("IMPORTED") else None


def tilefuse_cmd(*argv: str, env: dict | None = None, cwd=None, timeout: float = 300) -> Run:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TILEFUSE_") or k in
               ("TILEFUSE_CACHE_DIR", "TILEFUSE_FALLBACK", "TILEFUSE_AUTOTUNE")}
    environ["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])
    environ.update(env or {})
    proc = subprocess.run([sys.executable, "-c", _RUN, *argv], env=environ, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)
    return Run(proc)


# ------------------------------------------------------------------------------ fast paths


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["--version", "--verbose"], ["version"],
                                  ["config"], ["config", "--markdown"], ["explain", "--help"],
                                  ["cache", "--help"], ["ops", "--help"], ["fuzz", "--help"]],
                         ids=" ".join)
def test_help_version_and_config_do_not_import_torch(argv):
    r = tilefuse_cmd(*argv)
    assert r.code == 0, r.err
    assert r.imported == [], f"{argv} imported {r.imported}"
    assert r.out.strip()


def test_version_is_the_package_version():
    assert tilefuse_cmd("--version").out == f"tilefuse {tilefuse.__version__}\n"
    verbose = tilefuse_cmd("--version", "--verbose").out
    for word in ("torch ", "triton ", "Python ", "C++ compiler"):
        assert word in verbose


def test_version_from_a_source_tree_without_metadata(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert tilefuse_cli.version() == tilefuse.__version__


def test_the_cxx_shown_is_the_one_the_cpu_backend_uses():
    from tilefuse.backends.cpu import toolchain

    assert tilefuse_cli.find_cxx() == toolchain.find_compiler()


def test_console_script_points_at_the_entry_module():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((SRC.parent / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["tilefuse"] == "tilefuse_cli:main"
    assert "tilefuse_cli" in project["tool"]["setuptools"]["py-modules"]


# ------------------------------------------------------------------------------ bad arguments


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "noop.py"
    path.write_text("print('ran')\n")
    return str(path)


@pytest.mark.parametrize("argv, named", [
    (["nonsense"], "'nonsense'"),
    (["cache", "wipe"], "'wipe'"),
    (["ops", "--sweep", "--samples", "0"], "'0'"),
    (["ops", "--op", "add"], "--op applies only with --sweep"),
    (["fuzz", "--max-ops", "-3"], "'-3'"),
    (["fuzz", "--seed", "x"], "'x'"),
    (["explain", "--option", "autotun=0", "SCRIPT"], "did you mean 'autotune'"),
    (["explain", "--option", "autotune=7", "SCRIPT"], "autotune='7'"),
    (["explain", "--option", "autotune", "SCRIPT"], "NAME=VALUE"),
    (["explain", "--logs", "fusin", "SCRIPT"], "'fusin'"),
    (["explain", "MISSING", "a"], "missing.py"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_arguments_exit_2_naming_the_value_before_importing_torch(argv, named, script, tmp_path):
    argv = [{"SCRIPT": script, "MISSING": str(tmp_path / "missing.py")}.get(a, a) for a in argv]
    r = tilefuse_cmd(*argv)
    assert r.code == 2 and named in r.err, r.err
    assert "Traceback" not in r.err
    assert r.imported == []


def test_a_missing_script_is_one_line():
    r = tilefuse_cmd("explain", "no_such_script.py")
    assert r.code == 2 and r.err == "tilefuse: error: explain: script 'no_such_script.py' cannot be read: " \
                                    "No such file or directory"


@pytest.mark.parametrize("argv, named", [
    (["ops", "--sweep", "--op", "nonexistent"], "'nonexistent'"),
    (["ops", "--sweep", "--op", "softmx"], "did you mean 'softmax'"),
    (["ops", "--sweep", "--dtypes", "float32,banana"], "'banana'"),
    (["bench", "--backends", "banana"], "'banana'"),
    (["bench", "--workloads", "nope"], "'nope'"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_names_checked_against_their_registries(argv, named, capsys):
    """These need torch (op_db, Dynamo's backends): checked in process, before any work."""
    with pytest.raises(SystemExit) as e:
        tilefuse_cli.main(argv)
    assert e.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.parametrize("command", [["config"], ["cache", "info"]])
def test_a_bad_environment_variable_exits_2_naming_it(command):
    r = tilefuse_cmd(*command, env={"TILEFUSE_VERIFY": "banana"})
    assert r.code == 2 and "TILEFUSE_VERIFY" in r.err and "banana" in r.err, r.err
    assert "Traceback" not in r.err and r.imported == []


# ------------------------------------------------------------------------------ config


def test_config_lists_every_knob():
    r = tilefuse_cmd("config", env={"TILEFUSE_AUTOTUNE": "max", "TILEFUSE_AUTOTUNEE": "1"})
    assert r.code == 0
    for k in KNOBS.values():
        assert re.search(rf"^{k.name} = ", r.out, re.M) and k.env in r.out and k.allowed() in r.out
    assert "autotune = 'max'  (from TILEFUSE_AUTOTUNE)" in r.out
    assert "did you mean 'TILEFUSE_AUTOTUNE'" in r.err  # an unknown variable is reported


def test_config_markdown_is_the_knob_table():
    assert tilefuse_cmd("config", "--markdown").out == knob_table() + "\n"


# ------------------------------------------------------------------------------ explain, cache

_SCRIPT = """
import json, sys, torch
import helper  # next to the script: its directory is first on sys.path, as with `python script.py`
json.dump({"argv": sys.argv, "name": __name__}, open(sys.argv[1], "w"))
f = torch.compile(lambda x: torch.softmax(x * 2, -1), backend="tilefuse")
helper.check(f(torch.randn(4, 8)))
"""


@pytest.fixture(scope="module")
def explained(tmp_path_factory):
    """`tilefuse explain` of a script that records its argv and compiles one function with the
    C++ backend, into a private cache directory."""
    tmp = tmp_path_factory.mktemp("explain")
    (tmp / "scripts").mkdir()
    script = tmp / "scripts" / "compile_one.py"
    script.write_text(_SCRIPT)
    (tmp / "scripts" / "helper.py").write_text("def check(t):\n    assert t.shape == (4, 8)\n")
    env = {"TILEFUSE_CACHE_DIR": str(tmp / "cache"), "TILEFUSE_TARGET": "cpu"}
    r = tilefuse_cmd("explain", "--option", "autotune=0", str(script), str(tmp / "argv.json"), "--",
                     "--verbose", "x", env=env, cwd=tmp)
    return r, tmp, script, env


def test_explain_passes_the_command_line_to_the_script(explained):
    r, tmp, script, _ = explained
    assert r.code == 0, r.err
    seen = json.loads((tmp / "argv.json").read_text())
    assert seen == {"argv": [str(script), str(tmp / "argv.json"), "--", "--verbose", "x"], "name": "__main__"}
    assert "1 graph(s), 1 kernel(s)" in r.out and "target cpu" in r.out


def test_explain_returns_the_scripts_exit_code_and_shows_its_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nsys.exit(3)\n")
    assert tilefuse_cli.main(["explain", str(exits)]) == 3
    fails = tmp_path / "fails.py"
    fails.write_text("def f():\n    raise ValueError('from the script')\nf()\n")
    assert tilefuse_cli.main(["explain", str(fails)]) == 1
    err = capsys.readouterr().err
    assert "ValueError: from the script" in err and "runpy" not in err and str(fails) in err


def _plant(root: Path, outside: Path) -> None:
    """What other tilefuse versions and stages leave under the root, and what is not ours."""
    (root / "repro").mkdir()
    (root / "repro" / "repro_graph_1.py").write_text("print()\n")
    triton_entry = root / "triton-bin" / ("A" * 52)  # a directory of Triton's own cache
    triton_entry.mkdir(parents=True)
    (triton_entry / "k.so").write_bytes(b"\0" * 100)
    (triton_entry / "__grp__k.json").write_text("{}")
    (root / "triton-bin" / "notes").write_text("a user's file")
    for ns in ("tune-ceilings", "triton-v0"):  # a namespace under a name this version does not use
        key = "ab" + "0" * 62
        (root / ns / "ab" / key).mkdir(parents=True)
        (root / ns / "ab" / key / "manifest.json").write_text(json.dumps({"format": 0, "key": key}))
        (root / ns / "ab" / (key + ".lock")).write_text("")
    (root / ".trash-cpu-1-abcd" / "x").mkdir(parents=True)
    (root / "cpu" / "mine.txt").write_text("a user's file in a namespace")
    (root / "mine").mkdir()
    (root / "notes.txt").write_text("mine too")
    outside.mkdir()
    (outside / "precious").write_text("keep")
    (root / "tune").symlink_to(outside, target_is_directory=True)
    (root / "repro" / "link").symlink_to(outside, target_is_directory=True)


def test_cache_info_and_clear_cover_everything_tilefuse_owns(explained):
    _, tmp, _, env = explained
    root = tmp / "cache"
    assert list((root / "cpu").glob("*/*/manifest.json")), "the compile wrote no C++ kernel"
    _plant(root, tmp / "outside")

    info = tilefuse_cmd("cache", "info", env=env)
    assert info.code == 0, info.err
    assert str(root) in info.out
    for name in ("cpu/", "repro/", "triton-bin/", "tune-ceilings/", "triton-v0/", ".trash-cpu-1-abcd/"):
        assert re.search(rf"^  {re.escape(name)} ", info.out, re.M), (name, info.out)
    assert "generated C++ kernels" in info.out and "KiB" in info.out
    assert "not cleared: mine" in info.out and "not cleared: tune (a symbolic link" in info.out
    assert "not cleared: cpu/ (1 thing in it not tilefuse's" in info.out

    data = json.loads(tilefuse_cmd("cache", "info", "--json", env=env).out)
    owned = {d["name"]: d for d in data["directories"] if d["owned"]}
    assert set(owned) == {"cpu", "repro", "triton-bin", "tune-ceilings", "triton-v0", ".trash-cpu-1-abcd",
                          ".size-checked", "graphs", "front"}
    expected = sum(d["entries"] for d in owned.values())
    size = sum(d["bytes"] for d in owned.values())
    assert owned["cpu"]["entries"] >= 1 and owned["repro"]["entries"] == 1 and expected >= 5
    assert (owned["repro"]["left"], owned["triton-bin"]["left"], owned["cpu"]["left"]) == (1, 1, 1)

    cleared = tilefuse_cmd("cache", "clear", env=env)
    assert cleared.code == 0, cleared.err
    assert f"removed {expected} entries" in cleared.out
    assert f"removed cpu/: {owned['cpu']['entries']} entr" in cleared.out
    assert "removed triton-bin/: 1 entry, 1" in cleared.out  # Triton's entry, not the user's notes
    assert sorted(p.name for p in root.iterdir()) == ["cpu", "mine", "notes.txt", "repro", "triton-bin", "tune"]
    assert [p.name for p in (root / "cpu").iterdir()] == ["mine.txt"]  # the user's file, nothing else
    assert [p.name for p in (root / "triton-bin").iterdir()] == ["notes"]
    assert [p.name for p in (root / "repro").iterdir()] == ["link"]
    assert (tmp / "outside" / "precious").read_text() == "keep"  # never followed out of the root
    assert "left alone: tune" in cleared.out and "left alone: cpu/" in cleared.out
    assert size > 0
    again = tilefuse_cmd("cache", "clear", env=env)
    assert "removed 0 entries" in again.out


def test_cache_info_creates_nothing(tmp_path):
    root = tmp_path / "never"
    assert cache.root_contents(root) == [] and cache.clear_root(root) == []
    r = tilefuse_cmd("cache", "info", env={"TILEFUSE_CACHE_DIR": str(root)})
    assert r.code == 0 and "does not exist yet" in r.out and not root.exists()


def test_every_cache_namespace_is_known_to_clear():
    """A namespace added without an OWNED_DIRS line would still be cleared (by its layout), but
    shown without saying what it holds."""
    from tilefuse.tune.cache import NAMESPACE

    used = {NAMESPACE}
    for path in SRC.joinpath("tilefuse").rglob("*.py"):
        used |= set(re.findall(r'DiskCache\("([\w.-]+)"', path.read_text()))
    assert used <= set(cache.NAMESPACES) and set(cache.NAMESPACES) <= set(cache.OWNED_DIRS)


def test_python_m_runs_the_same_command():
    environ = {**os.environ, "PYTHONPATH": str(SRC)}
    for module in ("tilefuse.cli", "tilefuse"):
        proc = subprocess.run([sys.executable, "-m", module, "--version"], env=environ, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0 and proc.stdout == f"tilefuse {tilefuse.__version__}\n", proc.stderr
