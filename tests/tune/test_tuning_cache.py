"""Tests for the tuning cache (tilefuse.tune.cache): keys, shape buckets, and records that
survive a new process, corruption and stale formats."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tilefuse.cache import disk as cache_mod
from tilefuse.cache.disk import CacheWarning, DiskCache
from tilefuse.tune import cache as tune_cache
from tilefuse.tune.cache import TuningCache, shape_bucket, tuning_key
from tilefuse.tune.search import search

SOURCE = "@triton.jit\ndef kernel(X, Y, N, BLOCK: tl.constexpr):\n    pass\n"
DEVICE = {"name": "NVIDIA H200", "capability": "9.0", "backend": "triton"}
CONFIG = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "split": "none", "unroll": True}


@pytest.fixture(autouse=True)
def _fresh_warning_registry():
    cache_mod._warned.clear()
    yield
    cache_mod._warned.clear()


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def key() -> str:
    return tuning_key(SOURCE, {"M": 4096, "N": 4096, "K": 1024}, ["torch.float16"], DEVICE)


def _record_path(root: Path, key: str) -> Path:
    return root / "tune" / key[:2] / key / "tuning.json"


# ---------------------------------------------------------------------- store and lookup


def test_store_then_lookup_in_a_fresh_cache_object(root, key):
    first = TuningCache(root)
    assert first.lookup(key) is None
    assert first.store(key, CONFIG, 1.25e-5, {"candidates": 12, "measured": 30})
    assert (first.misses, first.hits, first.stores) == (1, 0, 1)

    second = TuningCache(root)  # as a second process would see it
    hit = second.lookup(key)
    assert hit is not None
    assert hit["schedule"] == CONFIG and type(hit["schedule"]["unroll"]) is bool
    assert hit["time_s"] == 1.25e-5
    assert hit["meta"] == {"candidates": 12, "measured": 30}
    assert hit["created"] > 0
    assert (second.hits, second.misses, second.stores) == (1, 0, 0)


def test_a_hit_needs_no_measurement(root, key):
    calls = []

    def measure(config):
        calls.append(config)
        return 1e-3 / config["BLOCK"]

    def tune(cache):
        hit = cache.lookup(key)
        if hit is not None:
            return hit["schedule"]
        result = search([{"BLOCK": b} for b in (16, 32, 64)], measure, budget_s=10.0)
        cache.store(key, result.best, result.best_time, {"measured": result.measured})
        return result.best

    assert tune(TuningCache(root)) == {"BLOCK": 64}
    measured = len(calls)
    assert measured > 0
    again = TuningCache(root)
    assert tune(again) == {"BLOCK": 64}
    assert len(calls) == measured and again.hits == 1


def test_store_replaces_an_earlier_record(root, key):
    cache = TuningCache(root)
    cache.store(key, {"BLOCK": 32}, 2e-5)
    cache.store(key, {"BLOCK": 64}, 1e-5)
    assert TuningCache(root).lookup(key)["schedule"] == {"BLOCK": 64}
    assert cache.stores == 2


def test_store_rejects_what_it_could_not_read_back(root, key):
    cache = TuningCache(root)
    with pytest.raises(TypeError, match="int, str or bool"):
        cache.store(key, {"BLOCK": 64.0}, 1e-5)
    with pytest.raises(TypeError, match="not a str"):
        cache.store(key, {1: 64}, 1e-5)
    with pytest.raises(TypeError, match="plain JSON"):
        cache.store(key, {"BLOCK": 64}, 1e-5, {"obj": object()})
    with pytest.raises(ValueError):
        cache.store(key, {"BLOCK": 64}, float("nan"))
    assert cache.stores == 0 and cache.lookup(key) is None


# ---------------------------------------------------------------------- corrupt and stale


def test_corrupt_record_on_disk_is_a_miss_and_is_replaced(root, key):
    TuningCache(root).store(key, CONFIG, 1e-5)
    path = _record_path(root, key)
    assert path.is_file()
    path.write_text('{"format": 1, "config": {"BLOCK_M": 12')  # truncated JSON

    cache = TuningCache(root)
    assert cache.lookup(key) is None
    assert cache.misses == 1
    assert cache.store(key, {"BLOCK_M": 64}, 2e-5)
    assert TuningCache(root).lookup(key)["schedule"] == {"BLOCK_M": 64}


def _valid_record(for_key, /, **changes):
    record = {"format": tune_cache.FORMAT_VERSION, "key": for_key, "config": dict(CONFIG),
              "time_s": 1e-5, "created": 1.0, "meta": {}}
    record.update(changes)
    return json.dumps(record).encode()


@pytest.mark.parametrize(
    "data",
    [
        lambda key: b"not json at all",
        lambda key: b"\xff\xfe",
        lambda key: b"[1, 2, 3]",
        lambda key: _valid_record(key, format=tune_cache.FORMAT_VERSION + 1),
        lambda key: _valid_record(key, format=None),
        lambda key: _valid_record(key, key="0" * 64),
        lambda key: _valid_record(key, config=[["BLOCK", 64]]),
        lambda key: _valid_record(key, config={"BLOCK": 64.5}),
        lambda key: _valid_record(key, config={"BLOCK": None}),
        lambda key: _valid_record(key, config={"BLOCK": [64]}),
        lambda key: _valid_record(key, time_s="fast"),
        lambda key: _valid_record(key, meta=[]),
    ],
    ids=["garbage", "not-utf8", "not-object", "newer-format", "no-format", "other-key", "config-list",
         "float-value", "null-value", "list-value", "bad-time", "bad-meta"],
)
def test_stale_or_invalid_record_with_valid_checksums_is_a_miss_and_is_replaced(root, key, data):
    # Written through DiskCache, so the checksums are right: only the record is wrong.
    assert DiskCache("tune", root=root).put(key, {"tuning.json": data(key)})
    cache = TuningCache(root)
    assert cache.lookup(key) is None
    assert cache.misses == 1 and cache.hits == 0
    assert not _record_path(root, key).exists()  # discarded, not left behind
    assert cache.store(key, CONFIG, 3e-5)
    hit = TuningCache(root).lookup(key)
    assert hit is not None and hit["schedule"] == CONFIG and hit["time_s"] == 3e-5


def test_insecure_cache_directory_is_not_used(tmp_path, key):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.warns(CacheWarning, match="refusing"):
        cache = TuningCache(root)
    assert cache.store(key, CONFIG, 1e-5) is False
    assert cache.lookup(key) is None
    assert cache.stores == 0 and cache.misses == 1


# ------------------------------------------------------------------------------- keys


def test_key_is_stable_and_independent_of_dict_order():
    a = tuning_key(SOURCE, {"M": 128, "N": 256}, ["torch.float16"], DEVICE)
    b = tuning_key(SOURCE, {"N": 256, "M": 128}, ("torch.float16",), dict(reversed(list(DEVICE.items()))))
    assert a == b
    assert len(a) == 64 and int(a, 16) >= 0


@pytest.mark.parametrize(
    "change",
    [
        {"kernel_source": SOURCE + "# another kernel\n"},
        {"sizes": {"M": 128, "N": 512}},
        {"sizes": {"M": 128, "K": 256}},
        {"sizes": (128, 256)},
        {"dtypes": ["torch.bfloat16"]},
        {"dtypes": ["torch.float16", "torch.float16"]},
        {"device": {**DEVICE, "capability": "8.0"}},
        {"device": {**DEVICE, "name": "NVIDIA A100"}},
        {"extra": {"knobs": ["BLOCK_M"]}},
    ],
    ids=["source", "size", "size-name", "sizes-tuple", "dtype", "dtype-count", "capability", "device",
         "extra"],
)
def test_keys_differ_for_anything_that_changes_the_answer(change):
    base = {"kernel_source": SOURCE, "sizes": {"M": 128, "N": 256}, "dtypes": ["torch.float16"],
            "device": DEVICE}
    extra = change.pop("extra", None)
    assert tuning_key(**base) != tuning_key(**{**base, **change}, extra=extra)


def test_key_includes_the_environment(monkeypatch):
    base = tuning_key(SOURCE, {"M": 128}, ["torch.float16"], DEVICE)
    env = dict(tune_cache.environment_fingerprint())
    monkeypatch.setattr(tune_cache, "environment_fingerprint", lambda: {**env, "triton": "0.0.0"})
    assert tuning_key(SOURCE, {"M": 128}, ["torch.float16"], DEVICE) != base


def test_key_accepts_dtype_objects():
    torch = pytest.importorskip("torch")
    assert tuning_key(SOURCE, {"M": 8}, [torch.float16], DEVICE) == tuning_key(
        SOURCE, {"M": 8}, ["torch.float16"], DEVICE
    )
    assert tuning_key(SOURCE, {"M": 8}, torch.float16, DEVICE) == tuning_key(
        SOURCE, {"M": 8}, ["torch.float16"], DEVICE
    )


# ------------------------------------------------------------------------- shape buckets


def test_shape_bucket_rounds_up_to_powers_of_two():
    assert shape_bucket({"M": 1000, "N": 1024, "K": 1025, "B": 1, "Z": 0, "S": 3}) == {
        "M": 1024, "N": 1024, "K": 2048, "B": 1, "Z": 0, "S": 4,
    }


def test_nearby_sizes_share_a_tuning_key():
    def key(seq):
        return tuning_key(SOURCE, shape_bucket({"S": seq, "D": 128}), ["torch.bfloat16"], DEVICE)

    assert key(513) == key(700) == key(1024)
    assert key(512) != key(513)
    assert key(1025) != key(1024)


def test_shape_bucket_rejects_bad_sizes():
    with pytest.raises(ValueError):
        shape_bucket({"M": -1})
    with pytest.raises(TypeError):
        shape_bucket({"M": True})
    with pytest.raises(TypeError):
        shape_bucket({"M": "s0"})
    with pytest.raises(TypeError):
        shape_bucket({"M": 100.5})
    np = pytest.importorskip("numpy")
    assert shape_bucket({"M": np.int64(100)}) == {"M": 128}
