"""Temporary files: this process's private ones, and the sweep of those a killed one left.

Files that must exist outside the cache (a kernel's private copy when the cache is unusable, a
compile's working directory) live in the system's temporary directory under names that carry
the pid of the process that made them: ``tilefuse-scratch-<pid>-*`` (:func:`scratch_dir`,
removed at exit) and ``tilefuse-cpp-<pid>-*`` (a C++ compile, removed when it ends). A process
killed meanwhile leaves them behind, as it leaves ``.tmp-*`` entries being written in the cache;
:func:`sweep` removes such leftovers: only ours (owned by this user, never through a link),
only old ones (untouched for :data:`STALE_AFTER_S`), and never one whose process still runs.
The names older versions used (``tilefuse_XXXXXXXX.so``, ``tilefuse-cpp-XXXXXXXX``) are swept
by age alone.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from typing import Iterator

from . import trust

#: a leftover untouched this long (seconds) may be swept
STALE_AFTER_S = 3600.0

# what tilefuse leaves in the temporary directory; group 1 is the pid where there is one
TEMP_NAMES = re.compile(r"tilefuse-(?:scratch|cpp)-(\d+)-[a-z0-9_]{8}"
                        r"|tilefuse-cpp-[a-z0-9_]{8}|tilefuse_[a-z0-9_]{8}\.so")

_lock = threading.Lock()
_dir: tuple[int, str] | None = None  # (pid, path) of this process's scratch directory
_swept: set[str] = set()  # directories swept by this process


def scratch_dir() -> str:
    """This process's private temporary directory (mode 0o700), removed when it exits."""
    global _dir
    with _lock:
        # a forked child makes its own; one removed meanwhile (a cleaned /tmp) is made again
        if _dir is None or _dir[0] != os.getpid() or not os.path.isdir(_dir[1]):
            path = tempfile.mkdtemp(prefix=f"tilefuse-scratch-{os.getpid()}-")
            _dir = (os.getpid(), path)
            atexit.register(_remove_at_exit, os.getpid(), path)
        return _dir[1]


def _remove_at_exit(pid: int, path: str) -> None:
    if os.getpid() == pid:  # not a forked child's exit
        shutil.rmtree(path, ignore_errors=True)


def keep_file(data: bytes, suffix: str) -> str:
    """A private copy of ``data`` that lives as long as this process (to import from)."""
    return trust.create_unique(scratch_dir(), "k", suffix, data)


@contextlib.contextmanager
def private_copy(data: bytes, suffix: str) -> Iterator[str]:
    """A private copy of ``data``, deleted when the block ends (``dlopen`` it inside)."""
    path = trust.create_unique(scratch_dir(), "k", suffix, data)
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process (or a pid we cannot judge): assume it runs
    return True


def is_stale(path: str, pid: int | None, now: float | None = None) -> bool:
    """Ours, not a link, old, and its process (when its name says which) gone."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    uid = trust.expected_uid()
    if (uid is not None and trust.owner(st) != uid) or stat.S_ISLNK(st.st_mode):
        return False
    now = time.time() if now is None else now
    if now - st.st_mtime < STALE_AFTER_S:
        return False
    return pid is None or not _alive(pid)


def remove(path: str) -> None:
    """Delete a file or a tree, never following a link; errors ignored."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass


def sweep(directory: str | None = None, pattern: re.Pattern | None = None) -> list[str]:
    """Remove stale leftovers named like ``pattern`` (group 1: a pid, when there is one)
    directly in ``directory`` (the temporary directory and tilefuse's names by default), once
    per process and directory. Returns what was removed."""
    directory = tempfile.gettempdir() if directory is None else directory
    pattern = TEMP_NAMES if pattern is None else pattern
    key = f"{directory}\0{pattern.pattern}"
    with _lock:
        if key in _swept:
            return []
        _swept.add(key)
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        match = pattern.fullmatch(name)
        if match is None:
            continue
        pid = int(match.group(1)) if match.lastindex and match.group(1) else None
        path = os.path.join(directory, name)
        if is_stale(path, pid, now):
            remove(path)
            removed.append(path)
    return removed
