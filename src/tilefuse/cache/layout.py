"""The disk cache's layout: which names under the root are tilefuse's, and how a tree is removed.

``<namespace>/<key[:2]>/<key>/`` is an entry when it is a real directory holding a
``manifest.json`` that names ``key``: only such entries (with their ``<key>.lock`` files, and
the ``.tmp-*`` and ``.trash-*`` directories tilefuse makes while writing and deleting) are
tilefuse's. Whatever else a user keeps there is not, and is never removed.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Iterator

from . import trust

MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
NAMESPACE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")
KEY_RE = re.compile(r"[A-Za-z0-9_-]{2,200}")
FILENAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,199}")
# leftovers of a killed writer or deleter (group 1: the pid in names this version writes)
TMP_NAMES = re.compile(r"\.tmp-(?:(\d+)-)?[a-z0-9_]{8}")
TRASH_NAMES = re.compile(r"\.trash-.*?(?:-(\d+))?-[0-9a-f]{8}")
_MANIFEST_MAX_BYTES = 1 << 20


def tmp_prefix() -> str:
    """The name prefix of a directory this process writes an entry into."""
    return f"{TMP_PREFIX}{os.getpid()}-"


def entry_key(path: str | os.PathLike) -> str | None:
    """The key of the entry at ``path`` when it is one tilefuse wrote (a real directory of
    this user's whose manifest, a file of this user's, names its key), else None. Neither
    modes nor the manifest's format are checked: this says what may be deleted, not what may
    be loaded, and entries of other versions count."""
    path = Path(path)
    key = path.name
    if not (KEY_RE.fullmatch(key) and key.startswith(path.parent.name) and len(path.parent.name) == 2):
        return None
    try:
        if trust.path_problem(path, modes=False) is not None:
            return None
        raw = trust.read(path / MANIFEST, modes=False)
        if len(raw) > _MANIFEST_MAX_BYTES:
            return None
        manifest = json.loads(raw)
    except (OSError, ValueError):
        return None
    return key if isinstance(manifest, dict) and manifest.get("key") == key else None


def shards(ns_dir: str | os.PathLike) -> Iterator[Path]:
    """The two-character shard directories of a namespace, never through a link."""
    try:
        found = list(os.scandir(Path(ns_dir)))
    except OSError:
        return
    for shard in found:
        if len(shard.name) == 2 and not shard.name.startswith(".") and shard.is_dir(follow_symlinks=False):
            yield Path(shard.path)


def namespace_entries(ns_dir: str | os.PathLike) -> Iterator[Path]:
    """The entry-shaped directories of a namespace (``<shard>/<key>``), never through a link;
    :func:`entry_key` tells which of them tilefuse wrote."""
    for shard in shards(ns_dir):
        try:
            children = list(os.scandir(shard))
        except OSError:
            continue
        for child in children:
            if not child.name.startswith(".") and child.is_dir(follow_symlinks=False):
                yield Path(child.path)


def looks_like_namespace(path: str | os.PathLike) -> bool:
    """Laid out as a namespace: only two-character shards, holding ``<key>`` directories and
    ``<key>.lock`` files whose names start with the shard's."""
    try:
        found = [d for d in os.scandir(Path(path)) if not d.name.startswith(".")]
        for shard in found:
            if len(shard.name) != 2 or not shard.is_dir(follow_symlinks=False):
                return False
            for child in os.scandir(shard.path):
                key = child.name[:-5] if child.name.endswith(".lock") else child.name
                if not (key.startswith(shard.name) and KEY_RE.fullmatch(key)):
                    return False
    except OSError:
        return False
    return bool(found)


def tree_bytes(path: str | os.PathLike) -> int:
    """Bytes of the files under ``path`` (or of ``path`` itself), links not followed."""
    try:
        if not os.path.isdir(path) or os.path.islink(path):
            return os.lstat(path).st_size
    except OSError:
        return 0
    total = 0
    for dirpath, _dirs, files in os.walk(Path(path)):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def remove(path: Path, trash_dir: Path) -> list[str] | None:
    """Delete a directory tree so that no reader sees it half-deleted: first renamed in one step
    to a `.trash-*` name in `trash_dir` (in place when that fails; a `.trash-*` directory is
    deleted where it is), then deleted without following symbolic links (a link is removed,
    never what it points to). Returns the errors met, as text, or None when the tree was
    already gone."""
    target = path
    if not path.name.startswith(TRASH_PREFIX):
        trash = trash_dir / f"{TRASH_PREFIX}{path.name}-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            os.rename(path, trash)
            target = trash
        except FileNotFoundError:
            return None
        except OSError:
            pass  # delete in place
    if os.path.islink(target) or not os.path.isdir(target):
        try:
            os.unlink(target)
        except FileNotFoundError:
            return None
        except OSError as e:
            return [f"{target}: {e.strerror or e}"]
        return []
    return rmtree(target)


def rmtree(path: Path) -> list[str]:
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
