"""The README is executable: its Python snippets run, its test command is what CI runs, its
links resolve inside the repository, and the commands it lists exist."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src")
with open(os.path.join(ROOT, "README.md")) as _f:
    README = _f.read()

SNIPPETS = re.findall(r"```python\n(.*?)```", README, re.S)


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILEFUSE_")}
    env.update(PYTHONPATH=SRC, TILEFUSE_CACHE_DIR=str(tmp_path / "cache"))
    return env


def test_the_readme_has_snippets():
    assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("k", range(len(SNIPPETS)))
def test_python_snippet_runs(k, tmp_path):
    script = tmp_path / f"snippet{k}.py"
    script.write_text(SNIPPETS[k])
    out = subprocess.run([sys.executable, str(script)], env=_env(tmp_path), capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert out.returncode == 0, f"README snippet {k} failed:\n{SNIPPETS[k]}\n{out.stderr[-3000:]}"


def test_the_test_command_is_what_ci_runs():
    commands = re.findall(r"^pip install .*&& (python -m pytest [^\n]*)$", README, re.M)
    assert commands, "the README's test command is missing"
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    assert commands[0] in ci


def test_links_stay_inside_the_repository():
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README):
        if target.startswith(("http://", "https://")):
            continue
        assert not target.startswith(".."), f"{target} points outside the repository"
        assert os.path.exists(os.path.join(ROOT, target)), f"broken link: {target}"


def test_the_listed_commands_exist(tmp_path):
    commands = re.findall(r"^\| `tilefuse (\w+)", README, re.M)
    assert {"bench", "explain", "config", "cache", "ops", "fuzz"} <= set(commands)
    for command in commands:
        out = subprocess.run([sys.executable, "-c", "import sys, tilefuse_cli; sys.exit(tilefuse_cli.main(sys.argv[1:]))",
                              command, "--help"], env=_env(tmp_path), capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, (command, out.stderr[-2000:])
