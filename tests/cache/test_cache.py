"""Tests for the on-disk artifact cache (tilefuse.cache.disk)."""
from __future__ import annotations

import ast
import errno
import json
import os
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tilefuse.cache import disk as cache_mod
from tilefuse.cache.disk import CacheWarning, DiskCache, cache_key, environment_fingerprint

SRC = Path(__file__).resolve().parents[2] / "src"
FILES = {"kernel.py": b"def kernel():\n    return 42\n", "kernel.so": bytes(range(256)) * 8, "meta.json": b"{}"}


@pytest.fixture(autouse=True)
def _fresh_warning_registry():
    cache_mod._warned.clear()
    yield
    cache_mod._warned.clear()


@pytest.fixture
def cache(tmp_path) -> DiskCache:
    return DiskCache("test", root=tmp_path / "cache")


def _entry(c: DiskCache, key: str) -> Path:
    return c.root / c.namespace / key[:2] / key


def _subprocess_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


# ------------------------------------------------------------------------------------ keys


def test_key_is_sha256_hex_and_stable_under_dict_order():
    k = cache_key("src", 1, {"a": 1, "b": [1, 2]})
    assert len(k) == 64 and int(k, 16) >= 0
    assert k == cache_key("src", 1, {"b": [1, 2], "a": 1})
    assert cache_key((1, 2)) == cache_key([1, 2])


def test_key_golden_value():
    # The encoding is part of the on-disk format: changing it silently orphans every entry.
    assert cache_key("a", 1, 2.5, None, True, {"k": ("x",)}) == cache_key(
        "a", 1, 2.5, None, True, {"k": ["x"]}
    )
    import hashlib

    expected = hashlib.sha256(b'["a",1,2.5,null,true,{"\\"k\\"":["x"]}]').hexdigest()
    assert cache_key("a", 1, 2.5, None, True, {"k": ("x",)}) == expected


@pytest.mark.parametrize(
    "a,b",
    [
        (("x",), ("y",)),
        ((1,), (1.0,)),
        ((1,), ("1",)),
        ((True,), (1,)),
        ((None,), ("None",)),
        (("a", "b"), ("b", "a")),
        (("ab",), ("a", "b")),
        (([["a"], "b"],), (["a", ["b"]],)),
        (({"a": 1},), ({"a": 2},)),
        (({1: "x"},), ({"1": "x"},)),
        ((b"abc",), (b"abd",)),
        ((2.0**-60,), (0.0,)),
        ((Path("p"),), ("q",)),
    ],
)
def test_key_sensitivity(a, b):
    assert cache_key(*a) != cache_key(*b)


def test_key_other_objects_use_str_and_type():
    class Dt:
        def __str__(self):
            return "torch.float32"

    assert cache_key(Dt()) == cache_key(Dt())
    assert cache_key(Dt()) != cache_key("torch.float32")


def test_key_stable_across_processes_and_hash_seeds():
    expr = 'cache_key({"b", "a", "c"}, {"z": 1, "y": frozenset({"q", "r"})}, "s")'
    script = f"from tilefuse.cache.disk import cache_key; print({expr})"
    outs = {
        subprocess.run(
            [sys.executable, "-c", script], env=_subprocess_env(PYTHONHASHSEED=seed),
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {eval(expr, {"cache_key": cache_key})}


@settings(max_examples=30, deadline=None)
@given(st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.text(max_size=5)), max_size=6))
def test_key_ignores_dict_insertion_order(d):
    assert cache_key(d) == cache_key(dict(reversed(list(d.items()))))


def test_environment_fingerprint():
    fp = environment_fingerprint()
    for field in ("tilefuse", "torch", "triton", "python"):
        assert isinstance(fp[field], str) and fp[field]
    import platform

    import torch

    assert fp["torch"] == str(torch.__version__)
    assert fp["python"] == platform.python_version()
    if torch.cuda.is_available():
        assert "cuda_device" in fp and "cuda_capability" in fp
    else:
        assert "cuda_device" not in fp
    assert fp == environment_fingerprint()
    assert cache_key("src", fp) != cache_key("src", {**fp, "torch": "0.0"})


def test_no_torch_or_triton_import_at_module_level():
    tree = ast.parse(Path(cache_mod.__file__).read_text())
    top = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            top += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            top.append(node.module or "")
    assert not [m for m in top if m.split(".")[0] in ("torch", "triton")], top


# ------------------------------------------------------------------------------ round trip


def test_round_trip_and_layout(cache):
    key = cache_key("round trip")
    assert cache.get(key) is None and cache.misses == 1
    assert cache.put(key, FILES) is True
    assert cache.get(key) == FILES and cache.hits == 1
    entry = _entry(cache, key)
    assert entry.is_dir()
    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["format"] == cache_mod.FORMAT_VERSION
    assert manifest["files"]["kernel.so"]["size"] == len(FILES["kernel.so"])
    assert cache.path_of(key) == entry
    assert (cache.path_of(key) / "kernel.py").read_bytes() == FILES["kernel.py"]
    assert cache.path_of(cache_key("absent")) is None
    # only plain files: the entry holds exactly the named files and the manifest
    assert sorted(p.name for p in entry.iterdir()) == sorted([*FILES, "manifest.json"])
    # no temporary directories left behind
    assert not [p for p in (cache.root / "test").iterdir() if p.name.startswith(".")]


def test_root_created_private(tmp_path):
    c = DiskCache("ns", root=tmp_path / "a" / "b")
    assert stat.S_IMODE(os.stat(c.root).st_mode) == 0o700
    assert c.readable and c.writable


def test_root_defaults_to_config(tmp_path):
    from tilefuse.config import config

    with config.patch(cache_dir=str(tmp_path / "cfg")):
        c = DiskCache("ns")
    assert c.root == tmp_path / "cfg"


def test_get_or_create_builds_once_then_hits(cache):
    calls = []

    def build():
        calls.append(1)
        return dict(FILES)

    key = cache_key("goc")
    assert cache.get_or_create(key, build) == FILES
    assert cache.get_or_create(key, build) == FILES
    assert len(calls) == 1 and cache.builds == 1 and cache.hits == 1 and cache.misses == 1
    # a fresh instance (a new process) sees the entry
    other = DiskCache("test", root=cache.root)
    assert other.get_or_create(key, build) == FILES and other.builds == 0


def test_put_keeps_existing_valid_entry(cache):
    key = cache_key("first wins")
    assert cache.put(key, {"a.txt": b"first"})
    assert cache.put(key, {"a.txt": b"second"})
    assert cache.get(key) == {"a.txt": b"first"}


def test_put_keeps_entry_published_concurrently(cache, monkeypatch):
    # Another process publishes between our existence check and our rename.
    key = cache_key("race")
    real_replace = os.replace
    raced = []

    def racing_replace(src, dst):
        if Path(dst) == _entry(cache, key) and not raced:
            raced.append(1)
            assert DiskCache("test", root=cache.root).put(key, {"a.txt": b"theirs"})
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", racing_replace)
    assert cache.put(key, {"a.txt": b"ours"}) is True
    assert raced and cache.get(key) == {"a.txt": b"theirs"}
    assert not [p for p in (cache.root / "test").iterdir() if p.name.startswith(".tmp")]


def test_invalid_names_and_values_are_rejected(cache):
    key = cache_key("bad")
    for bad in ({"../x": b""}, {"a/b": b""}, {".hidden": b""}, {"manifest.json": b""}):
        with pytest.raises(ValueError):
            cache.put(key, bad)
    with pytest.raises(TypeError):
        cache.put(key, {"a.py": "text, not bytes"})
    with pytest.raises(ValueError):
        cache.get("../../etc")
    with pytest.raises(ValueError):
        DiskCache("../up", root=cache.root)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.dictionaries(
        st.from_regex(r"[a-z0-9_][a-z0-9._-]{0,10}", fullmatch=True).filter(lambda n: n != "manifest.json"),
        st.binary(max_size=300),
        max_size=4,
    )
)
def test_round_trip_property(cache, files):
    key = cache_key("prop", files)
    assert cache.put(key, files)
    assert cache.get(key) == files


# ---------------------------------------------------------------------- corrupt entries


def _rebuild_counts(cache, key):
    calls = []

    def build():
        calls.append(1)
        return dict(FILES)

    assert cache.get_or_create(key, build) == FILES
    return len(calls)


def test_flipped_bytes_detected_removed_rebuilt(cache):
    key = cache_key("flip")
    cache.put(key, FILES)
    so = _entry(cache, key) / "kernel.so"
    data = bytearray(so.read_bytes())
    data[100] ^= 0xFF
    data[101] ^= 0x01
    so.write_bytes(bytes(data))  # same size, different content
    assert cache.get(key) is None
    assert not _entry(cache, key).exists(), "corrupt entry must be deleted"
    assert _rebuild_counts(cache, key) == 1
    assert cache.get(key) == FILES


def test_truncated_file_detected_removed_rebuilt(cache):
    key = cache_key("truncate")
    cache.put(key, FILES)
    so = _entry(cache, key) / "kernel.so"
    with open(so, "r+b") as f:
        f.truncate(10)
    assert cache.path_of(key) is None
    assert not _entry(cache, key).exists()
    assert _rebuild_counts(cache, key) == 1
    assert cache.get(key) == FILES


def test_missing_data_file_detected(cache):
    key = cache_key("missing file")
    cache.put(key, FILES)
    (_entry(cache, key) / "kernel.py").unlink()
    assert cache.get(key) is None and not _entry(cache, key).exists()


def test_missing_manifest_detected_and_rebuilt(cache):
    key = cache_key("no manifest")
    cache.put(key, FILES)
    (_entry(cache, key) / "manifest.json").unlink()
    assert cache.get(key) is None
    assert not _entry(cache, key).exists()
    assert _rebuild_counts(cache, key) == 1


@pytest.mark.parametrize(
    "manifest",
    [
        b"{not json",
        b"\xff\xfe",
        b"[]",
        b'{"format": 999, "files": {}}',
        b'{"format": 1, "key": "other", "files": {}}',
        b'{"format": 1, "key": "KEY", "files": {"../../etc/passwd": {"size": 1, "sha256": "x"}}}',
        b'{"format": 1, "key": "KEY", "files": {"kernel.py": 3}}',
    ],
)
def test_bad_manifest_detected(cache, manifest):
    key = cache_key("bad manifest")
    cache.put(key, FILES)
    (_entry(cache, key) / "manifest.json").write_bytes(manifest.replace(b"KEY", key.encode()))
    assert cache.get(key) is None
    assert not _entry(cache, key).exists()


def test_corrupt_entry_replaced_by_put(cache):
    key = cache_key("replace corrupt")
    cache.put(key, {"a.txt": b"old"})
    (_entry(cache, key) / "a.txt").write_bytes(b"bad")
    assert cache.put(key, {"a.txt": b"new"}) is True
    assert cache.get(key) == {"a.txt": b"new"}


# ----------------------------------------------------------------------------- I/O errors


def _build():
    return {"k.py": b"built"}


def test_read_only_directory_real(tmp_path):
    root = tmp_path / "ro"
    c = DiskCache("test", root=root)
    os.chmod(root, 0o500)
    try:
        probe = root / "probe"
        try:
            probe.write_bytes(b"")
        except PermissionError:
            pass
        else:
            probe.unlink()
            pytest.skip("running as root (or with CAP_DAC_OVERRIDE): chmod 0o500 does not stop writes; "
                        "the simulated-PermissionError test covers this path")
        with pytest.warns(CacheWarning, match="cannot write"):
            assert c.get_or_create(cache_key("ro"), _build) == {"k.py": b"built"}
        assert c.builds == 1
    finally:
        os.chmod(root, 0o700)


def test_permission_error_on_rename_warns_and_builds(cache, monkeypatch):
    def deny(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "replace", deny)
    key = cache_key("perm")
    with pytest.warns(CacheWarning, match="cannot write"):
        assert cache.get_or_create(key, _build) == {"k.py": b"built"}
    assert cache.builds == 1
    # warned once only; no temporary directories left behind
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        assert cache.put(cache_key("perm2"), {"a": b"x"}) is False
    assert not [p for p in (cache.root / "test").iterdir() if p.name.startswith(".")]
    monkeypatch.undo()
    assert cache.get(key) is None


def test_disk_full_warns_and_builds(cache, monkeypatch):
    from tilefuse.cache import disk as cache_mod

    def full_disk(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(cache_mod, "_write_file", full_disk)
    with pytest.warns(CacheWarning, match="No space left"):
        assert cache.get_or_create(cache_key("full"), _build) == {"k.py": b"built"}
    monkeypatch.undo()
    assert not [p for p in (cache.root / "test").iterdir() if p.name.startswith(".")]


def test_fsync_failure_warns(cache, monkeypatch):
    def fail(fd):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.warns(CacheWarning):
        assert cache.put(cache_key("eio"), FILES) is False


def test_uncreatable_root_does_not_raise(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.warns(CacheWarning, match="cannot use cache directory"):
        c = DiskCache("test", root=blocker / "cache")  # parent is a file: ENOTDIR
    assert c.get_or_create(cache_key("x"), _build) == {"k.py": b"built"}
    assert c.put(cache_key("x"), {"a": b"b"}) is False


def test_unlockable_entry_builds_without_lock(cache, monkeypatch):
    real_open = os.open

    def no_lock(path, flags, *a, **k):
        if str(path).endswith(".lock"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", no_lock)
    assert cache.get_or_create(cache_key("nolock"), _build) == {"k.py": b"built"}
    assert cache.builds == 1


def test_build_errors_propagate_and_release_lock(cache):
    key = cache_key("boom")

    def boom():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        cache.get_or_create(key, boom)
    assert cache.get_or_create(key, _build) == {"k.py": b"built"}  # lock was released


# ------------------------------------------------------------------------------- security


def test_group_writable_root_refused_for_loading(tmp_path):
    root = tmp_path / "shared"
    key = cache_key("planted")
    DiskCache("test", root=root).put(key, {"k.py": b"planted code"})
    os.chmod(root, 0o770)
    with pytest.warns(CacheWarning, match="refusing to load"):
        c = DiskCache("test", root=root)
    assert not c.readable
    assert c.get(key) is None and c.path_of(key) is None
    assert c.get_or_create(key, _build) == {"k.py": b"built"}
    assert c.builds == 1 and c.info()["enabled"] is False
    # the planted entry was neither loaded nor replaced
    assert (_entry(c, key) / "k.py").read_bytes() == b"planted code"
    # warned once per root
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        DiskCache("other", root=root)


def test_world_writable_namespace_refused(tmp_path):
    root = tmp_path / "c"
    DiskCache("test", root=root).put(cache_key("k"), {"a": b"b"})
    os.chmod(root / "test", 0o777)
    with pytest.warns(CacheWarning, match="refusing to load"):
        c = DiskCache("test", root=root)
    assert c.get(cache_key("k")) is None


def test_root_owned_by_other_user_refused(tmp_path, monkeypatch):
    root = tmp_path / "c"
    root.mkdir(mode=0o700)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(root).st_uid + 1)
    with pytest.warns(CacheWarning, match="owned by uid"):
        c = DiskCache("test", root=root)
    assert not c.readable


# --------------------------------------------------------------------- maintenance


def test_info_and_clear(tmp_path):
    a = DiskCache("a", root=tmp_path / "c")
    b = DiskCache("b", root=tmp_path / "c")
    a.put(cache_key(1), {"x": b"12345"})
    a.put(cache_key(2), {"x": b"1"})
    b.put(cache_key(3), {"y": b"123"})
    info = a.info()
    assert info["root"] == str(tmp_path / "c") and info["enabled"]
    assert info["namespaces"]["a"]["entries"] == 2
    assert info["namespaces"]["b"]["entries"] == 1
    assert info["namespaces"]["a"]["bytes"] > 6  # data plus manifests
    assert a.clear() == 2
    assert a.get(cache_key(1)) is None and b.get(cache_key(3)) == {"y": b"123"}
    assert a.info()["namespaces"]["a"] == {"entries": 0, "bytes": 0}
    assert a.clear(all_namespaces=True) == 1
    assert b.get(cache_key(3)) is None
    assert a.put(cache_key(1), {"x": b"again"})  # usable after clear


# ------------------------------------------------------------------------- concurrency

_WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    from tilefuse.cache.disk import DiskCache
    root, key, counter, ready_dir, me = sys.argv[1:6]
    open(os.path.join(ready_dir, me), "w").close()
    deadline = time.time() + 60
    while len(os.listdir(ready_dir)) < 2 and time.time() < deadline:  # start together
        time.sleep(0.005)

    def build():
        with open(counter, "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(0.5)
        return {"kernel.py": b"print('built once')\\n", "pid.txt": str(os.getpid()).encode()}

    c = DiskCache("concurrent", root=root)
    files = c.get_or_create(key, build)
    print(json.dumps({"files": {k: v.decode() for k, v in files.items()},
                      "builds": c.builds, "hits": c.hits}))
    """
)


def test_two_processes_build_once(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    counter = tmp_path / "counter.txt"
    ready = tmp_path / "ready"
    ready.mkdir()
    root = tmp_path / "cache"
    key = cache_key("concurrent kernel")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(root), key, str(counter), str(ready), str(i)],
            env=_subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert len(counter.read_text().splitlines()) == 1, "build ran more than once"
    assert results[0]["files"] == results[1]["files"]
    assert sorted(r["builds"] for r in results) == [0, 1]
    assert sorted(r["hits"] for r in results) == [0, 1]
    assert DiskCache("concurrent", root=root).get(key) == {
        k: v.encode() for k, v in results[0]["files"].items()
    }
