"""The public API is typed (the package ships `py.typed`): mypy finds no error in the modules a
user imports from — the API, the config registry, the errors, the explanation, the CLI's entry."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PUBLIC = ["src/tilefuse/__init__.py", "src/tilefuse/api.py", "src/tilefuse/config.py", "src/tilefuse/errors.py",
          "src/tilefuse/explanation.py", "src/tilefuse_cli.py"]


def test_the_package_says_it_is_typed():
    assert os.path.exists(os.path.join(ROOT, "src", "tilefuse", "py.typed"))


def test_mypy_finds_no_error_in_the_public_modules(tmp_path):
    pytest.importorskip("mypy")
    out = subprocess.run([sys.executable, "-m", "mypy", "--ignore-missing-imports", "--follow-imports=silent",
                          f"--cache-dir={tmp_path}", *PUBLIC], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
