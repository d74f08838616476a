"""The on-disk cache for compiled artifacts (kernel source, generated modules, shared
libraries, tuning results).

This module owns the cache's layout on disk, its keys, its integrity checks, its locking and
its security policy. Everything else asks it for bytes by key and never touches the files
directly (except through :meth:`DiskCache.path_of`, for callers that must import or ``dlopen``
a file in place).

Layout::

    <root>/                              created 0o700 (per user, private)
      <namespace>/                       e.g. "triton", "cpu", "tune"
        <key[:2]>/<key>/                 one entry: named files + manifest.json
        <key[:2]>/<key>.lock             file lock used by get_or_create
        .tmp-*                           entries being written (renamed into place)
      repro/, tune-ceilings/             other directories tilefuse writes (see OWNED_DIRS)
      .trash-*                           being deleted by clear

:func:`root_contents` and :func:`clear_root` inspect and clear everything tilefuse owns under
the root (``tilefuse cache info|clear``); anything else there is left alone.

``root`` defaults to ``tilefuse.config.cache_dir`` (env ``TILEFUSE_CACHE_DIR``, default
``$XDG_CACHE_HOME/tilefuse`` or ``~/.cache/tilefuse``).

Guarantees:

* **Keys never go stale.** :func:`cache_key` hashes a canonical JSON encoding of its parts;
  callers include :func:`environment_fingerprint` (tilefuse, torch, triton and Python
  versions, machine, CUDA device and capability) so a binary built by another version or for
  another device is never found.
* **Never corrupt.** Each entry has a ``manifest.json`` with a format version, its key, and
  the size and sha256 of every file. :meth:`DiskCache.get` verifies all of them; a missing or
  unparseable manifest, a truncated or altered file, is logged, the entry is deleted and the
  lookup is a miss — the caller rebuilds. Corrupt data is never returned.
* **Atomic and concurrent-safe writes.** An entry is written to a temporary directory inside
  the namespace, fsynced, then renamed into place in one step; if another process already
  published a valid entry, theirs is kept. :meth:`DiskCache.get_or_create` holds a file lock
  per key so that concurrent processes compiling the same kernel build it once.
* **The cache is optional.** I/O errors (read-only directory, disk full, permissions) never
  raise: a :class:`CacheWarning` is issued once and compilation goes on without the cache.
* **Plain files only.** Entries are source, JSON and shared libraries; nothing is pickled.

Security: a cache directory that other users can write lets them plant code (a generated
Python module, a shared library) that then runs inside your process. The root is therefore
created with mode 0o700. If it already exists and is writable by group or others, or is owned
by another user, the cache warns once and refuses to *load* from it (every lookup is a miss);
it does not write there either, as nothing written could be trusted back. Fix it with
``chmod 700 <root>`` or point ``TILEFUSE_CACHE_DIR`` elsewhere.

No torch or triton import happens at module level: :func:`environment_fingerprint` imports
torch lazily and reads Triton's version from its package metadata, never importing it.
"""
from __future__ import annotations

import errno
import functools
import hashlib
import json
import numbers
import os
import platform
import re
import shutil
import stat
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .. import logs

__all__ = [
    "CacheWarning",
    "DiskCache",
    "FORMAT_VERSION",
    "LOCK_TIMEOUT_S",
    "OWNED_DIRS",
    "RootItem",
    "cache_key",
    "clear_root",
    "environment_fingerprint",
    "root_contents",
    "root_problem",
]

#: bumped whenever the entry layout or manifest schema changes; older entries are discarded
FORMAT_VERSION = 1
#: how long get_or_create waits for another process building the same key before it builds
#: the entry itself (without the lock)
LOCK_TIMEOUT_S = 600.0

MANIFEST = "manifest.json"
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")
_KEY_RE = re.compile(r"[A-Za-z0-9_-]{2,200}")
_FILENAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,199}")

# (root, problem) pairs already warned about: each problem is reported once per process.
_warned: set[tuple[str, str]] = set()


class CacheWarning(UserWarning):
    """The disk cache could not be used (I/O error, insecure directory); compilation goes on
    without it."""


# --------------------------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------------------------


def _canonical(obj: Any) -> Any:
    """Map ``obj`` to a JSON value whose serialisation is deterministic.

    Strings, bools, None, ints and floats stay themselves (so ``1``, ``1.0``, ``True`` and
    ``"1"`` differ); numeric scalars of other libraries (numpy) become int/float; tuples and
    lists become lists; a dict becomes an object whose keys are the JSON encodings of its
    canonical keys (so ``{1: x}`` and ``{"1": x}`` differ), sorted on serialisation; sets
    become sorted lists, bytes their sha256, and any other object ``str(obj)`` with its type
    name — each tagged as ``{"__set__": ...}`` etc. Tags are not valid JSON texts, so a tagged
    value never collides with an encoded dict.
    """
    if obj is None or isinstance(obj, (str, bool)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, (list, tuple)):
        return [_canonical(x) for x in obj]
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out[_dumps(_canonical(k))] = _canonical(v)
        return out
    if isinstance(obj, (set, frozenset)):
        items = [_canonical(x) for x in obj]
        return {"__set__": sorted(items, key=_dumps)}
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {"__bytes__": hashlib.sha256(bytes(obj)).hexdigest()}
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    return {"__obj__": type(obj).__qualname__, "str": str(obj)}


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def cache_key(*parts: Any) -> str:
    """The sha256 hex digest of a canonical JSON encoding of ``parts``.

    Stable across processes, hash seeds and dict insertion orders; sensitive to every value,
    to types (``1`` vs ``1.0`` vs ``"1"``), to nesting and to the order of the parts.
    """
    return hashlib.sha256(_dumps(_canonical(list(parts))).encode("utf-8")).hexdigest()


@functools.lru_cache(maxsize=None)
def _fingerprint() -> tuple[tuple[str, str], ...]:
    try:
        from tilefuse import __version__ as tf_version  # type: ignore[attr-defined]
    except Exception:
        tf_version = "0"
    fp: dict[str, str] = {
        "tilefuse": str(tf_version),
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
        "machine": platform.machine(),
        "cache_format": str(FORMAT_VERSION),
    }
    try:
        import torch
    except Exception:
        torch = None
    fp["torch"] = str(torch.__version__) if torch is not None else "none"
    fp["triton"] = _triton_version()
    if torch is not None:
        try:
            if torch.cuda.is_available():
                dev = torch.cuda.current_device()
                fp["cuda_device"] = torch.cuda.get_device_name(dev)
                major, minor = torch.cuda.get_device_capability(dev)
                fp["cuda_capability"] = f"{major}.{minor}"
                fp["cuda_version"] = str(torch.version.cuda or torch.version.hip or "none")
        except Exception:  # a broken driver must not break compilation
            pass
    return tuple(sorted(fp.items()))


def _triton_version() -> str:
    """Triton's version from its package metadata: the C++ backend keys its kernels with the
    fingerprint too, and must not import Triton (slow, and not needed on that path)."""
    from importlib import metadata

    for dist in ("triton", "pytorch-triton", "pytorch-triton-rocm", "pytorch-triton-xpu"):
        try:
            return metadata.version(dist)
        except Exception:  # not installed under this name, or unreadable metadata
            continue
    triton = sys.modules.get("triton")  # imported without metadata (a source checkout)
    return str(getattr(triton, "__version__", "none"))


def environment_fingerprint() -> dict[str, str]:
    """What changes a compiled binary besides its source: tilefuse, torch, triton and Python
    versions, the machine, and (only when CUDA is available) the device name, capability and
    CUDA version. Include it in keys: ``cache_key(source, environment_fingerprint())``.

    Computed once per process (the versions cannot change under a running process).
    """
    return dict(_fingerprint())


# --------------------------------------------------------------------------------------------
# Small filesystem helpers
# --------------------------------------------------------------------------------------------


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(path: Path) -> None:
    if os.name != "posix":
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def _insecure_reason(path: Path) -> str | None:
    """Why other users could write under ``path``, or None if only we can."""
    if os.name != "posix":
        return None
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


# --------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------


class DiskCache:
    """A namespace of the on-disk cache; see the module docstring for layout and guarantees.

    >>> cache = DiskCache("triton")
    >>> files = cache.get_or_create(key, lambda: {"kernel.py": src.encode()})

    Attributes ``hits``, ``misses`` and ``builds`` count lookups that returned cached data,
    lookups that found nothing valid, and calls of a build function. ``readable`` and
    ``writable`` say whether the cache is in use (both False for an insecure root).
    """

    def __init__(self, namespace: str, root: str | os.PathLike | None = None):
        if not isinstance(namespace, str) or not _NAMESPACE_RE.fullmatch(namespace):
            raise ValueError(f"invalid cache namespace {namespace!r}: use letters, digits, '._-'")
        if root is None:
            from ..config import config

            root = config.cache_dir
        self.namespace = namespace
        self.root = Path(os.path.abspath(os.path.expanduser(os.fspath(root))))
        self.dir = self.root / namespace
        self.hits = 0
        self.misses = 0
        self.builds = 0
        self.readable = True
        self.writable = True
        self._setup()

    def __repr__(self) -> str:
        state = "on" if self.readable else "disabled"
        return f"DiskCache({self.namespace!r}, root={str(self.root)!r}, {state})"

    # -- setup and warnings ------------------------------------------------------------------

    def _warn(self, problem: str, message: str) -> None:
        logs.log("cache", "%s", message)
        token = (str(self.root), problem)
        if token in _warned:
            return
        _warned.add(token)
        warnings.warn(f"tilefuse cache: {message}", CacheWarning, stacklevel=3)

    def _setup(self) -> None:
        created = not self.root.exists()
        try:
            if created:
                os.makedirs(self.root, mode=0o700, exist_ok=True)
                os.chmod(self.root, 0o700)  # makedirs' mode is filtered by the umask
            reason = _insecure_reason(self.root)
            if reason is None and self.dir.exists():
                reason = _insecure_reason(self.dir)
                where = self.dir
            else:
                where = self.root
        except OSError as e:
            # Cannot create (read-only parent, ...): nothing to read, nothing can be written.
            self.writable = False
            self._warn("setup", f"cannot use cache directory {self.root} ({e}); compiling without it")
            return
        if reason is not None:
            self.readable = False
            self.writable = False
            self._warn(
                "insecure",
                f"refusing to load from {where}: it {reason}, so other users could plant code "
                f"that would run in this process. Run `chmod 700 {where}` or set "
                "TILEFUSE_CACHE_DIR to a private directory.",
            )

    # -- paths -------------------------------------------------------------------------------

    def _entry_dir(self, key: str) -> Path:
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
            raise ValueError(f"invalid cache key {key!r}: use cache_key(...) to make one")
        return self.dir / key[:2] / key

    def _lock_path(self, key: str) -> Path:
        entry = self._entry_dir(key)
        return entry.parent / (entry.name + ".lock")

    def path_of(self, key: str) -> Path | None:
        """The directory holding the files of a valid entry for ``key`` (to import a generated
        module or ``dlopen`` a library in place), or None when there is no valid entry or the
        cache is disabled — then write the bytes from :meth:`get_or_create` somewhere private.

        The entry is verified before its path is returned; the files stay valid afterwards
        because only this user can write the (private) cache directory.
        """
        entry = self._entry_dir(key)
        if not self.readable:
            return None
        return entry if self._load(key) is not None else None

    # -- reading -----------------------------------------------------------------------------

    def _load(self, key: str) -> dict[str, bytes] | None:
        """Read and verify an entry without touching the counters; discard it if corrupt."""
        entry = self._entry_dir(key)
        if not self.readable:
            return None
        try:
            raw = (entry / MANIFEST).read_bytes()
        except FileNotFoundError:
            if entry.is_dir():
                self._discard(entry, "manifest missing")
            return None
        except OSError as e:
            logs.log("cache", "cannot read %s: %s", entry, e)
            return None
        try:
            manifest = json.loads(raw)
            if not isinstance(manifest, dict):
                raise ValueError("manifest is not an object")
            if manifest.get("format") != FORMAT_VERSION:
                raise ValueError(f"format {manifest.get('format')!r}, expected {FORMAT_VERSION}")
            if manifest.get("key") != key:
                raise ValueError(f"manifest is for key {manifest.get('key')!r}")
            listing = manifest["files"]
            if not isinstance(listing, dict):
                raise ValueError("'files' is not an object")
            out: dict[str, bytes] = {}
            for name, meta in listing.items():
                if not _valid_name(name):
                    raise ValueError(f"bad file name {name!r}")
                size, digest = int(meta["size"]), str(meta["sha256"])
                data = (entry / name).read_bytes()
                if len(data) != size:
                    raise ValueError(f"{name}: {len(data)} bytes, manifest says {size} (truncated?)")
                if _sha256(data) != digest:
                    raise ValueError(f"{name}: checksum mismatch (corrupt)")
                out[name] = data
        except (ValueError, KeyError, TypeError, FileNotFoundError, IsADirectoryError) as e:
            self._discard(entry, str(e))
            return None
        except OSError as e:
            logs.log("cache", "cannot read %s: %s", entry, e)
            return None
        return out

    def _discard(self, entry: Path, why: str) -> None:
        """Remove a corrupt entry: rename it out of sight (atomic), then delete it."""
        logs.log("cache", "discarding corrupt entry %s: %s", entry, why)
        _remove(entry, entry.parent.parent)

    def get(self, key: str) -> dict[str, bytes] | None:
        """The files of the entry for ``key``, verified; None on a miss, on a corrupt entry
        (which is deleted) or when the cache is disabled."""
        data = self._load(key)
        if data is None:
            self.misses += 1
            logs.log("cache", "miss %s/%s", self.namespace, key)
        else:
            self.hits += 1
            logs.log("cache", "hit %s/%s", self.namespace, key)
        return data

    # -- writing -----------------------------------------------------------------------------

    def put(self, key: str, files: dict[str, bytes]) -> bool:
        """Store ``files`` (name → bytes) under ``key`` atomically. Returns True when a valid
        entry for ``key`` is in the cache afterwards (ours, or one another process wrote
        first, which is kept), False when the cache could not be written (warned once)."""
        files = _check_files(files)
        entry = self._entry_dir(key)
        if not self.writable:
            return False
        if self._load(key) is not None:
            return True
        tmp: Path | None = None
        try:
            os.makedirs(entry.parent, mode=0o700, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=self.dir))
            listing = {}
            for name, data in files.items():
                _write_file(tmp / name, data)
                listing[name] = {"sha256": _sha256(data), "size": len(data)}
            manifest = {"format": FORMAT_VERSION, "key": key, "files": listing}
            _write_file(tmp / MANIFEST, (_dumps(manifest) + "\n").encode("utf-8"))
            _fsync_dir(tmp)
            for attempt in range(2):
                try:
                    os.replace(tmp, entry)
                    tmp = None
                    break
                except OSError as e:
                    if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not entry.exists():
                        raise
                    # Another process published this key first: keep theirs if it is valid.
                    if self._load(key) is not None:
                        logs.log("cache", "kept concurrent entry %s/%s", self.namespace, key)
                        return True
                    if attempt == 1:
                        raise
            _fsync_dir(entry.parent)
            logs.log("cache", "stored %s/%s (%d files)", self.namespace, key, len(files))
            return True
        except OSError as e:
            self._warn(
                "write",
                f"cannot write to {self.dir} ({e.__class__.__name__}: {e}); compiling without the cache",
            )
            return False
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    def get_or_create(self, key: str, build: Callable[[], dict[str, bytes]]) -> dict[str, bytes]:
        """The entry for ``key``, built with ``build()`` and stored if absent or corrupt.

        Concurrent processes asking for the same key build it once: the first takes a file
        lock ``<entry>.lock`` and builds, the others wait (up to :data:`LOCK_TIMEOUT_S`) and
        then read its entry. If the lock cannot be created (read-only directory) or times out,
        this builds without it. Exceptions from ``build`` propagate; cache I/O errors do not.
        """
        data = self._load(key)
        if data is not None:
            self.hits += 1
            return data
        lock = self._acquire_lock(key) if self.writable else None
        try:
            if lock is not None:
                data = self._load(key)  # built by another process while we waited?
                if data is not None:
                    self.hits += 1
                    logs.log("cache", "hit %s/%s after waiting for its builder", self.namespace, key)
                    return data
            self.misses += 1
            logs.log("cache", "miss %s/%s: building", self.namespace, key)
            data = _check_files(build())
            self.builds += 1
            self.put(key, data)
            return data
        finally:
            if lock is not None:
                try:
                    lock.release()
                except Exception as e:  # pragma: no cover - release failures are harmless
                    logs.log("cache", "releasing lock for %s failed: %s", key, e)

    def _acquire_lock(self, key: str):
        path = self._lock_path(key)
        try:
            import filelock

            os.makedirs(path.parent, mode=0o700, exist_ok=True)
            # Probe first: some filelock versions retry a lock file they cannot create until
            # the timeout instead of failing.
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            os.close(fd)
            lock = filelock.FileLock(str(path), timeout=LOCK_TIMEOUT_S)
            lock.acquire()
            return lock
        except ImportError:
            logs.log("cache", "filelock unavailable; building %s without a lock", key)
        except OSError as e:  # includes filelock.Timeout (a TimeoutError)
            logs.log("cache", "cannot lock %s (%s); building without the lock", path, e)
        return None

    # -- maintenance -------------------------------------------------------------------------

    def _entries(self, ns_dir: Path):
        return _namespace_entries(ns_dir)

    def clear(self, all_namespaces: bool = False) -> int:
        """Delete every entry of this namespace (of every namespace under the root with
        ``all_namespaces``), with locks and leftover temporary directories. Returns the number
        of entries removed. Never raises on I/O errors."""
        targets = [self.dir]
        if all_namespaces:
            try:
                targets = [Path(d.path) for d in os.scandir(self.root) if d.is_dir(follow_symlinks=False)]
            except OSError:
                targets = []
        removed = 0
        for ns_dir in targets:
            if not ns_dir.name.startswith("."):
                removed += sum(1 for _ in self._entries(ns_dir))
            _remove(ns_dir, self.root)
        logs.log("cache", "cleared %d entries under %s", removed, self.root)
        return removed

    def info(self) -> dict:
        """``{"root", "enabled", "namespaces": {name: {"entries", "bytes"}}}`` for every
        namespace under the root (this one always listed)."""
        namespaces: dict[str, dict[str, int]] = {self.namespace: {"entries": 0, "bytes": 0}}
        try:
            dirs = [d for d in os.scandir(self.root) if d.is_dir(follow_symlinks=False)]
        except OSError:
            dirs = []
        for d in dirs:
            if d.name.startswith("."):
                continue
            entries = list(self._entries(Path(d.path)))
            namespaces[d.name] = {
                "entries": len(entries),
                "bytes": sum(_tree_bytes(e) for e in entries),
            }
        return {"root": str(self.root), "enabled": self.readable, "namespaces": namespaces}


# --------------------------------------------------------------------------------------------
# The whole root: what tilefuse owns there (`tilefuse cache info|clear`)
# --------------------------------------------------------------------------------------------

#: the directories tilefuse writes under the root, and what they hold, in words
OWNED_DIRS = {
    "triton": "generated Triton kernels (source)",  # backends/triton/launcher.py
    "cpu": "generated C++ kernels (source and shared library)",  # backends/cpu/launcher.py
    "tune": "tuning results: the schedule chosen per kernel and shape",  # tune/cache.py
    "tune-ceilings": "measured bandwidth and compute ceilings of each GPU",  # tune/tuner.py
    "triton-bin": "Triton's compiled binaries, written by older tilefuse versions (Triton now keeps its own)",
    "repro": "reproducer scripts of failed compiles",  # check/failure.py
}
#: the OWNED_DIRS that are DiskCache namespaces (the entry layout of the module docstring)
NAMESPACES = ("triton", "cpu", "tune", "tune-ceilings")


@dataclass
class RootItem:
    """One thing directly under the cache root."""

    name: str
    what: str  # what it holds, in words ("" when it is not tilefuse's)
    owned: bool  # tilefuse's: removed by clear_root
    entries: int = 0  # cache entries of a namespace; files and directories of another directory
    bytes: int = 0  # everything in it: entries, locks, temporary files
    oldest: float | None = None  # modification times of its entries (seconds since the epoch)
    newest: float | None = None
    note: str = ""  # why it is left alone, or what could not be removed


def root_problem(root: str | os.PathLike | None = None) -> str | None:
    """Why the cache refuses to load from the root (see the module docstring), or None."""
    try:
        reason = _insecure_reason(_root_path(root))
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be inspected ({e})"
    return f"it {reason}" if reason else None


def root_contents(root: str | os.PathLike | None = None) -> list[RootItem]:
    """Everything directly under the cache root (``config.cache_dir`` by default), by name,
    tilefuse's or not. Creates nothing; empty when the root does not exist."""
    path = _root_path(root)
    try:
        found = sorted(os.scandir(path), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [_describe(e) for e in found]


def clear_root(root: str | os.PathLike | None = None) -> list[RootItem]:
    """Remove everything tilefuse owns under the cache root: every namespace, the other
    directories of :data:`OWNED_DIRS`, a namespace of another version, leftovers of an
    interrupted clear. Returns them as they were before removal (entries and bytes removed;
    ``note`` says what could not be removed). Anything else, and every symbolic link, is left
    alone: nothing outside the root is ever touched.

    The cache has no lock over a whole namespace (readers take none): each directory is first
    renamed out of the way in one step, so a concurrent compile finds a complete, verified
    entry or a miss (and rebuilds), never a half-deleted one; then it is deleted by
    ``shutil.rmtree``, which does not follow symbolic links. Never raises on I/O errors.
    """
    path = _root_path(root)
    removed = []
    for item in root_contents(path):
        if not item.owned:
            continue
        errors = _remove(path / item.name, path)
        if errors is None:
            continue  # removed meanwhile
        if errors:
            item.note = f"not everything could be removed: {errors[0]}"
        removed.append(item)
    logs.log("cache", "cleared %s under %s", ", ".join(i.name for i in removed) or "nothing", path)
    return removed


def _root_path(root: str | os.PathLike | None) -> Path:
    if root is None:
        from ..config import config

        root = config.cache_dir
    return Path(os.path.abspath(os.path.expanduser(os.fspath(root))))


def _describe(entry: os.DirEntry) -> RootItem:
    name, path = entry.name, Path(entry.path)
    try:
        if entry.is_symlink():
            return RootItem(name, OWNED_DIRS.get(name, ""), False, note="a symbolic link: not followed")
        if not entry.is_dir(follow_symlinks=False):
            return RootItem(name, "", False, note="not tilefuse's")
        if name.startswith(_TRASH_PREFIX):
            item = RootItem(name, "left over from an interrupted clear", True)
            children = [path]
        elif name in NAMESPACES or (name not in OWNED_DIRS and _looks_like_namespace(path)):
            item = RootItem(name, OWNED_DIRS.get(name, "cache entries of another tilefuse version"), True)
            children = list(_namespace_entries(path))
        elif name in OWNED_DIRS:
            item = RootItem(name, OWNED_DIRS[name], True)
            children = [Path(c.path) for c in os.scandir(path) if not c.name.startswith(".")]
        else:
            return RootItem(name, "", False, note="not tilefuse's")
    except OSError as e:
        return RootItem(name, OWNED_DIRS.get(name, ""), False, note=f"cannot be read ({e})")
    times = []
    for child in children:
        try:
            times.append(os.lstat(child).st_mtime)
        except OSError:
            pass
    item.entries = 0 if name.startswith(_TRASH_PREFIX) else len(children)
    item.bytes = _tree_bytes(path)
    item.oldest, item.newest = (min(times), max(times)) if times else (None, None)
    return item


def _looks_like_namespace(path: Path) -> bool:
    """Laid out as a namespace: only two-character shards, holding ``<key>`` directories and
    ``<key>.lock`` files whose names start with the shard's."""
    try:
        shards = [d for d in os.scandir(path) if not d.name.startswith(".")]
        for shard in shards:
            if len(shard.name) != 2 or not shard.is_dir(follow_symlinks=False):
                return False
            for child in os.scandir(shard.path):
                key = child.name[:-5] if child.name.endswith(".lock") else child.name
                if not (key.startswith(shard.name) and _KEY_RE.fullmatch(key)):
                    return False
    except OSError:
        return False
    return bool(shards)


def _remove(path: Path, trash_dir: Path) -> list[str] | None:
    """Delete a directory tree so that no reader sees it half-deleted: first renamed in one step
    to a `.trash-*` name in `trash_dir` (in place when that fails; a `.trash-*` directory is
    deleted where it is), then deleted without following symbolic links. Returns the errors met,
    as text, or None when the tree was already gone."""
    target = path
    if not path.name.startswith(_TRASH_PREFIX):
        trash = trash_dir / f"{_TRASH_PREFIX}{path.name}-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            os.rename(path, trash)
            target = trash
        except FileNotFoundError:
            return None
        except OSError:
            pass  # delete in place
    return _rmtree(target)


def _rmtree(path: Path) -> list[str]:
    """Delete a tree without following symbolic links; the errors met, as text."""
    errors: list[str] = []

    def record(_func, where, exc):
        exc = exc[1] if isinstance(exc, tuple) else exc  # onerror passes exc_info
        errors.append(f"{where}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}")

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=record)
    else:
        shutil.rmtree(path, onerror=record)
    return errors


def _namespace_entries(ns_dir: Path):
    """The entry directories of a namespace (``<shard>/<key>``), never through a symlink."""
    try:
        shards = list(os.scandir(ns_dir))
    except OSError:
        return
    for shard in shards:
        if shard.name.startswith(".") or not shard.is_dir(follow_symlinks=False):
            continue
        try:
            children = list(os.scandir(shard.path))
        except OSError:
            continue
        for child in children:
            if not child.name.startswith(".") and child.is_dir(follow_symlinks=False):
                yield Path(child.path)


def _valid_name(name: Any) -> bool:
    return isinstance(name, str) and name != MANIFEST and bool(_FILENAME_RE.fullmatch(name))


def _check_files(files: Any) -> dict[str, bytes]:
    """Validate a ``{name: bytes}`` mapping (a programming error raises, not an I/O one)."""
    if not isinstance(files, dict):
        raise TypeError(f"cache entries are dict[str, bytes], got {type(files).__name__}")
    out = {}
    for name, data in files.items():
        if not _valid_name(name):
            raise ValueError(
                f"invalid cache file name {name!r}: a plain name (letters, digits, '._+-', "
                f"not starting with '.'), other than {MANIFEST!r}"
            )
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"cache file {name!r} must be bytes, got {type(data).__name__}")
        out[name] = bytes(data)
    return out
