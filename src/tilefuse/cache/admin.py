"""What tilefuse keeps under the cache root, listed and cleared (`tilefuse cache info|clear`).

Each directory tilefuse writes under the root (:data:`OWNED_DIRS`) holds one kind of thing;
only those things are tilefuse's: in a namespace, the entries whose manifest names their key
(with their lock files and the ``.tmp-*``/``.trash-*`` directories of interrupted writes and
deletes), in ``repro/`` the ``repro_*.py`` scripts, in ``triton-bin/`` Triton's cache
directories. Each must be this user's and is never reached through a link. Everything else,
in those directories or beside them, is left alone and counted. A root the cache refuses to
use (see :func:`root_problem`) is not cleared at all: what is in it may not be tilefuse's.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .. import logs
from . import entry_lock, layout, trust

#: the directories tilefuse writes under the root, and what they hold, in words
OWNED_DIRS = {
    "triton": "generated Triton kernels (source)",  # backends/triton/launcher.py
    "cpu": "generated C++ kernels (source and shared library)",  # backends/cpu/launcher.py
    "tune": "tuning results: the schedule chosen per kernel and shape",  # tune/cache.py
    "tune-ceilings": "measured bandwidth and compute ceilings of each GPU",  # tune/tuner.py
    "triton-binaries": "where Triton keeps each launched kernel's binary, and what it was compiled for",  # backends/triton/binaries.py
    "graphs": "compiled graphs: steps, launch settings and reports (kernels are in triton/ and cpu/)",  # graph_cache.py
    "front": "Dynamo graphs' entries to compiled graphs, before AOTAutograd (inference)",  # front_cache.py
    "triton-bin": "Triton's compiled binaries, written by older tilefuse versions (Triton now keeps its own)",
    "repro": "reproducer scripts of failed compiles",  # failure.py
}
#: the OWNED_DIRS that are DiskCache namespaces (the entry layout of disk.py's docstring)
NAMESPACES = ("triton", "cpu", "tune", "tune-ceilings", "graphs", "front", "triton-binaries")
#: files tilefuse keeps directly in the root
OWNED_FILES = {".size-checked": "when the cache's size was last measured"}  # size_bound.py

_REPRO = re.compile(r"repro_[A-Za-z0-9_.-]*\.py")


@dataclass
class RootItem:
    """One thing directly under the cache root."""

    name: str
    what: str  # what it holds, in words ("" when it is not tilefuse's)
    owned: bool  # tilefuse's: what of it is tilefuse's is removed by clear_root
    entries: int = 0  # cache entries of a namespace; files or directories tilefuse wrote in another
    bytes: int = 0  # of what is tilefuse's in it (entries, locks, temporary files)
    oldest: float | None = None  # modification times of its entries (seconds since the epoch)
    newest: float | None = None
    note: str = ""  # why it is left alone, or what could not be removed
    left: int = 0  # things in it that are not tilefuse's (never removed)
    errors: int = 0  # things of tilefuse's that clear_root could not remove


def root_path(root: str | os.PathLike | None) -> Path:
    if root is None:
        from ..config import config

        root = config.cache_dir
    return Path(os.path.abspath(os.path.expanduser(os.fspath(root))))


def root_problem(root: str | os.PathLike | None = None) -> str | None:
    """Why the cache refuses to use the root (another user's, or writable by others), or
    None (also when it does not exist yet: it is created private)."""
    try:
        reason = trust.problem(os.stat(root_path(root)))  # the root itself may be a link
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be inspected ({e})"
    return f"it {reason}" if reason else None


def root_contents(root: str | os.PathLike | None = None) -> list[RootItem]:
    """Everything directly under the cache root (``config.cache_dir`` by default), by name,
    tilefuse's or not, with what of it is tilefuse's. Creates nothing; empty when the root
    does not exist."""
    path = root_path(root)
    try:
        found = sorted(os.scandir(path), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [_inventory(e)[0] for e in found]


def clear_root(root: str | os.PathLike | None = None) -> list[RootItem]:
    """Remove what is tilefuse's under the cache root (see the module docstring); returns each
    directory (or file) it was found in, with the entries and bytes removed (``note`` says
    what could not be removed, ``left`` counts what was not tilefuse's). Nothing else is
    touched, no link is followed, and a root the cache refuses is left as it is (returns []).

    The cache has no lock over a whole namespace (readers take none): each entry is first
    renamed out of the way in one step, so a concurrent compile finds a complete, verified
    entry or a miss (and rebuilds), never a half-deleted one. Never raises on I/O errors.
    """
    path = root_path(root)
    if root_problem(path) is not None:
        logs.log("cache", "not clearing %s: %s", path, root_problem(path))
        return []
    try:
        found = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError:
        return []
    cleared = []
    for e in found:
        item, ours = _inventory(e)
        if not item.owned:
            continue
        item.entries = item.bytes = 0
        errors: list[str] = []
        real_dir = e.is_dir(follow_symlinks=False) and not e.name.startswith(layout.TRASH_PREFIX)
        for thing, kind in ours:
            size = layout.tree_bytes(thing)
            problems = _remove(thing, kind, Path(e.path) if real_dir else path)
            if problems is None:
                continue
            errors += problems
            if not problems:
                item.bytes += size
                item.entries += kind in ("entry", "file")
        if real_dir:
            _remove_empty(Path(e.path))
        if errors:
            item.errors = len(errors)
            item.note = f"not everything could be removed: {errors[0]}"
        cleared.append(item)
    logs.log("cache", "cleared %s under %s", ", ".join(f"{i.name} ({i.entries})" for i in cleared) or "nothing", path)
    return cleared


def clear_namespace(ns_dir: Path) -> int:
    """Remove the entries tilefuse wrote in one namespace directory; returns how many."""
    removed = 0
    for thing, kind in _namespace_things(ns_dir)[0]:
        if _remove(thing, kind, ns_dir) == [] and kind == "entry":
            removed += 1
    _remove_empty(ns_dir)
    return removed


# ------------------------------------------------------------------------------ inventory


def _inventory(entry: os.DirEntry) -> tuple[RootItem, list[tuple[Path, str]]]:
    """The item for one thing under the root, and what in it is tilefuse's: (path, kind) with
    kind "entry", "lock", "file" or "leftover"."""
    name, path = entry.name, Path(entry.path)
    try:
        if entry.is_symlink():
            return RootItem(name, OWNED_DIRS.get(name, ""), False, note="a symbolic link: not followed"), []
        if not entry.is_dir(follow_symlinks=False):
            if name in OWNED_FILES and trust.path_problem(path, "file", modes=False) is None:
                item = RootItem(name, OWNED_FILES[name], True, bytes=entry.stat(follow_symlinks=False).st_size)
                return item, [(path, "leftover")]
            return RootItem(name, "", False, note="not tilefuse's"), []
        if name.startswith(layout.TRASH_PREFIX):
            item = RootItem(name, "left over from an interrupted clear", True)
            ours = [(path, "leftover")] if _mine(path) else []
            item.left = 1 - len(ours)
        elif name in NAMESPACES or (name not in OWNED_DIRS and layout.looks_like_namespace(path)):
            item = RootItem(name, OWNED_DIRS.get(name, "cache entries of another tilefuse version"), True)
            ours, item.left = _namespace_things(path)
        elif name == "repro":
            item = RootItem(name, OWNED_DIRS[name], True)
            ours, item.left = _plain_things(path, lambda c: _REPRO.fullmatch(c.name) is not None, "file")
        elif name == "triton-bin":
            item = RootItem(name, OWNED_DIRS[name], True)
            ours, item.left = _plain_things(path, _is_triton_entry, "file")
        else:
            return RootItem(name, "", False, note="not tilefuse's"), []
    except OSError as e:
        return RootItem(name, OWNED_DIRS.get(name, ""), False, note=f"cannot be read ({e})"), []
    times = []
    for thing, kind in ours:
        if kind in ("entry", "file"):
            item.entries += 1
            try:
                times.append(os.lstat(thing).st_mtime)
            except OSError:
                pass
        item.bytes += layout.tree_bytes(thing)
    item.oldest, item.newest = (min(times), max(times)) if times else (None, None)
    if item.left:
        item.note = f"{item.left} thing{'s' if item.left != 1 else ''} in it not tilefuse's: left alone"
    return item, ours


def _mine(path: Path, kind: str = "directory") -> bool:
    try:
        return trust.path_problem(path, kind, modes=False) is None
    except OSError:
        return False


def _namespace_things(ns_dir: Path) -> tuple[list[tuple[Path, str]], int]:
    """What of a namespace directory tilefuse wrote, and how many other things it holds."""
    ours: list[tuple[Path, str]] = []
    left = 0
    for child in _scan(ns_dir):
        p = Path(child.path)
        if child.name.startswith((layout.TMP_PREFIX, layout.TRASH_PREFIX)) and _mine(p):
            ours.append((p, "leftover"))
        elif not (len(child.name) == 2 and child.is_dir(follow_symlinks=False) and _mine(p)):
            left += 1
    for shard in layout.shards(ns_dir):
        if not _mine(shard):
            continue  # counted above
        for child in _scan(shard):
            p = Path(child.path)
            if child.name.endswith(".lock") and layout.KEY_RE.fullmatch(child.name[:-5]) and _mine(p, "file"):
                ours.append((p, "lock"))
            elif child.is_dir(follow_symlinks=False) and layout.entry_key(p) is not None:
                ours.append((p, "entry"))
            else:
                left += 1
    return ours, left


def _plain_things(directory: Path, recognise, kind: str) -> tuple[list[tuple[Path, str]], int]:
    ours, left = [], 0
    if not _mine(directory):
        return [], sum(1 for _ in _scan(directory))
    for child in _scan(directory):
        p = Path(child.path)
        is_dir = child.is_dir(follow_symlinks=False)
        if child.is_symlink() or not _mine(p, "directory" if is_dir else "file"):
            left += 1
        elif child.name.startswith(layout.TRASH_PREFIX):
            ours.append((p, "leftover"))
        elif recognise(child):
            ours.append((p, kind))
        else:
            left += 1
    return ours, left


def _is_triton_entry(child: os.DirEntry) -> bool:
    """A directory of Triton's cache: named by a hash, holding a ``__grp__*.json`` file."""
    if not (child.is_dir(follow_symlinks=False) and re.fullmatch(r"[A-Za-z0-9_-]{16,128}", child.name)):
        return False
    return any(c.name.startswith("__grp__") and c.name.endswith(".json") for c in _scan(child.path))


def _scan(directory) -> list[os.DirEntry]:
    try:
        return list(os.scandir(directory))
    except OSError:
        return []


def _remove(thing: Path, kind: str, trash_dir: Path) -> list[str] | None:
    """Remove one thing of tilefuse's: a lock only when no process holds it."""
    if kind == "lock":
        return [] if entry_lock.remove_if_free(thing) else None
    return layout.remove(thing, trash_dir)


def _remove_empty(directory: Path) -> None:
    """Remove the shards left empty, and the directory itself when it is empty too."""
    for shard in layout.shards(directory):
        try:
            os.rmdir(shard)
        except OSError:
            pass
    try:
        os.rmdir(directory)
    except OSError:
        pass
