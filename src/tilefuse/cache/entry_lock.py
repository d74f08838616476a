"""The lock one cache entry is built under, across processes.

``<entry>.lock`` is locked with ``flock`` (released by the kernel when its holder dies, so a
killed build never leaves a stale lock) and holds the holder's pid, so that a process waiting
for it can say whom it waits for. A wait longer than :data:`NOTICE_AFTER_S` is reported once
(which entry, which process); after ``timeout`` seconds (``config.cache_lock_timeout``) the
waiter gives up and builds the entry itself. The lock file is opened without following a link
and must be a regular file of this user's.
"""
from __future__ import annotations

import errno
import os
import time
from typing import Callable

from . import trust

try:
    import fcntl
except ImportError:  # not POSIX: entries are built without a lock
    fcntl = None  # type: ignore[assignment]

#: a wait longer than this is reported (seconds)
NOTICE_AFTER_S = 5.0

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


class EntryLock:
    """A held lock; :meth:`release` unlocks it."""

    def __init__(self, fd: int):
        self.fd = fd

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            os.ftruncate(self.fd, 0)  # no holder named any more
        except OSError:
            pass
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)
            self.fd = -1


def holder(path: str | os.PathLike) -> int | None:
    """The pid written into a lock file by its holder (None when unknown)."""
    try:
        text = trust.read(path)[:32].decode("ascii", "replace").split()
        return int(text[0]) if text else None
    except (OSError, ValueError):
        return None


def acquire(path: str | os.PathLike, timeout: float, what: str,
            notice: Callable[[str], None]) -> EntryLock | None:
    """Lock ``path`` (created if missing), waiting up to ``timeout`` seconds for another
    holder; None when the lock cannot be had (no ``flock``, the wait timed out). ``notice``
    is called once with a message when the wait passes :data:`NOTICE_AFTER_S`. Raises OSError
    when the lock file cannot be opened or is not trusted."""
    if fcntl is None:
        return None
    fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
    try:
        why = trust.problem(os.fstat(fd), "file")
        if why is not None:
            raise trust.UntrustedFile(errno.EPERM, why, os.fspath(path))
        start, told, pause = time.monotonic(), False, 0.005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            waited = time.monotonic() - start
            if waited >= timeout:
                os.close(fd)
                return None
            if not told and waited >= min(NOTICE_AFTER_S, timeout / 2):
                told = True
                pid = holder(path)
                by = f"process {pid}" if pid else "another process"
                notice(f"waiting for {by}, which is building {what} (lock {os.fspath(path)}); "
                       f"building it here if it is not done in {timeout:g} s "
                       "(TILEFUSE_CACHE_LOCK_TIMEOUT)")
            time.sleep(min(pause, max(0.0, timeout - waited)))
            pause = min(pause * 2, 0.25)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return EntryLock(fd)
    except BaseException:
        try:
            os.close(fd)
        except OSError:
            pass
        raise


def remove_if_free(path: str | os.PathLike) -> bool:
    """Delete a lock file of this user's that no process holds (True); leave it otherwise."""
    try:
        fd = os.open(path, os.O_RDWR | _NOFOLLOW)
    except OSError:
        return False
    try:
        if trust.problem(os.fstat(fd), "file", modes=False) is not None:
            return False
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
