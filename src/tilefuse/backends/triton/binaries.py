"""A compiled kernel's binary found again in a new process without Triton's JIT.

A first launch through `JITFunction.run` asks Triton's `compile`, which keys its cache by a
hash that includes `triton_key()`: a hash of Triton's own sources and of its 100+ MB shared
library, computed once per process (0.4–0.6 s on a GPU host). A warm process that loads a
stored graph would pay it before its first kernel runs, although every binary it needs is on
disk. Inductor's warm path avoids it by launching the binaries it stored itself.

Here, after a kernel's first launch compiled or found its binary, tilefuse keeps a *record*
in its own cache: where Triton stored the binary and its metadata (Triton's cache group), and
the signature, constants and attributes the JIT compiled it for. The record is keyed by the
kernel's source, its launch options, the launch's specialisation key (`DirectLaunch`: at least
as fine as Triton's own), the environment fingerprint (tilefuse, PyTorch, Triton and Python
versions, the device), Triton's shared library's size and modification time (a rebuilt Triton
of the same version) and the environment variables that invalidate Triton's cache. A new
process with the same key builds Triton's `CompiledKernel` from the record's files directly;
its launcher is made by this process's Triton from the binary's metadata, as on a cache hit.

Trust: the record comes from tilefuse's private cache (see `cache.trust`) and names files in
Triton's cache, which Triton itself loads on a cache hit. A record whose files are gone (a
cleared Triton cache) or do not load is ignored and the launch takes the JIT's way, which
writes the record again. Nothing is unpickled: records are JSON, and a constant that is not a
number, string, boolean or None makes no record.
"""
from __future__ import annotations

import json
import os

from ... import logs
from ...cache.disk import DiskCache, cache_key, environment_fingerprint

FORMAT = 1

_caches: dict[str, DiskCache] = {}
_triton_state: list = []  # [(libtriton size, mtime), invalidating env vars], once per process


def binary_cache(root: str | None) -> DiskCache:
    cache = _caches.get(root)
    return cache if cache is not None else _caches.setdefault(root, DiskCache("triton-binaries", root))


def _triton_identity() -> list:
    """What changes Triton's binaries besides its version: its shared library (a rebuilt Triton
    of the same version) and the environment variables Triton's own cache key includes."""
    if not _triton_state:
        lib, env = None, None
        try:
            import triton

            folder = os.path.join(os.path.dirname(triton.__file__), "_C")
            for name in sorted(os.listdir(folder)):
                if name.startswith("libtriton"):
                    st = os.stat(os.path.join(folder, name))
                    lib = (name, st.st_size, st.st_mtime_ns)
                    break
        except (ImportError, OSError):
            pass
        try:
            from triton._C.libtriton import get_cache_invalidating_env_vars

            env = sorted(get_cache_invalidating_env_vars().items())
        except (ImportError, AttributeError):
            pass
        _triton_state[:] = [lib, env]
    return list(_triton_state)


def record_key(source_key: str, options: dict, launch_key) -> str:
    return cache_key("triton-binary", FORMAT, source_key, sorted(options.items()), repr(launch_key),
                     environment_fingerprint(), _triton_identity())


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
    return {tuple(k) if isinstance(k, list) else k: _tuples(v) for k, v in pairs}


def _tuples(value):
    return [_tuples(v) for v in value] if isinstance(value, list) else value


def encode(compiled) -> bytes | None:
    """The record of a compiled kernel (Triton's `CompiledKernel`), or None where its layout is
    not one this reads back (another Triton) or its constants are not plain data."""
    try:
        src = compiled.src
        group = {str(k): str(v) for k, v in compiled.metadata_group.items()}
        signature = dict(src.signature)
        constants, attrs = _pairs(dict(src.constants)), _pairs(dict(src.attrs))
        digest = str(compiled.hash)
    except (AttributeError, TypeError):
        return None
    if constants is None or attrs is None or not all(isinstance(v, str) for v in signature.values()) \
            or not any(name.endswith(".json") for name in group):
        return None
    return json.dumps({"format": FORMAT, "hash": digest, "group": group, "signature": signature,
                       "constants": constants, "attrs": attrs}).encode()


def decode(data: bytes, fn):
    """Triton's `CompiledKernel` for a record, its handles not yet loaded; None where the record
    is not this format or its files are gone."""
    record = json.loads(data.decode())
    if record.get("format") != FORMAT:
        return None
    group = record["group"]
    if not all(os.path.isfile(path) for path in group.values()):
        return None
    from triton.compiler.compiler import ASTSource, CompiledKernel

    src = ASTSource(fn, dict(record["signature"]), _unpairs(record["constants"]), _unpairs(record["attrs"]))
    return CompiledKernel(src, group, record["hash"])


class BinaryRecords:
    """The records of one kernel's launches: `find(launch_key)` before a first launch,
    `keep(launch_key, compiled)` after one that went through the JIT."""

    def __init__(self, fn, source_key: str, options: dict, root: str | None):
        self.fn = fn
        self.source_key = source_key
        self.options = dict(options)  # (as first asked: a launch retried with fewer stages records under these)
        self.cache = binary_cache(root)

    def find(self, launch_key):
        """(compiled kernel, launch options it was built with) for `launch_key`, or None."""
        try:
            entry = self.cache.get(record_key(self.source_key, self.options, launch_key))
            if entry is None:
                return None
            options = json.loads(entry["options.json"].decode())
            compiled = decode(entry["record.json"], self.fn)
        except Exception as err:  # noqa: BLE001 - a record that does not load: the JIT's way
            logs.log("runtime", "%s: binary record not used: %s: %s", getattr(self.fn, "__name__", "kernel"),
                     type(err).__name__, err)
            return None
        return None if compiled is None else (compiled, options)

    def keep(self, launch_key, compiled, options: dict) -> None:
        data = encode(compiled)
        if data is None:
            return
        try:
            self.cache.put(record_key(self.source_key, self.options, launch_key),
                           {"record.json": data, "options.json": json.dumps(options, sort_keys=True).encode()})
        except Exception as err:  # noqa: BLE001 - a record is an optimisation of the next process's start
            logs.log("runtime", "binary record not stored: %s: %s", type(err).__name__, err)


__all__ = ["BinaryRecords", "binary_cache", "encode", "decode", "record_key"]
