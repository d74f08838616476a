"""The disk cache, below every layer: atomic, locked, checksummed, private.

Any layer may import it (backends store kernels, tuning stores results, the driver stores whole
graphs); it imports only the other foundation modules (the config registry, logs, errors).

- `disk`: :class:`~tilefuse.cache.disk.DiskCache`, entries by key in a namespace, and the keys
  (`cache_key`, `environment_fingerprint`);
- `layout`: which names under the root are tilefuse's, and how a tree is removed;
- `entry_lock`: the lock one entry is built under, across processes;
- `size_bound`: the least recently used entries removed past ``config.cache_max_bytes``;
- `trust`: which files on disk tilefuse trusts, and how it opens and creates them;
- `scratch`: private temporary files outside the cache, and the sweep of those a killed
  process left (in the temporary directory and in the cache);
- `admin`: what is under the root, listed and cleared (`tilefuse cache info|clear`).
"""
