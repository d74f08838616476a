"""What tilefuse trusts on disk, and how it opens and creates files there.

Code that tilefuse loads (a generated module, a shared library) runs in the user's process, so
a file is trusted only when it, and every directory it is found through below the cache root,
is owned by this user, writable by no one else, and not a symbolic link. Files are read through
one descriptor opened without following a link and checked with ``fstat`` (no window between
the check and the read); new files are created with ``O_EXCL | O_NOFOLLOW``, never through a
link someone else planted.

Whose files count as ours is :func:`expected_uid`, and a file's owner :func:`owner`: tests
replace them to simulate another user's files.
"""
from __future__ import annotations

import errno
import os
import stat
import tempfile

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# a FIFO planted in place of a file must not block the open
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class UntrustedFile(OSError):
    """A file or directory that someone else could have written: never loaded."""


def expected_uid() -> int | None:
    """The user whose files are trusted (None where the platform has no owners)."""
    return os.geteuid() if hasattr(os, "geteuid") else None


def owner(st: os.stat_result) -> int:
    return st.st_uid


def problem(st: os.stat_result, kind: str = "directory", modes: bool = True) -> str | None:
    """Why a file with status ``st`` (from ``lstat``/``fstat``) is not trusted as a ``kind``
    ("directory" or "file"), or None. ``modes=False`` asks only whether it is ours (to delete
    it, not to load it)."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    wanted = stat.S_ISDIR if kind == "directory" else stat.S_ISREG
    if not wanted(st.st_mode):
        return f"is not a {'directory' if kind == 'directory' else 'regular file'}"
    uid = expected_uid()
    if uid is not None and owner(st) != uid:
        return f"is owned by uid {owner(st)}, not by this user (uid {uid})"
    if modes and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def path_problem(path: str | os.PathLike, kind: str = "directory", modes: bool = True) -> str | None:
    """:func:`problem` of ``path`` itself (a link is not followed); raises OSError (for
    instance FileNotFoundError) when it cannot be inspected."""
    return problem(os.lstat(path), kind, modes)


def read(path: str | os.PathLike, modes: bool = True) -> bytes:
    """The bytes of a trusted regular file; :class:`UntrustedFile` if it is not one (a link,
    a FIFO, another user's, writable by others), other OSErrors as ``open`` raises them."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | _NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise UntrustedFile(errno.ELOOP, "is a symbolic link", os.fspath(path)) from None
        raise
    try:
        why = problem(os.fstat(fd), "file", modes)
        if why is not None:
            raise UntrustedFile(errno.EPERM, why, os.fspath(path))
        chunks: list[bytes] = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


def create(path: str | os.PathLike, data: bytes, mode: int = 0o600) -> None:
    """Write a new file; FileExistsError if anything (a link included) is at ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)


def create_unique(directory: str, prefix: str, suffix: str, data: bytes) -> str:
    """Write ``data`` to a new file named ``<prefix>XXXXXXXX<suffix>`` in ``directory``
    (``mkstemp``: exclusive, private, no link followed); returns its path."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        os.unlink(path)
        raise
    return path


def private_makedirs(path: str | os.PathLike) -> None:
    """``os.makedirs(path)`` with every directory it creates private (0o700 whatever the umask:
    ``makedirs``' own mode applies to the last level only, and the umask filters it)."""
    path = os.path.abspath(os.fspath(path))
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue  # made by a concurrent process: its own mode, checked by the caller
        os.chmod(d, 0o700)


def private_dir(path: str | os.PathLike) -> str | None:
    """``path`` as a directory only this user can write, created (mode 0o700, parents
    included) when missing; None when it cannot be created or is not trusted (then write
    elsewhere: nothing there would be safe to read back)."""
    path = os.fspath(path)
    try:
        if not os.path.lexists(path):
            private_makedirs(path)
        return None if path_problem(path) else path
    except OSError:
        return None
