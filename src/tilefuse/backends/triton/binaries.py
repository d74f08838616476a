"""A compiled kernel's binary found again in a new process without Triton's JIT.

A first launch through `JITFunction.run` asks Triton's `compile`, which keys its cache by a
hash that includes `triton_key()`: a hash of Triton's own sources and of its 100+ MB shared
library, computed once per process (0.4–0.6 s on a GPU host). A warm process that loads a
stored graph would pay it before its first kernel runs, although every binary it needs is on
disk. Inductor's warm path avoids it by launching the binaries it stored itself.

Here, after a kernel's first launch compiled or found its binary, tilefuse keeps a *record*
in its own cache: where Triton stored the binary and its metadata (Triton's cache group), the
SHA-256 of the binary and its metadata, and the signature, constants and attributes the JIT compiled for. The record
is keyed by the kernel's source, its launch options, the launch's specialisation (what Triton
specialises on, `direct_launch.specialisation`) with the tensors' dtypes, the environment
fingerprint (tilefuse, PyTorch, Triton and Python versions, the device), Triton's shared
library's size and modification time (a rebuilt Triton of the same version) and the
environment variables that invalidate Triton's cache. A new process with the same key builds
Triton's `CompiledKernel` from the record's files directly; its launcher is made by this
process's Triton from the binary's metadata, as on a cache hit. The binary's metadata must
name this device's target and the launch's warps and stages.

No records are used or made while a Triton knob changes what the JIT would build (debug mode,
instrumentation, an IR override or inspection hook, always compiling).

Trust: the record comes from tilefuse's private cache (see `cache.trust`); each file it names
must be a regular file of this user, writable by no one else, with the SHA-256 the record
holds. A record whose files are gone (a cleared Triton cache), changed or do not load is
discarded and the launch takes the JIT's way, which records again. Nothing is unpickled:
records are JSON, and a constant that is not a number, string, boolean or None makes no
record.
"""
from __future__ import annotations

import hashlib
import json
import os

from ... import logs
from ...cache import trust
from ...cache.disk import DiskCache, cache_key, environment_fingerprint

FORMAT = 2
_LIBRARY_SUFFIXES = (".so", ".pyd", ".dylib")
#: a group's intermediate IRs, kept for inspection (`CompiledKernel.asm`), never loaded to run:
#: not hashed (the binary and its metadata are, and those are what a launch uses)
_TEXT_IRS = (".source", ".ttir", ".ttgir", ".llir", ".ptx", ".amdgcn")

_caches: dict[str, DiskCache] = {}
_library: list = []  # [(name, size, mtime) of Triton's shared library, or None], once per process
#: launches that ran a recorded binary in this process (tests and logs read it)
launched = [0]


def binary_cache(root: str | None) -> DiskCache:
    cache = _caches.get(root)
    return cache if cache is not None else _caches.setdefault(root, DiskCache("triton-binaries", root))


def _triton_library():
    """Triton's shared library's name, size and modification time: a Triton rebuilt in place
    keeps its version but not these."""
    if not _library:
        found = None
        try:
            import triton

            folder = os.path.join(os.path.dirname(triton.__file__), "_C")
            for name in sorted(os.listdir(folder)):
                path = os.path.join(folder, name)
                if name.startswith("libtriton") and name.endswith(_LIBRARY_SUFFIXES) and os.path.isfile(path):
                    st = os.stat(path)
                    found = (name, st.st_size, st.st_mtime_ns)
                    break
        except (ImportError, OSError):
            pass
        _library.append(found)
    return _library[0]


def _invalidating_env() -> list | None:
    """The environment variables Triton's own cache key includes, as they are now."""
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars

        return sorted(get_cache_invalidating_env_vars().items())
    except (ImportError, AttributeError):
        return None


def knobs_in_the_way() -> str | None:
    """A Triton knob that changes what the JIT would build or run, by name; None where there
    is none (records are then neither used nor made)."""
    try:
        from triton import knobs
    except ImportError:
        return "a Triton without knobs"
    checks = (("runtime", "debug"), ("compilation", "instrumentation_mode"), ("compilation", "always_compile"),
              ("compilation", "override"), ("runtime", "add_stages_inspection_hook"))
    for group, name in checks:
        value = getattr(getattr(knobs, group, None), name, None)
        if value not in (None, False, "", "default"):
            return f"triton.knobs.{group}.{name}"
    return None


def record_key(source_key: str, options: dict, launch_key) -> str:
    return cache_key("triton-binary", FORMAT, source_key, sorted(options.items()), repr(launch_key),
                     environment_fingerprint(), _triton_library(), _invalidating_env())


def _plain(value) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, (list, tuple)) and all(_plain(v) for v in value)


def _pairs(mapping: dict) -> list | None:
    """A dict with tuple-of-int keys (Triton's argument paths) as JSON pairs; None where a key
    or value is not plain data."""
    out = []
    for k, v in mapping.items():
        key = list(k) if isinstance(k, tuple) else k
        if not _plain(key) or not _plain(v):
            return None
        out.append([key, v])
    return out


def _unpairs(pairs: list) -> dict:
    return {tuple(k) if isinstance(k, list) else k: _as_lists(v) for k, v in pairs}


def _as_lists(value):
    """JSON's lists as lists (Triton's attributes are lists of [name, value] pairs)."""
    return [_as_lists(v) for v in value] if isinstance(value, list) else value


def _sha256(path: str) -> str:
    return hashlib.sha256(trust.read(path)).hexdigest()


def encode(compiled) -> bytes | None:
    """The record of a compiled kernel (Triton's `CompiledKernel`), or None where its layout is
    not one this reads back (another Triton), its constants are not plain data or its files
    are not trusted."""
    try:
        src = compiled.src
        group = {str(k): os.path.abspath(str(v)) for k, v in compiled.metadata_group.items()}
        signature = dict(src.signature)
        constants, attrs = _pairs(dict(src.constants)), _pairs(dict(src.attrs))
        digest = str(compiled.hash)
        if constants is None or attrs is None or not all(isinstance(v, str) for v in signature.values()) \
                or not any(name.endswith(".json") for name in group):
            return None
        files = {name: _sha256(path) for name, path in group.items() if not name.endswith(_TEXT_IRS)}
    except (AttributeError, TypeError, ValueError, OSError):
        return None
    return json.dumps({"format": FORMAT, "hash": digest, "group": group, "sha256": files, "signature": signature,
                       "constants": constants, "attrs": attrs}).encode()


def _untrusted(record: dict) -> str | None:
    """Why a record's files may not be loaded (gone, not ours, writable by others, changed)."""
    for name, path in record["group"].items():
        try:
            if name not in record["sha256"]:
                if not os.path.isfile(path):
                    return f"{path} is gone"
            elif _sha256(path) != record["sha256"][name]:
                return f"{path} changed since it was recorded"
        except OSError as err:
            return f"{path}: {err.strerror or err}"
    return None


def decode(data: bytes, fn, options: dict | None = None, target=None):
    """Triton's `CompiledKernel` for a record, its handles not yet loaded; None where the
    record is not this format, its files are gone or untrusted, or its binary was built for
    another target (`target`, Triton's `GPUTarget`) or other warps or stages than `options`."""
    record = json.loads(data.decode())
    if record.get("format") != FORMAT or _untrusted(record) is not None:
        return None
    from triton.compiler.compiler import ASTSource, CompiledKernel

    src = ASTSource(fn, dict(record["signature"]), _unpairs(record["constants"]), _unpairs(record["attrs"]))
    compiled = CompiledKernel(src, record["group"], record["hash"])
    meta = compiled.metadata
    if target is not None and getattr(meta, "target", target) != target:
        return None
    for knob in ("num_warps", "num_stages"):
        if options and knob in options and getattr(meta, knob, options[knob]) != options[knob]:
            return None
    return compiled


def _current_target():
    from triton.runtime import driver

    return driver.active.get_current_target()


class BinaryRecords:
    """The records of one kernel's launches: `find(launch_key)` before a first launch,
    `keep(launch_key, compiled, options)` after one that went through the JIT, `forget` for a
    record whose binary did not load."""

    def __init__(self, fn, source_key: str, options: dict, root: str | None):
        self.fn = fn
        self.source_key = source_key
        self.options = dict(options)  # (as first asked: a launch retried with fewer stages records under these)
        self.cache = binary_cache(root)

    def _key(self, launch_key) -> str:
        return record_key(self.source_key, self.options, launch_key)

    def find(self, launch_key):
        """(compiled kernel, launch options it was built with) for `launch_key`, or None."""
        if knobs_in_the_way() is not None:
            return None
        key = self._key(launch_key)
        try:
            entry = self.cache.get(key)
            if entry is None:
                return None
            options = json.loads(entry["options.json"].decode())
            compiled = decode(entry["record.json"], self.fn, options, _current_target())
            why = None if compiled is not None else "its binary is gone, changed or built for another launch"
        except Exception as err:  # noqa: BLE001 - a record that does not load: the JIT's way
            compiled, why = None, f"{type(err).__name__}: {err}"
        if compiled is None:
            logs.log("runtime", "%s: binary record not used: %s", getattr(self.fn, "__name__", "kernel"), why)
            self.cache.discard(key, why)
            return None
        return compiled, options

    def forget(self, launch_key, why: str) -> None:
        self.cache.discard(self._key(launch_key), why)

    def keep(self, launch_key, compiled, options: dict) -> None:
        try:
            if knobs_in_the_way() is not None:
                return
            data = encode(compiled)
            if data is None:
                return
            self.cache.put(self._key(launch_key),
                           {"record.json": data, "options.json": json.dumps(options, sort_keys=True).encode()})
        except Exception as err:  # noqa: BLE001 - a record is an optimisation of the next process's start
            logs.log("runtime", "binary record not stored: %s: %s", type(err).__name__, err)


__all__ = ["BinaryRecords", "binary_cache", "encode", "decode", "record_key", "knobs_in_the_way", "launched"]
