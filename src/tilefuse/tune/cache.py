"""The tuning cache: the schedule a search chose for a kernel, kept on disk so that a later
process (or a later graph in this one) uses it without measuring anything.

This module owns the tuning key, the shape buckets that make one result serve nearby sizes,
and the JSON record stored per key. Storage, atomic writes, checksums, locking and the
private-directory policy are :class:`tilefuse.cache.disk.DiskCache`'s, namespace
``"tune"``; one entry holds one file, ``tuning.json``::

    {"format": 1, "key": "<key>", "config": {"BLOCK_M": 128, ...},
     "time_s": 1.2e-05, "created": 1760000000.0, "meta": {...}}

(the record's ``config`` is the schedule's knobs, `Schedule.as_dict()`; a lookup returns it as
a `Schedule` again, under ``"schedule"``).

An entry that is corrupt (checksum, unparseable JSON) or stale (another ``format``, a config
that is not a dict of str → int/str/bool) is ignored — the lookup is a miss — deleted, and
replaced by the next :meth:`TuningCache.store`. So is a well-formed record whose config the
caller does not accept (``lookup(key, accept=...)``: not a configuration of the kernel's
schedule space, or one over the target's limits — a checksum proves who wrote a record, not
that its config is safe to compile). Plain JSON only; nothing is pickled.
"""
from __future__ import annotations

import json
import math
import operator
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from .. import logs
from ..cache.disk import DiskCache, cache_key, environment_fingerprint
from ..tile.schedule import Schedule

__all__ = ["FORMAT_VERSION", "NAMESPACE", "TuningCache", "shape_bucket", "tuning_key"]

#: bumped whenever the record's schema or the way results are measured changes; entries of another
#: version are discarded (2: GPU samples taken with the L2 cache flushed before each launch; 3:
#: without the host's time to queue the launch)
FORMAT_VERSION = 3
NAMESPACE = "tune"
RECORD = "tuning.json"


def shape_bucket(sizes: Mapping[str, int]) -> dict[str, int]:
    """Each size rounded up to the next power of two (0 and 1 stay themselves).

    A dynamic dim takes many values (sequence lengths, batch sizes) and tuning each one would
    measure again for every new value. The best schedule depends on a size's order of
    magnitude — how many tiles there are, whether one tile covers the dim — far more than on
    its exact value, so one result per power-of-two bucket serves every size in it, and a dim
    ranging over 1..N costs about log2(N) tunings at most. Rounding up names a bucket by its
    largest member: the size to measure at, so that the chosen tiles suit the whole bucket.
    """
    out = {}
    for name, size in sizes.items():
        if isinstance(size, bool):
            raise TypeError(f"size {name!r} must be an int, got {size!r}")
        try:
            size = operator.index(size)  # also numpy / sympy integers; never floats
        except TypeError:
            raise TypeError(f"size {name!r} must be an int, got {size!r}") from None
        if size < 0:
            raise ValueError(f"size {name!r} must be >= 0, got {size}")
        out[name] = size if size <= 1 else 1 << (size - 1).bit_length()
    return out


def tuning_key(
    kernel_source: str,
    sizes: Mapping[str, int] | tuple | list,
    dtypes: Any,
    device: Mapping[str, Any],
    *,
    extra: Any = None,
) -> str:
    """The cache key of a tuning result: a hash of the kernel's source (with its tunable
    parameters unbound), its sizes (exact, or a :func:`shape_bucket` for symbolic dims),
    its dtypes, the device (as described by the caller: backend, name, capability), anything
    else that changes the answer (``extra``: the schedule space, say) and
    :func:`environment_fingerprint` (tilefuse, torch, triton versions, CUDA device)."""
    if not isinstance(kernel_source, str):
        raise TypeError(f"kernel_source must be str, got {type(kernel_source).__name__}")
    if isinstance(sizes, Mapping):
        sizes_part: Any = {str(k): v for k, v in sizes.items()}
    else:
        sizes_part = list(sizes)
    if isinstance(dtypes, str) or not hasattr(dtypes, "__iter__"):
        dtypes = [dtypes]
    dtypes_part = [str(d) for d in dtypes]
    return cache_key(
        "tune", FORMAT_VERSION, kernel_source, sizes_part, dtypes_part, dict(device), extra,
        environment_fingerprint(),
    )


def _check_config(config: Any) -> dict[str, int | str | bool]:
    if not isinstance(config, dict):
        raise TypeError(f"a tuned config is a dict, got {type(config).__name__}")
    for k, v in config.items():
        if not isinstance(k, str):
            raise TypeError(f"config knob {k!r} is not a str")
        if not isinstance(v, (int, str, bool)):  # bool is an int; floats are not knob values
            raise TypeError(f"config value {k}={v!r} is not an int, str or bool")
    return dict(config)


class TuningCache:
    """Tuning results on disk, by :func:`tuning_key`.

    ``hits``, ``misses`` and ``stores`` count lookups that found a valid record, lookups that
    did not, and records written. A disabled disk cache (read-only or insecure directory, see
    :class:`DiskCache`) makes every lookup a miss and every store a no-op returning False.
    """

    def __init__(self, root: str | os.PathLike | None = None):
        self.disk = DiskCache(NAMESPACE, root=root)
        self.hits = 0
        self.misses = 0
        self.stores = 0

    def __repr__(self) -> str:
        return (
            f"TuningCache({str(self.disk.root)!r}, hits={self.hits}, misses={self.misses}, "
            f"stores={self.stores})"
        )

    def lookup(self, key: str, accept: Callable[[Schedule], str | None] | None = None) -> dict | None:
        """``{"schedule", "time_s", "created", "meta"}`` stored for ``key``, or None. ``accept``:
        the reason a record's schedule must not be used (None: it may), checked before it is
        returned; a rejected record is a miss here (logged), left for the processes it fits."""
        record = self._read(key)
        if record is not None and accept is not None:
            why = accept(record["schedule"])
            if why:
                # a miss, not a deletion: whether a schedule fits can depend on this process
                # (its stack limit, its GPU); the re-tuned record replaces it
                logs.log("tune", "tuning record %s rejected: %s: %s", key[:12], record["schedule"].as_dict(), why)
                record = None
        if record is None:
            self.misses += 1
        else:
            self.hits += 1
            logs.log("tune", "cache hit %s: %s", key[:12], record["schedule"].as_dict())
        return record

    def store(
        self, key: str, schedule: Mapping[str, Any], time_s: float, meta: Mapping[str, Any] | None = None
    ) -> bool:
        """Record ``schedule`` (measured at ``time_s`` seconds) for ``key``, replacing any earlier
        record. ``meta`` is any JSON object (candidates, measurements, budget...). Returns
        whether the record is on disk afterwards."""
        config = _check_config(dict(schedule) if isinstance(schedule, Mapping) else schedule)
        time_s = float(time_s)
        if not (math.isfinite(time_s) and time_s >= 0):
            raise ValueError(f"time_s must be a finite number of seconds >= 0, got {time_s!r}")
        record = {
            "format": FORMAT_VERSION,
            "key": key,
            "config": config,
            "time_s": time_s,
            "created": time.time(),
            "meta": dict(meta or {}),
        }
        try:
            data = json.dumps(record, sort_keys=True, allow_nan=False).encode("utf-8")
        except (TypeError, ValueError) as e:
            raise TypeError(f"tuning meta must be plain JSON: {e}") from e
        # DiskCache keeps an existing valid entry; a new result replaces the old one.
        self._discard(key, "replaced by a new tuning result")
        ok = self.disk.put(key, {RECORD: data})
        if ok:
            self.stores += 1
            logs.log("tune", "cache store %s: %s (%.3g s)", key[:12], config, time_s)
        return ok

    # -- internals ------------------------------------------------------------------------

    def _read(self, key: str) -> dict | None:
        files = self.disk.get(key)  # checksums verified; a corrupt entry is deleted there
        if files is None:
            return None
        try:
            record = json.loads(files[RECORD])
            if not isinstance(record, dict):
                raise TypeError("record is not an object")
            if record.get("format") != FORMAT_VERSION:
                raise ValueError(f"format {record.get('format')!r}, expected {FORMAT_VERSION}")
            if record.get("key") != key:
                raise ValueError(f"record is for key {record.get('key')!r}")
            config = _check_config(record["config"])
            time_s = float(record["time_s"])
            created = float(record["created"])
            meta = record.get("meta", {})
            if not isinstance(meta, dict):
                raise TypeError("meta is not an object")
        except (KeyError, TypeError, ValueError, UnicodeDecodeError) as e:
            self._discard(key, f"stale or invalid tuning record: {e}")
            return None
        return {"schedule": Schedule(config), "time_s": time_s, "created": created, "meta": meta}

    def _discard(self, key: str, why: str) -> None:
        # DiskCache has no public delete; its own discard (rename out of sight, then remove)
        # is used on the entry path_of reports.
        entry = self.disk.path_of(key)
        if entry is not None and self.disk.writable:
            self.disk._discard(entry, why)
