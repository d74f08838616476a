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
        <key[:2]>/<key>.lock             lock used by get_or_create (holds its holder's pid)
        .tmp-<pid>-*                     entries being written (renamed into place)
        .trash-*                         entries being deleted
      repro/, tune-ceilings/             other directories tilefuse writes (see OWNED_DIRS)
      .size-checked                      when the size bound was last enforced

:func:`root_contents` and :func:`clear_root` (``admin.py``) list and clear what tilefuse
wrote under the root (``tilefuse cache info|clear``); anything else there is left alone.
``layout.py`` says which names are tilefuse's, ``entry_lock.py`` how an entry is locked,
``size_bound.py`` how the cache stays under ``config.cache_max_bytes``, ``trust.py`` which
files may be loaded.

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
  lookup is a miss — the caller rebuilds. Corrupt data is never returned. (The checksums sit
  beside the files: they catch corruption, not tampering; what stops tampering is below.)
* **Atomic and concurrent-safe writes.** An entry is written to a temporary directory inside
  the namespace, fsynced, then renamed into place in one step; if another process already
  published a valid entry, theirs is kept. :meth:`DiskCache.get_or_create` holds a lock per
  key so that concurrent processes compiling the same kernel build it once; a wait of more
  than a few seconds says which process it waits for, and gives up after
  ``config.cache_lock_timeout`` seconds (then this process builds it too).
* **The cache is optional.** I/O errors (read-only directory, disk full, permissions) never
  raise: a :class:`CacheWarning` is issued once and compilation goes on without the cache.
* **Plain files only.** Entries are source, JSON and shared libraries; nothing is pickled.
* **Bounded.** Past ``config.cache_max_bytes`` the least recently used entries are removed.

Security: a cache directory that other users can write lets them plant code (a generated
Python module, a shared library) that then runs inside your process. The root is therefore
created with mode 0o700. If it already exists and is writable by group or others, or is owned
by another user, the cache warns once and refuses to *load* from it (every lookup is a miss);
it does not write there either, as nothing written could be trusted back. Fix it with
``chmod 700 <root>`` or point ``TILEFUSE_CACHE_DIR`` elsewhere. Below the root, everything an
entry is read from (namespace, shard, entry directory, each file) must be this user's, not
writable by group or others, and not a symbolic link; files are read through a descriptor
opened without following links and checked with ``fstat``. A namespace or shard that fails is
refused as the root is (lookups miss, nothing is written there, one warning); an entry that
fails is never loaded: it is discarded (one warning) and rebuilt.

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
import shutil
import stat
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

from .. import logs
from .._version import __version__
from ..config import config
from ..errors import CacheWarning
from . import entry_lock, scratch, size_bound, trust
from . import layout
from .admin import NAMESPACES, OWNED_DIRS, RootItem, clear_root, root_contents, root_problem
from .layout import MANIFEST

__all__ = [
    "CacheWarning",
    "DiskCache",
    "FORMAT_VERSION",
    "NAMESPACES",
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

# (root, problem) pairs already warned about: each problem is reported once per process.
_warned: set[tuple[str, str]] = set()


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
    fp: dict[str, str] = {
        "tilefuse": __version__,
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
    """A new private file (0o600 whatever the umask: loads refuse group- or other-writable
    files), never through a link, synced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _foreign_link(path: str) -> tuple[str, str] | None:
    """(link, why) for the first symbolic link on the way to `path` that another user owns
    (they could point it elsewhere at any time); None when there is none."""
    uid = trust.expected_uid()
    if uid is None:
        return None
    parts = Path(path).parts
    for i in range(2, len(parts) + 1):
        p = os.path.join(*parts[:i])
        try:
            st = os.lstat(p)
        except OSError:
            return None  # does not exist (yet): nothing below it is a link
        if stat.S_ISLNK(st.st_mode) and trust.owner(st) != uid:
            return p, f"is a symbolic link owned by another user (uid {trust.owner(st)})"
    return None


def _below_root_problem(path: Path) -> str | None:
    """Why a directory below the root (a namespace, a shard) is not trusted; None when it is,
    or does not exist yet (it will be created private)."""
    try:
        return trust.path_problem(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be inspected ({e})"


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
        if not isinstance(namespace, str) or not layout.NAMESPACE_RE.fullmatch(namespace):
            raise ValueError(f"invalid cache namespace {namespace!r}: use letters, digits, '._-'")
        if root is None:
            root = config.cache_dir
        self.namespace = namespace
        given = os.path.abspath(os.path.expanduser(os.fspath(root)))
        # links resolved once, here: the root is then a fixed directory, and a link someone else
        # retargets after the checks below cannot swap it for theirs
        self._link_problem = _foreign_link(given)
        self.root = Path(os.path.realpath(given))
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
        scratch.sweep()  # what killed processes left in the temporary directory
        if self._link_problem is not None:
            self.readable = self.writable = False
            link, why = self._link_problem
            self._warn("insecure", f"refusing to use the cache directory {link}: it {why}, who could point "
                       "it at their own files; set TILEFUSE_CACHE_DIR to a private directory")
            return
        created = not self.root.exists()
        try:
            if created:
                trust.private_makedirs(self.root)
            reason, where = trust.problem(os.stat(self.root)), self.root
            if reason is None:
                reason, where = _below_root_problem(self.dir), self.dir
        except OSError as e:
            # Cannot create (read-only parent, ...): nothing to read, nothing can be written.
            self.readable = self.writable = False
            self._warn("setup", f"cannot use cache directory {self.root} ({e}); compiling without it")
            return
        if reason is not None:
            self.readable = False
            self.writable = False
            self._refuse_message("insecure", where, reason)
            return
        scratch.sweep(str(self.dir), layout.TMP_NAMES)  # entries a killed process was writing
        scratch.sweep(str(self.dir), layout.TRASH_NAMES)
        scratch.sweep(str(self.root), layout.TRASH_NAMES)

    def _refuse_message(self, problem: str, where: Path, reason: str) -> None:
        self._warn(
            problem,
            f"refusing to load from {where}: it {reason}, so other users could plant code "
            f"that would run in this process. Run `chmod 700 {where}` (if everything in it is "
            "yours) or set TILEFUSE_CACHE_DIR to a private directory.",
        )

    def _chain_problem(self, entry: Path) -> tuple[Path, str] | None:
        """The first directory from the root down to ``entry``'s shard that is not trusted
        (root, namespace, shard), with why; None when all are (or do not exist yet)."""
        try:
            reason = trust.problem(os.stat(self.root))
        except FileNotFoundError:
            return None  # removed meanwhile: recreated private by the next write
        except OSError as e:
            return self.root, f"cannot be inspected ({e})"
        if reason is not None:
            return self.root, reason
        for where in (self.dir, entry.parent):
            reason = _below_root_problem(where)
            if reason is not None:
                return where, reason
        return None

    def _untrusted(self, entry: Path, reason: str) -> None:
        """An entry someone else could have written: never loaded; discarded so that it is
        rebuilt (its shard is trusted, so moving it out of the way is safe)."""
        self._warn("untrusted", f"refusing to load {entry}: {reason}; it is discarded and rebuilt")
        layout.remove(entry, entry.parent.parent)

    # -- paths -------------------------------------------------------------------------------

    def _entry_dir(self, key: str) -> Path:
        if not isinstance(key, str) or not layout.KEY_RE.fullmatch(key):
            raise ValueError(f"invalid cache key {key!r}: use cache_key(...) to make one")
        return self.dir / key[:2] / key

    def _lock_path(self, key: str) -> Path:
        entry = self._entry_dir(key)
        return entry.parent / (entry.name + ".lock")

    def path_of(self, key: str) -> Path | None:
        """The directory holding the files of a valid entry for ``key`` (to import a generated
        module or ``dlopen`` a library in place), or None when there is no valid entry or the
        cache is disabled — then write the bytes from :meth:`get_or_create` somewhere private.

        The entry is verified before its path is returned: its checksums, and that it and every
        directory above it up to the root are this user's, writable by no one else and not
        links. So the files stay valid afterwards: only this user can change them.
        """
        entry = self._entry_dir(key)
        if not self.readable:
            return None
        return entry if self._load(key) is not None else None

    # -- reading -----------------------------------------------------------------------------

    def _load(self, key: str) -> dict[str, bytes] | None:
        """Read and verify an entry without touching the counters; discard it if corrupt or
        untrusted."""
        entry = self._entry_dir(key)
        if not self.readable:
            return None
        refused = self._chain_problem(entry)
        if refused is not None:
            self._refuse_message("insecure", *refused)
            return None
        try:
            reason = trust.path_problem(entry)
        except FileNotFoundError:
            return None
        except OSError as e:
            logs.log("cache", "cannot read %s: %s", entry, e)
            return None
        if reason is not None:
            self._untrusted(entry, f"it {reason}")
            return None
        try:
            raw = trust.read(entry / MANIFEST)
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
                data = trust.read(entry / name)
                if len(data) != size:
                    raise ValueError(f"{name}: {len(data)} bytes, manifest says {size} (truncated?)")
                if _sha256(data) != digest:
                    raise ValueError(f"{name}: checksum mismatch (corrupt)")
                out[name] = data
        except trust.UntrustedFile as e:
            self._untrusted(entry, f"{os.path.basename(e.filename)} {e.strerror}")
            return None
        except FileNotFoundError as e:
            missing = "manifest missing" if os.path.basename(e.filename or "") == MANIFEST else str(e)
            self._discard(entry, missing)
            return None
        except (ValueError, KeyError, TypeError, IsADirectoryError) as e:
            self._discard(entry, str(e))
            return None
        except OSError as e:
            logs.log("cache", "cannot read %s: %s", entry, e)
            return None
        size_bound.touch(entry / MANIFEST)
        return out

    def _discard(self, entry: Path, why: str) -> None:
        """Remove a corrupt or stale entry: rename it out of sight (atomic), then delete it."""
        logs.log("cache", "discarding entry %s: %s", entry, why)
        layout.remove(entry, entry.parent.parent)

    def discard(self, key: str, why: str) -> None:
        """Remove the entry for ``key`` (one its user found stale), so that a later ``put``
        stores a new one; nothing where there is none."""
        entry = self._entry_dir(key)
        if entry.exists():
            self._discard(entry, why)

    def get(self, key: str) -> dict[str, bytes] | None:
        """The files of the entry for ``key``, verified; None on a miss, on a corrupt or
        untrusted entry (which is deleted) or when the cache is disabled."""
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
        refused = self._chain_problem(entry)
        if refused is not None:  # warned by _load
            return False
        tmp: Path | None = None
        try:
            trust.private_makedirs(entry.parent)
            tmp = Path(tempfile.mkdtemp(prefix=layout.tmp_prefix(), dir=self.dir))
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
        except OSError as e:
            self._warn(
                "write",
                f"cannot write to {self.dir} ({e.__class__.__name__}: {e}); compiling without the cache",
            )
            return False
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        removed, freed = size_bound.wrote(self.root, sum(len(d) for d in files.values()), config.cache_max_bytes)
        if removed:
            logs.log("cache", "over cache_max_bytes=%d: removed the %d least recently used entries (%d bytes)",
                     config.cache_max_bytes, removed, freed)
        return True

    def get_or_create(self, key: str, build: Callable[[], dict[str, bytes]]) -> dict[str, bytes]:
        """The entry for ``key``, built with ``build()`` and stored if absent or corrupt.

        Concurrent processes asking for the same key build it once: the first takes the lock
        ``<entry>.lock`` and builds, the others wait (up to ``config.cache_lock_timeout``
        seconds, saying so after a few) and then read its entry. If the lock cannot be created
        (read-only directory) or the wait times out, this builds without it. Exceptions from
        ``build`` propagate; cache I/O errors do not.
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

    def _acquire_lock(self, key: str) -> entry_lock.EntryLock | None:
        path = self._lock_path(key)
        if self._chain_problem(path) is not None:
            return None
        what = f"{self.namespace}/{key}"
        try:
            trust.private_makedirs(path.parent)
            lock = entry_lock.acquire(path, config.cache_lock_timeout, what, self._notice_wait)
        except OSError as e:
            logs.log("cache", "cannot lock %s (%s); building without the lock", path, e)
            return None
        if lock is None:
            logs.log("cache", "no lock on %s (timed out, or no flock); building %s without it", path, what)
        return lock

    def _notice_wait(self, message: str) -> None:
        logs.log("cache", "%s", message)
        warnings.warn(f"tilefuse cache: {message}", CacheWarning, stacklevel=4)

    # -- maintenance -------------------------------------------------------------------------

    def _namespace_dirs(self) -> list[Path]:
        try:
            found = [Path(d.path) for d in os.scandir(self.root)
                     if not d.name.startswith(".") and d.is_dir(follow_symlinks=False)]
        except OSError:
            return []
        return [d for d in found
                if d.name in NAMESPACES or d.name == self.namespace or layout.looks_like_namespace(d)]

    def clear(self, all_namespaces: bool = False) -> int:
        """Delete the entries tilefuse wrote in this namespace (in every namespace under the
        root with ``all_namespaces``), with their locks and leftover temporary directories;
        anything else is left alone, and so is a root the cache refuses. Returns the number of
        entries removed. Never raises on I/O errors."""
        if root_problem(self.root) is not None:
            return 0
        targets = self._namespace_dirs() if all_namespaces else [self.dir]
        from .admin import clear_namespace

        removed = sum(clear_namespace(ns_dir) for ns_dir in targets)
        logs.log("cache", "cleared %d entries under %s", removed, self.root)
        return removed

    def info(self) -> dict:
        """``{"root", "enabled", "namespaces": {name: {"entries", "bytes"}}}`` for every
        namespace under the root (this one always listed): the entries tilefuse wrote."""
        namespaces: dict[str, dict[str, int]] = {self.namespace: {"entries": 0, "bytes": 0}}
        for d in self._namespace_dirs():
            entries = [e for e in layout.namespace_entries(d) if layout.entry_key(e) is not None]
            namespaces[d.name] = {
                "entries": len(entries),
                "bytes": sum(layout.tree_bytes(e) for e in entries),
            }
        return {"root": str(self.root), "enabled": self.readable, "namespaces": namespaces}


# --------------------------------------------------------------------------------------------
# Entry files
# --------------------------------------------------------------------------------------------


def _valid_name(name: Any) -> bool:
    return isinstance(name, str) and name != MANIFEST and bool(layout.FILENAME_RE.fullmatch(name))


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
