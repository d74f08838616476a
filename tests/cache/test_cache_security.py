"""The cache and the files it runs (issue #21): nothing another user could have written is
loaded (ownership, modes and links checked below the root, not only on it), reproducers are
written only where the policy allows and never through a link, `cache clear` removes only what
tilefuse wrote, a wait on another process's lock says whom it waits for, temporaries of killed
processes are swept, and the cache stays under its size bound.

Other users are simulated: loose modes with chmod, another owner by replacing
`tilefuse.cache.trust.owner` (tests cannot rely on being root or on a second user).
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch

import tilefuse
from tilefuse.cache import disk as cache_mod
from tilefuse.cache.disk import CacheWarning, DiskCache, cache_key

SO = b"\x7fELF not really a library" * 10
FILES = {"kernel.py": b"x = 'cached'\n", "kernel.so": SO}
BUILT = {"kernel.py": b"x = 'built'\n", "kernel.so": SO + b"built"}


@pytest.fixture(autouse=True)
def _fresh_warning_registry():
    cache_mod._warned.clear()
    yield
    cache_mod._warned.clear()


def _entry(c: DiskCache, key: str) -> Path:
    return c.root / c.namespace / key[:2] / key


def _stored(tmp_path, files=FILES) -> tuple[DiskCache, str]:
    c = DiskCache("test", root=tmp_path / "cache")
    key = cache_key("planted?", tmp_path.name)
    assert c.put(key, files)
    return c, key


def _build():
    return dict(BUILT)


def _optional(module: str):
    """A module of tilefuse, or None where it does not exist (then there is nothing to patch,
    and the test fails on what it checks, not on an import)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def _foreign(monkeypatch, *paths: Path) -> None:
    """Make `paths` look owned by another user."""
    trust = _optional("tilefuse.cache.trust")
    if trust is None:
        return

    inodes = {os.lstat(p).st_ino for p in paths}
    real = trust.owner
    monkeypatch.setattr(trust, "owner", lambda st: real(st) + 1 if st.st_ino in inodes else real(st))


def _assert_refused_and_rebuilt(c: DiskCache, key: str) -> None:
    fresh = DiskCache("test", root=c.root)
    with pytest.warns(CacheWarning, match="refusing to load"):
        assert fresh.get_or_create(key, _build) == BUILT
    assert fresh.builds == 1 and fresh.hits == 0


# ------------------------------------------------------------------- below the root


@pytest.mark.parametrize("what", ["entry", "kernel.so", "manifest.json"])
def test_loose_modes_below_the_root_are_refused_and_rebuilt(tmp_path, what):
    c, key = _stored(tmp_path)
    target = _entry(c, key) if what == "entry" else _entry(c, key) / what
    os.chmod(target, 0o777 if what == "entry" else 0o666)
    _assert_refused_and_rebuilt(c, key)
    # the untrusted entry was replaced by a private one, used from now on
    assert stat.S_IMODE(os.stat(_entry(c, key) / "kernel.so").st_mode) & 0o022 == 0
    again = DiskCache("test", root=c.root)
    assert again.get(key) == BUILT and again.path_of(key) == _entry(c, key)


def test_a_world_writable_shard_is_refused_and_not_written(tmp_path):
    c, key = _stored(tmp_path)
    shard = _entry(c, key).parent
    os.chmod(shard, 0o777)
    fresh = DiskCache("test", root=c.root)
    with pytest.warns(CacheWarning, match=f"refusing to load from {shard}"):
        assert fresh.get_or_create(key, _build) == BUILT
    assert fresh.path_of(key) is None and fresh.builds == 1
    assert (_entry(c, key) / "kernel.py").read_bytes() == FILES["kernel.py"]  # not loaded, not replaced
    assert not fresh.put(key[:2] + "0" * 62, {"a": b"b"})  # nothing written into it


@pytest.mark.parametrize("what", ["entry", "kernel.so"])
def test_entries_and_files_of_another_user_are_refused(tmp_path, monkeypatch, what):
    c, key = _stored(tmp_path)
    _foreign(monkeypatch, _entry(c, key) if what == "entry" else _entry(c, key) / what)
    fresh = DiskCache("test", root=c.root)
    with pytest.warns(CacheWarning, match="owned by uid"):
        assert fresh.get_or_create(key, _build) == BUILT
    assert fresh.builds == 1


def test_a_symlinked_entry_is_refused(tmp_path):
    c, key = _stored(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    _entry(c, key).rename(elsewhere)  # a complete, valid entry: only the link is wrong
    _entry(c, key).symlink_to(elsewhere, target_is_directory=True)
    _assert_refused_and_rebuilt(c, key)
    assert (elsewhere / "kernel.py").read_bytes() == FILES["kernel.py"]  # the link removed, not its target
    assert not _entry(c, key).is_symlink()


def test_a_symlinked_file_is_refused(tmp_path):
    c, key = _stored(tmp_path)
    planted = tmp_path / "planted.so"
    planted.write_bytes(SO)  # the same bytes: the checksum matches
    (_entry(c, key) / "kernel.so").unlink()
    (_entry(c, key) / "kernel.so").symlink_to(planted)
    _assert_refused_and_rebuilt(c, key)
    assert planted.read_bytes() == SO


def test_a_fifo_in_place_of_a_file_does_not_hang(tmp_path):
    c, key = _stored(tmp_path)
    (_entry(c, key) / "kernel.so").unlink()
    os.mkfifo(_entry(c, key) / "kernel.so", 0o600)
    _assert_refused_and_rebuilt(c, key)


def test_a_planted_library_is_never_loaded_by_the_cpu_backend(tmp_path, monkeypatch):
    """End to end: a compiled kernel's .so made writable by others and replaced (manifest
    updated to match) is refused; the kernel is rebuilt and the result is right."""
    from tilefuse.backends import cpu

    fn = lambda t: torch.cos(t) * 2.375 - 0.5  # noqa: E731 - a kernel no other test builds
    x = torch.randn(9, 7)
    root = tmp_path / "cache"
    with tilefuse.config.patch(target="cpu", fallback="error", cache_dir=str(root)):
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(fn, backend="tilefuse")(x), fn(x))
        [manifest] = (root / "cpu").glob("*/*/manifest.json")
        so = manifest.parent / "kernel.so"
        so.unlink()  # (never written in place: this process has the library mapped)
        so.write_bytes(b"not a shared library")
        os.chmod(so, 0o666)
        meta = json.loads(manifest.read_text())
        meta["files"]["kernel.so"] = {"size": so.stat().st_size, "sha256": cache_mod._sha256(so.read_bytes())}
        manifest.write_text(json.dumps(meta))
        cpu.launcher._libraries.clear()  # as in a new process: only the disk cache remains
        torch._dynamo.reset()
        with pytest.warns(CacheWarning, match="refusing to load"):
            torch.testing.assert_close(torch.compile(fn, backend="tilefuse")(x), fn(x))
    assert so.read_bytes() != b"not a shared library"  # rebuilt in place


# ----------------------------------------------------------------------- reproducers


def _graph():
    gm = torch.fx.symbolic_trace(lambda a: a * 2 + 1)
    return gm, (torch.randn(3),)


def _would_be_named(directory: Path, gm, args) -> Path:
    """The predictable name a reproducer of `gm` got before (repro_<name>_<hash>.py)."""
    import hashlib

    from tilefuse.failure import reproducer_source

    source = reproducer_source(gm, args, "t", {})
    return directory / f"repro_g_{hashlib.sha256(source.encode()).hexdigest()[:10]}.py"


def test_reproducers_avoid_a_refused_root_and_planted_links_in_the_temp_dir(tmp_path, monkeypatch):
    from tilefuse.failure import write_reproducer

    root = tmp_path / "cache"
    root.mkdir()
    os.chmod(root, 0o777)
    shared_tmp = tmp_path / "tmp"
    shared_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    monkeypatch.setattr(tilefuse.config, "cache_dir", str(root))
    gm, args = _graph()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    _would_be_named(shared_tmp, gm, args).symlink_to(victim)  # another user's trap
    path = Path(write_reproducer(gm, args, title="t", name="g", knobs={}))
    assert victim.read_text() == "precious"
    assert root not in path.parents
    assert path.parent != shared_tmp and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert not path.is_symlink() and "tilefuse reproducer" in path.read_text()


def test_reproducers_in_a_private_root_never_follow_a_planted_link(tmp_path, monkeypatch):
    from tilefuse.failure import write_reproducer

    root = tmp_path / "cache"
    monkeypatch.setattr(tilefuse.config, "cache_dir", str(root))
    gm, args = _graph()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (root / "repro").mkdir(parents=True, mode=0o700)
    trap = _would_be_named(root / "repro", gm, args)
    trap.symlink_to(victim)
    path = Path(write_reproducer(gm, args, title="t", name="g", knobs={}))
    assert victim.read_text() == "precious" and trap.is_symlink()
    assert path.parent == root / "repro" and path != trap and not path.is_symlink()
    # the same script again reuses its own file, never the link
    assert Path(write_reproducer(gm, args, title="t", name="g", knobs={})).read_text() == path.read_text()


def test_a_symlinked_repro_directory_is_not_written_through(tmp_path, monkeypatch):
    from tilefuse.failure import write_reproducer

    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "repro").symlink_to(elsewhere, target_is_directory=True)
    monkeypatch.setattr(tilefuse.config, "cache_dir", str(root))
    gm, args = _graph()
    path = Path(write_reproducer(gm, args, title="t", name="g", knobs={}))
    assert list(elsewhere.iterdir()) == [] and root not in path.parents


# ------------------------------------------------------------------------ cache clear


def _cli(capsys, *argv) -> tuple[int, str]:
    import tilefuse_cli

    code = tilefuse_cli.main(list(argv))
    return code, capsys.readouterr().out


def test_clear_removes_only_entries_tilefuse_wrote(tmp_path, monkeypatch, capsys):
    root = tmp_path / "cache"
    cpu, tune = DiskCache("cpu", root=root), DiskCache("tune", root=root)
    for k in range(3):
        cpu.put(cache_key("cpu", k), {"kernel.so": b"x" * 100})
    tune.put(cache_key("tune", 0), {"record.json": b"{}"})
    (root / "cpu" / "my-notes.txt").write_text("a user's file")
    user_dir = root / "cpu" / cache_key("cpu", 0)[:2] / "mine"
    user_dir.mkdir()
    (user_dir / "data").write_text("also the user's")
    foreign = _entry(cpu, cache_key("cpu", 2))
    _foreign(monkeypatch, foreign)  # an entry another user wrote
    monkeypatch.setattr(tilefuse.config, "cache_dir", str(root))

    code, out = _cli(capsys, "cache", "clear", "--json")
    assert code == 0
    removed = {i["name"]: i for i in json.loads(out)["removed"]}
    assert removed["cpu"]["entries"] == 2 and removed["tune"]["entries"] == 1
    assert removed["cpu"]["bytes"] >= 200 and removed["cpu"]["left"] == 3  # notes, mine/, the foreign entry
    assert (root / "cpu" / "my-notes.txt").read_text() == "a user's file"
    assert (user_dir / "data").read_text() == "also the user's"
    assert foreign.is_dir()
    assert not (root / "tune").exists()  # emptied, so removed

    code, out = _cli(capsys, "cache", "clear")
    assert code == 0 and "removed 0 entries" in out and "left alone: cpu/" in out


def test_clear_refuses_a_refused_root(tmp_path, monkeypatch, capsys):
    root = tmp_path / "cache"
    c = DiskCache("cpu", root=root)
    c.put(cache_key("x"), {"kernel.so": b"x"})
    os.chmod(root, 0o777)
    monkeypatch.setattr(tilefuse.config, "cache_dir", str(root))
    code, out = _cli(capsys, "cache", "clear")
    assert code == 1 and "not clearing" in out and "writable by group or others" in out
    assert _entry(c, cache_key("x")).is_dir()
    assert cache_mod.clear_root(root) == []


# --------------------------------------------------------------------- TRITON_CACHE_DIR


def test_no_compiler_cache_is_pointed_into_a_refused_root(tmp_path, monkeypatch):
    from tilefuse.bench.coldstart import cache_env

    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(ValueError, match="writable by group or others"):
        cache_env(root)
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    assert cache_env(private)["TRITON_CACHE_DIR"].startswith(str(private))


def test_a_compile_with_a_refused_root_leaves_triton_s_cache_alone(tmp_path, monkeypatch):
    """A regression guard: tilefuse never sets TRITON_CACHE_DIR (nor Triton's cache knob)."""
    triton = pytest.importorskip("triton")
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    before = (os.environ.get("TRITON_CACHE_DIR"), triton.knobs.cache.dir)
    fn = lambda t: torch.sin(t) * 1.625  # noqa: E731
    x = torch.randn(5, 3)
    with tilefuse.config.patch(target="interpret", fallback="error", cache_dir=str(root)):
        torch._dynamo.reset()
        with pytest.warns(CacheWarning, match="refusing to load"):
            torch.testing.assert_close(torch.compile(fn, backend="tilefuse")(x), fn(x))
    assert (os.environ.get("TRITON_CACHE_DIR"), triton.knobs.cache.dir) == before
    assert str(root) not in str(before)
    assert list(root.iterdir()) == []


# ------------------------------------------------------------------------------ locks


def test_a_wait_on_another_process_s_lock_says_whom_it_waits_for(tmp_path, monkeypatch):
    import fcntl

    from tilefuse.cache import entry_lock

    c = DiskCache("test", root=tmp_path / "cache")
    key = cache_key("locked")
    lock_path = _entry(c, key).parent / (key + ".lock")
    lock_path.parent.mkdir(parents=True, mode=0o700)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\n"
         "os.write(fd, str(os.getpid()).encode())\n"
         "print('held', flush=True)\n"
         "time.sleep(60)\n", str(lock_path)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(entry_lock, "NOTICE_AFTER_S", 0.2)
        t0 = time.monotonic()
        with tilefuse.config.patch(cache_lock_timeout=1):
            with pytest.warns(CacheWarning, match=rf"waiting for process {holder.pid}, which is building test/{key}"):
                assert c.get_or_create(key, _build) == BUILT
        assert 0.9 < time.monotonic() - t0 < 30 and c.builds == 1
    finally:
        holder.kill()
        holder.wait()

    mine = cache_key("mine")
    lock_path = _entry(c, mine).parent / (mine + ".lock")

    def build_and_look():
        fd = os.open(lock_path, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):  # held, by this process...
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        assert lock_path.read_text().split() == [str(os.getpid())]  # ...which says so
        return {"k": b"v"}

    assert c.get_or_create(mine, build_and_look) == {"k": b"v"}


def test_the_lock_timeout_is_a_knob():
    from tilefuse.config import knob_table

    assert tilefuse.config.cache_lock_timeout == 600
    assert "TILEFUSE_CACHE_LOCK_TIMEOUT" in knob_table()


# ------------------------------------------------------------------------- temporaries


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _old(path: Path) -> Path:
    t = time.time() - 2 * 3600
    os.utime(path, (t, t), follow_symlinks=False)
    return path


def test_stale_temporaries_of_killed_processes_are_swept_on_start(tmp_path, monkeypatch):
    shared_tmp = tmp_path / "tmp"
    shared_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    scratch = _optional("tilefuse.cache.scratch")
    if scratch is not None:
        monkeypatch.setattr(scratch, "_swept", set())  # as in a new process
    dead, me = _dead_pid(), os.getpid()
    victim = tmp_path / "victim.so"
    victim.write_text("not ours to delete")
    gone = [shared_tmp / f"tilefuse-cpp-{dead}-abcdefgh", shared_tmp / "tilefuse-cpp-ijklmnop",
            shared_tmp / f"tilefuse-scratch-{dead}-qrstuvwx"]
    for d in gone:
        d.mkdir()
        (d / "kernel.so").write_bytes(b"x")
        _old(d)
    old_so = shared_tmp / "tilefuse_abcd1234.so"
    old_so.write_bytes(b"x")
    gone.append(_old(old_so))
    kept = [shared_tmp / f"tilefuse-cpp-{dead}-young123", shared_tmp / f"tilefuse-scratch-{me}-running"]
    for d in kept:
        d.mkdir()
    _old(kept[1])  # old, but its process runs
    link = shared_tmp / "tilefuse_linkxxxx.so"
    link.symlink_to(victim)
    _old(link)
    users = shared_tmp / "tilefuse-2024-results"
    users.mkdir()
    _old(users)
    foreign = shared_tmp / "tilefuse_foreign1.so"
    foreign.write_bytes(b"x")
    _old(foreign)
    _foreign(monkeypatch, foreign)

    root = tmp_path / "cache"
    (root / "test").mkdir(parents=True, mode=0o700)
    os.chmod(root, 0o700)
    writing = [root / "test" / f".tmp-{dead}-abcdefgh", root / "test" / f".tmp-{me}-abcdefgh"]
    for d in writing:
        d.mkdir()
        _old(d)  # the second one's process (this one) still runs

    DiskCache("test", root=root)  # a process starts using the cache
    for path in gone + [writing[0]]:
        assert not os.path.lexists(path), path
    for path in kept + [link, users, foreign, writing[1]]:
        assert os.path.lexists(path), path
    assert victim.read_text() == "not ours to delete"


def test_an_unusable_cache_leaves_no_library_copies(tmp_path, monkeypatch):
    from tilefuse.backends import cpu

    shared_tmp = tmp_path / "tmp"
    shared_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    scratch = _optional("tilefuse.cache.scratch")
    if scratch is not None:
        monkeypatch.setattr(scratch, "_dir", None)  # this process's scratch directory, made anew here
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    fn = lambda t: torch.tan(t) * 0.875 + 3  # noqa: E731
    x = torch.rand(6, 4)
    with tilefuse.config.patch(target="cpu", fallback="error", cache_dir=str(root)):
        cpu.launcher._libraries.clear()
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CacheWarning)
            torch.testing.assert_close(torch.compile(fn, backend="tilefuse")(x), fn(x))
    assert [p.name for p in shared_tmp.rglob("*.so")] == []


def test_a_compile_works_in_a_directory_named_after_its_process(tmp_path, monkeypatch):
    """So that a killed compile's directory can be told from a running one's."""
    from tilefuse.backends.cpu import toolchain

    shared_tmp = tmp_path / "tmp"
    shared_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    seen = tmp_path / "seen"
    fake = tmp_path / "fake-cxx"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {seen}\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(toolchain.CompileError):
        toolchain.build("int x;", str(fake))
    out = [a for a in seen.read_text().split() if a.endswith("kernel.so")][0]
    assert Path(out).parent.name.startswith(f"tilefuse-cpp-{os.getpid()}-")
    assert list(shared_tmp.iterdir()) == []


# ------------------------------------------------------------------------- size bound


def test_the_cache_stays_under_its_size_bound_least_recently_used_first(tmp_path, monkeypatch):
    from tilefuse.cache import size_bound

    c = DiskCache("test", root=tmp_path / "cache")
    keys = [cache_key("sized", k) for k in range(6)]
    with tilefuse.config.patch(cache_max_bytes=10**9):
        for k, key in enumerate(keys):
            assert c.put(key, {"blob": bytes(1000)})
            t = time.time() - 10 * 3600 + k * 60  # written in this order, long ago
            os.utime(_entry(c, key) / "manifest.json", (t, t))
    assert c.get(keys[0]) is not None  # a hit: the oldest becomes the most recently used
    monkeypatch.setattr(size_bound, "_written", {})
    (c.root / size_bound.MARKER).unlink()
    with tilefuse.config.patch(cache_max_bytes=4500):
        assert c.put(cache_key("sized", "new"), {"blob": bytes(1000)})
    left = {key for key in keys if _entry(c, key).is_dir()}
    assert keys[0] in left and cache_key("sized", "new") in {p.name for p in (c.root / "test").glob("*/*")}
    assert keys[1] not in left and keys[2] not in left  # the least recently used went first
    total = sum(cache_mod.layout.tree_bytes(e) for e in (c.root / "test").glob("*/*") if e.is_dir())
    assert total <= 4500 * size_bound.LOW_WATER


def test_lookups_do_not_measure_the_cache(tmp_path, monkeypatch):
    from tilefuse.cache import size_bound

    c = DiskCache("test", root=tmp_path / "cache")
    c.put(cache_key("a"), {"blob": b"x"})
    calls = []
    monkeypatch.setattr(size_bound, "enforce", lambda *a: calls.append(a) or (0, 0))
    for _ in range(50):
        assert c.get(cache_key("a")) is not None
    assert calls == []
    assert tilefuse.config.cache_max_bytes == 4 << 30


@pytest.mark.parametrize("umask", [0o002, 0o022, 0o077])
def test_the_cache_works_under_any_umask(tmp_path, umask):
    """What the cache writes is private whatever the umask (a group-writable umask is common:
    Ubuntu's private user groups), so its own entries are never refused as loose."""
    old = os.umask(umask)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", CacheWarning)  # no refusal of its own files
            root = tmp_path / "deep" / "cache"
            c = DiskCache("test", root=root)
            key = cache_key("umask", str(umask))
            assert c.put(key, FILES)
            fresh = DiskCache("test", root=root)
            assert fresh.get_or_create(key, _build) == FILES
            assert fresh.hits == 1 and fresh.builds == 0
    finally:
        os.umask(old)
    for p in [tmp_path / "deep", *(tmp_path / "deep").rglob("*")]:
        mode = stat.S_IMODE(os.lstat(p).st_mode)
        assert mode & 0o022 == 0, (p, oct(mode))


def test_a_root_reached_through_another_users_link_is_refused(tmp_path, monkeypatch):
    """`TILEFUSE_CACHE_DIR=/tmp/cache` where someone else planted `/tmp/cache` as a link: even
    pointing at a directory of ours it is refused (they could retarget it after the checks)."""
    ours = tmp_path / "ours"
    c, key = _stored(ours)
    link = tmp_path / "planted"
    link.symlink_to(c.root)
    _foreign(monkeypatch, link)
    with pytest.warns(CacheWarning, match="symbolic link owned by another user"):
        fresh = DiskCache("test", root=link)
    assert not fresh.readable and not fresh.writable
    assert fresh.get_or_create(key, _build) == BUILT and fresh.hits == 0


def test_a_root_reached_through_our_own_link_is_resolved_once(tmp_path):
    """Our own link is followed once, when the cache opens: the cache then keeps using the
    directory it checked, whatever the link points at later."""
    c, key = _stored(tmp_path / "ours")
    link = tmp_path / "mine"
    link.symlink_to(c.root)
    fresh = DiskCache("test", root=link)
    assert fresh.root == c.root.resolve()
    other = tmp_path / "elsewhere"
    other.mkdir(mode=0o700)
    link.unlink()
    link.symlink_to(other)
    assert fresh.get_or_create(key, _build) == FILES and fresh.hits == 1


def test_a_library_evicted_after_its_check_is_loaded_from_the_bytes_in_hand(tmp_path, monkeypatch):
    """Another process (or `tilefuse cache clear`) removed the entry between its check and the
    load: the kernel still loads, from a private copy of the bytes just read."""
    from tilefuse.backends.cpu import launcher, toolchain

    source = 'extern "C" int tf_answer() { return 42; }\n'
    cache = DiskCache("cpu", root=tmp_path / "cache")
    key = cache_key("evicted", source)
    real = launcher.ctypes.CDLL
    tried = []

    def evicted(path, *a, **k):
        if str(path).startswith(str(cache.root)):
            tried.append(path)
            raise OSError(2, "No such file or directory", str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(launcher.ctypes, "CDLL", evicted)
    lib = launcher._build_and_load(cache, key, source, toolchain.find_compiler())
    assert tried and lib.tf_answer() == 42
