"""The KVStore contract, run against every back end (RAM, disk, one Redis server, a Redis Cluster)."""

from __future__ import annotations

import os
import threading

from .conftest import StoreFactory


def test_put_get_roundtrip_exact_bytes(make_store: StoreFactory) -> None:
    store = make_store()
    values = {
        "empty": b"",
        "all-bytes": bytes(range(256)) * 4,
        "random-1MiB": os.urandom(1 << 20),
        "unicode-key-ş": b"hafiza",
    }
    for key, value in values.items():
        assert store.put(key, value) is True
    for key, value in values.items():
        assert store.contains(key)
        assert store.get(key) == value


def test_missing_key(make_store: StoreFactory) -> None:
    store = make_store()
    assert store.get("absent") is None
    assert store.contains("absent") is False
    assert store.delete("absent") is False


def test_overwrite_replaces(make_store: StoreFactory) -> None:
    store = make_store()
    assert store.put("k", b"first")
    assert store.put("k", b"second value")
    assert store.get("k") == b"second value"


def test_bytes_like_values_are_accepted(make_store: StoreFactory) -> None:
    store = make_store()
    assert store.put("ba", bytearray(b"abc"))
    assert store.put("mv", memoryview(b"xyz"))
    assert store.get("ba") == b"abc"
    assert store.get("mv") == b"xyz"


def test_delete_and_clear(make_store: StoreFactory) -> None:
    store = make_store()
    for i in range(5):
        store.put(f"k{i}", b"v%d" % i)
    assert store.delete("k0") is True
    assert store.get("k0") is None and not store.contains("k0")
    store.clear()
    assert [store.get(f"k{i}") for i in range(5)] == [None] * 5


def test_batched_calls_match_single_calls(make_store: StoreFactory) -> None:
    store = make_store()
    keys = [f"b{i}" for i in range(20)]
    for k in keys[::2]:
        store.put(k, k.encode() * 3)
    assert store.get_many(keys) == [store.get(k) for k in keys]
    assert store.contains_many(keys) == [i % 2 == 0 for i in range(20)]
    assert store.get_many([]) == [] and store.contains_many([]) == []


def test_stats_count_gets_and_puts(make_store: StoreFactory) -> None:
    store = make_store()
    store.put("a", b"1234")
    store.get("a")
    store.get("a")
    store.get("zz")
    s = store.stats()
    assert (s.hits, s.misses, s.puts, s.errors) == (2, 1, 1, 0)
    assert s.enabled and not s.degraded
    assert s.kind == store.kind and s.name == store.name
    assert s.bytes_written >= 4 and s.bytes_read >= 8
    assert s.load_seconds.count == 2 and s.store_seconds.count == 1
    if s.entries is not None:
        assert s.entries == 1 and s.bytes is not None and s.bytes >= 4


def test_closed_store_answers_without_raising(make_store: StoreFactory) -> None:
    store = make_store()
    store.put("a", b"1")
    store.close()
    assert store.put("b", b"2") is False
    assert store.get("a") is None
    assert store.contains("a") is False
    assert not store.enabled


def test_concurrent_threads_see_exact_values(make_store: StoreFactory) -> None:
    store = make_store()
    failures: list[str] = []

    def worker(t: int) -> None:
        for i in range(40):
            key, value = f"t{t}-{i}", os.urandom(1000 + i)
            if not store.put(key, value):
                failures.append(f"put {key}")
            got = store.get(key)
            if got != value:
                failures.append(f"get {key}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert failures == []
    assert store.stats().errors == 0
