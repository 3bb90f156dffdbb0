"""RAM tier: LRU order, byte cap, eviction callback."""

from __future__ import annotations

from hafiza.store.memory import MemoryStore


def test_lru_order_and_cap() -> None:
    store = MemoryStore(capacity_bytes=30)
    for k in "abc":
        store.put(k, k.encode() * 10)
    store.get("a")  # b is least recent
    store.put("d", b"d" * 10)
    assert store.keys() == ["c", "a", "d"]
    s = store.stats()
    assert (s.entries, s.bytes, s.evictions, s.capacity_bytes) == (3, 30, 1, 30)


def test_contains_and_peek_do_not_touch_recency() -> None:
    store = MemoryStore(capacity_bytes=20)
    store.put("a", b"a" * 10)
    store.put("b", b"b" * 10)
    assert store.contains("a") and store.peek("a") == b"a" * 10
    store.put("c", b"c" * 10)
    assert store.keys() == ["b", "c"]
    assert store.stats().hits == 0


def test_large_value_evicts_several_and_too_large_is_rejected() -> None:
    evicted: list[str] = []
    store = MemoryStore(capacity_bytes=30, on_evict=lambda k, v: evicted.append(k))
    for k in "abc":
        store.put(k, b"x" * 10)
    assert store.put("big", b"y" * 25)
    assert evicted == ["a", "b", "c"] and store.keys() == ["big"]
    assert store.put("huge", b"z" * 31) is False
    assert store.keys() == ["big"] and store.stats().rejected == 1


def test_overwrite_keeps_byte_count_exact() -> None:
    store = MemoryStore(capacity_bytes=100)
    store.put("a", b"x" * 40)
    store.put("a", b"x" * 10)
    assert store.stats().bytes == 10
    store.delete("a")
    assert store.stats().bytes == 0 and store.stats().entries == 0
