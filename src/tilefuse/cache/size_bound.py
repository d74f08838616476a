"""The disk cache's size bound: when the cache outgrows ``config.cache_max_bytes``, the entries
used longest ago are removed until it is back under :data:`LOW_WATER` of the bound.

An entry's last use is its manifest's modification time: set when the entry is written and
moved forward by a hit when it is older than :data:`TOUCH_AFTER_S`, so a hit writes nothing
more than once an hour. The cache is measured only by a process that wrote to it, and then at
most once per :data:`CHECK_EVERY_S` across processes (the time of ``<root>/.size-checked``)
unless this process alone wrote a tenth of the bound since its last check: lookups never pay
for the bound.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from . import layout

#: a hit moves an entry's last use forward when it is older than this (seconds)
TOUCH_AFTER_S = 3600.0
#: the cache is measured at most this often (seconds), across processes
CHECK_EVERY_S = 600.0
#: when over the bound, entries go until the cache is this fraction of it
LOW_WATER = 0.8
#: a file in the root whose modification time is the last measurement's
MARKER = ".size-checked"

_lock = threading.Lock()
_written: dict[str, int] = {}  # root -> bytes this process wrote since its last check


def touch(manifest: Path) -> None:
    """Record a use of the entry whose manifest is ``manifest``."""
    try:
        if time.time() - os.lstat(manifest).st_mtime > TOUCH_AFTER_S:
            os.utime(manifest)
    except OSError:
        pass


def wrote(root: Path, nbytes: int, limit: int) -> tuple[int, int]:
    """Note that ``nbytes`` were written under ``root``; enforce the bound ``limit`` (bytes; 0:
    none) when a check is due. Returns the entries and bytes removed."""
    if limit <= 0:
        return 0, 0
    with _lock:
        written = _written[str(root)] = _written.get(str(root), 0) + nbytes
    marker = root / MARKER
    try:
        recent = time.time() - os.lstat(marker).st_mtime < CHECK_EVERY_S
    except OSError:
        recent = False
    if recent and written < limit // 10:
        return 0, 0
    with _lock:
        _written[str(root)] = 0
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            os.utime(fd if os.utime in os.supports_fd else marker)
        finally:
            os.close(fd)
    except OSError:
        pass
    return enforce(root, limit)


def usage(root: Path) -> list[tuple[float, int, Path]]:
    """``(last use, bytes, path)`` of every entry tilefuse wrote under ``root``."""
    found: list[tuple[float, int, Path]] = []
    try:
        namespaces = [Path(d.path) for d in os.scandir(root)
                      if not d.name.startswith(".") and d.is_dir(follow_symlinks=False)]
    except OSError:
        return found
    for ns in namespaces:
        for entry in layout.namespace_entries(ns):
            try:
                used = os.lstat(entry / layout.MANIFEST).st_mtime
            except OSError:
                continue
            if layout.entry_key(entry) is not None:
                found.append((used, layout.tree_bytes(entry), entry))
    return found


def enforce(root: Path, limit: int) -> tuple[int, int]:
    """Remove the least recently used entries under ``root`` while it holds more than
    ``limit`` bytes, down to :data:`LOW_WATER` of it. Returns the entries and bytes removed."""
    entries = usage(root)
    total = sum(size for _, size, _ in entries)
    if total <= limit:
        return 0, 0
    removed = freed = 0
    for used, size, entry in sorted(entries, key=lambda e: e[0]):
        if total <= limit * LOW_WATER:
            break
        try:  # used meanwhile: keep it
            if os.lstat(entry / layout.MANIFEST).st_mtime > used:
                continue
        except OSError:
            continue
        if layout.remove(entry, entry.parent.parent) is not None:
            removed, freed, total = removed + 1, freed + size, total - size
    return removed, freed
