"""What a kernel or a compiled graph works out once per set of sizes (size arguments, grid,
buffer layouts), kept for the most recently used few hundred sets.

Launches from several threads share one cache. A hit is a lookup and a move to the recent
end, without a lock: each is a single `OrderedDict` operation on keys of strings and ints,
atomic under the GIL (an entry evicted between the two is simply not moved). A miss computes
its value outside any lock (two threads may both compute it: the values are equal and
immutable) and inserts it under a lock that also drops the least recently used entries past
the limit, so a program that calls with ever new sizes holds a bounded number of them.

The launchers of both backends and the runtime's compiled graphs use it, so it sits here, below
the runtime.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

#: sets of sizes one kernel or graph keeps (one more evaluates its sizes again, about 100 µs)
LIMIT = 256


def size_key(env: dict) -> tuple:
    """The call's symbol values as a hashable key (names only: each symbol is bound twice)."""
    if not env:  # a graph of static shapes: every call has the same key
        return ()
    return tuple(sorted((k, v) for k, v in env.items() if isinstance(k, str)))


class SizeCache:
    """A thread-safe LRU map from `size_key`s to immutable values; `get` returns None on a miss."""

    __slots__ = ("limit", "_entries", "_lock")

    def __init__(self, limit: int | None = None):
        self.limit = LIMIT if limit is None else limit
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        value = self._entries.get(key)
        if value is not None:
            try:
                self._entries.move_to_end(key)
            except KeyError:  # evicted by another thread since the lookup
                pass
        return value

    def put(self, key, value):
        """Insert `value` unless `key` is there already; returns the value the cache holds."""
        with self._lock:
            value = self._entries.setdefault(key, value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.limit:
                self._entries.popitem(last=False)
        return value

    def replace(self, key, value) -> None:
        """Set `key` to `value`, whatever it held (a value that is refined once: a compiled
        graph's sizes seen once, then their generated call)."""
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.limit:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


__all__ = ["LIMIT", "SizeCache", "size_key"]
