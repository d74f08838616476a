"""A second process compiling the same graph builds no new kernel: every kernel is a cache hit."""
import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, torch, tilefuse
from tilefuse.backends.triton.launcher import kernel_cache as triton_cache
from tilefuse.backends.cpu.launcher import kernel_cache as cpu_cache
f = torch.compile(lambda x: torch.softmax(x * 2, -1) + 1, backend="tilefuse")
x = torch.randn(5, 11)
torch.testing.assert_close(f(x), torch.softmax(x * 2, -1) + 1)
caches = (triton_cache(), cpu_cache())  # the interpreter's or the C++ backend's kernels
print(json.dumps({"builds": sum(c.builds for c in caches), "hits": sum(c.hits for c in caches)}))
"""


def _run(cache_dir):
    env = dict(os.environ, TILEFUSE_CACHE_DIR=str(cache_dir), TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "..", "src"),
                                           os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_compiles_nothing_new(tmp_path):
    first = _run(tmp_path)
    second = _run(tmp_path)
    assert first["builds"] >= 1
    assert second["builds"] == 0 and second["hits"] == first["builds"]
