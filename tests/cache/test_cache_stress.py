"""The kernel cache under stress, through the whole compiler: two processes compiling the same
graph at once, a truncated or corrupted entry, a read-only cache and a full disk. Compilation
always succeeds with correct results; the cache warns and never serves bad data."""
import errno
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import tilefuse
from tilefuse.backends.triton import launcher
from tilefuse.cache import disk as cache_mod
from tilefuse.cache.disk import CacheWarning

SRC = str(Path(__file__).resolve().parents[2] / "src")

WORKER = r"""
import json, os, sys, time
ready, me = sys.argv[1], sys.argv[2]
import torch, tilefuse
from tilefuse.backends.triton.launcher import kernel_cache
open(os.path.join(ready, me), "w").close()
deadline = time.time() + 120
while len(os.listdir(ready)) < int(sys.argv[3]) and time.time() < deadline:  # start together
    time.sleep(0.002)
f = torch.compile(lambda x, w: torch.softmax(x @ w, -1) * 3 + x.sum(-1, keepdim=True), backend="tilefuse")
x, w = torch.randn(7, 9), torch.randn(9, 5)
torch.testing.assert_close(f(x, w), torch.softmax(x @ w, -1) * 3 + x.sum(-1, keepdim=True))
c = kernel_cache()
print(json.dumps({"builds": c.builds, "hits": c.hits, "misses": c.misses}))
"""


def _spawn(cache_dir: Path, ready: Path, me: str, n: int) -> subprocess.Popen:
    env = dict(os.environ, TILEFUSE_CACHE_DIR=str(cache_dir), TRITON_INTERPRET="1", TILEFUSE_FALLBACK="error",
               TILEFUSE_TARGET="interpret",
               PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", WORKER, str(ready), me, str(n)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _results(procs) -> list:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _entries(cache_dir: Path) -> list:
    ns = cache_dir / "triton"
    return [e for shard in ns.iterdir() if not shard.name.startswith(".") and shard.is_dir()
            for e in shard.iterdir() if e.is_dir() and not e.name.startswith(".")]


def test_two_processes_compile_the_same_graph_at_once(tmp_path):
    cache_dir, ready = tmp_path / "cache", tmp_path / "ready"
    ready.mkdir()
    first, second = _results([_spawn(cache_dir, ready, str(i), 2) for i in range(2)])
    kernels = len(_entries(cache_dir))
    assert kernels >= 2
    # every kernel built exactly once across both processes; the other process hit the cache
    assert first["builds"] + second["builds"] == kernels
    assert first["hits"] + second["hits"] == kernels
    # nothing half-written is left behind, and every entry verifies
    ns = cache_dir / "triton"
    assert not [p for p in ns.iterdir() if p.name.startswith((".tmp-", ".trash-"))]
    c = cache_mod.DiskCache("triton", root=cache_dir)
    assert all(c.get(e.name) is not None for e in _entries(cache_dir))
    # a third process finds everything
    (tmp_path / "ready3").mkdir()
    (third,) = _results([_spawn(cache_dir, tmp_path / "ready3", "0", 1)])
    assert third["builds"] == 0 and third["hits"] == kernels


# --------------------------------------------------------------------- in-process helpers


def fn(x):
    return torch.softmax(x * 2, -1) + x.mean(-1, keepdim=True)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """A private cache directory and a launcher that has imported nothing yet."""
    monkeypatch.setattr(tilefuse.config, "cache_dir", str(tmp_path / "cache"))
    monkeypatch.setattr(tilefuse.config, "target", "interpret")  # the Triton kernel cache
    monkeypatch.setattr(launcher, "_modules", {})
    monkeypatch.setattr(launcher, "_caches", {})
    cache_mod._warned.clear()
    torch._dynamo.reset()
    yield tmp_path / "cache"
    cache_mod._warned.clear()


def _compile_and_check():
    torch._dynamo.reset()
    x = torch.randn(5, 13)
    torch.testing.assert_close(torch.compile(fn, backend="tilefuse")(x), fn(x))
    return launcher.kernel_cache()


def _restart(monkeypatch):
    """What a new process would see: no imported kernel modules, fresh counters."""
    monkeypatch.setattr(launcher, "_modules", {})
    monkeypatch.setattr(launcher, "_caches", {})


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest", "delete"])
def test_corrupt_entry_is_detected_and_rebuilt(fresh_cache, monkeypatch, damage):
    built = _compile_and_check().builds
    assert built >= 1
    for entry in _entries(fresh_cache):
        kernel = entry / "kernel.py"
        data = kernel.read_bytes()
        if damage == "truncate":
            kernel.write_bytes(data[: len(data) // 2])
        elif damage == "flip":
            kernel.write_bytes(data.replace(b"tl.", b"tX.", 1))
        elif damage == "manifest":
            (entry / "manifest.json").write_text("{not json")
        else:
            kernel.unlink()
    _restart(monkeypatch)
    cache = _compile_and_check()  # correct results: the damaged source was never imported
    assert cache.builds == built and cache.hits == 0
    _restart(monkeypatch)
    assert _compile_and_check().builds == 0  # the rebuilt entries are valid


class _ReadOnly:
    """Stands for a module inside the cache module only: its write entry points fail as on a
    read-only file system (EROFS), whoever runs the test (chmod does not stop root)."""

    def __init__(self, module, names):
        self._module, self._names = module, names

    def __getattr__(self, name):
        if name in self._names:
            def read_only(*args, **kwargs):
                raise OSError(errno.EROFS, "Read-only file system", str(args[0]) if args else "")
            return read_only
        return getattr(self._module, name)


def test_read_only_cache_directory_compiles_with_a_warning(fresh_cache, monkeypatch):
    fresh_cache.mkdir(mode=0o700)
    read_only = _ReadOnly(os, {"makedirs", "open", "mkdir", "replace", "rename"})
    monkeypatch.setattr(cache_mod, "os", read_only)
    monkeypatch.setattr(cache_mod.trust, "os", read_only)  # directories are made private there
    monkeypatch.setattr(cache_mod, "tempfile", _ReadOnly(cache_mod.tempfile, {"mkdtemp"}))
    with pytest.warns(CacheWarning, match="Read-only file system"):
        cache = _compile_and_check()
    assert cache.builds >= 1
    monkeypatch.undo()
    assert not fresh_cache.joinpath("triton").exists()


def test_full_disk_compiles_with_a_warning(fresh_cache, monkeypatch):
    """The disk fills up in the middle of an entry (its source is written, its manifest is
    not): nothing half-written is published or left behind."""
    real_write = cache_mod._write_file
    calls = []

    def full(path, data):
        calls.append(path)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, data)

    monkeypatch.setattr(cache_mod, "_write_file", full)
    with pytest.warns(CacheWarning, match="No space left"):
        cache = _compile_and_check()
    assert cache.builds >= 1 and len(calls) >= 2
    ns = fresh_cache / "triton"
    assert not [p for p in ns.iterdir() if p.name.startswith(".tmp-")]
    assert not _entries(fresh_cache)
    monkeypatch.setattr(cache_mod, "_write_file", real_write)
    _restart(monkeypatch)
    assert _compile_and_check().builds == cache.builds  # space again: built and stored
    _restart(monkeypatch)
    assert _compile_and_check().builds == 0


def test_warning_is_issued_once_per_cache(fresh_cache, monkeypatch):
    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(cache_mod, "_write_file", full)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compile_and_check()
        _restart(monkeypatch)
        _compile_and_check()
    assert len([w for w in caught if issubclass(w.category, CacheWarning)]) == 1
