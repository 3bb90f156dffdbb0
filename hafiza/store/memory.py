"""Host-RAM tier: a byte-capped LRU dictionary, thread-safe, values kept as immutable bytes."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from hafiza.store.base import KVStore
from hafiza.store.stats import StoreCounters, StoreStats

EvictCallback = Callable[[str, bytes], None]


class MemoryStore(KVStore):
    """LRU over an OrderedDict (oldest first); `on_evict` sees each entry dropped for space (write-back)."""

    kind = "memory"

    def __init__(self, capacity_bytes: int, *, name: str = "ram", on_evict: EvictCallback | None = None):
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be >= 0")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.on_evict = on_evict
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._closed = False
        self._counters = StoreCounters()

    def put(self, key: str, value: bytes, ttl_s: float | None = None) -> bool:
        """Insert as most recent, evicting least recent entries until the cap holds."""
        t0 = time.perf_counter()
        value = bytes(value)
        if self._closed or len(value) > self.capacity_bytes:
            self._counters.reject()
            return False
        evicted: list[tuple[str, bytes]] = []
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            while self._bytes + len(value) > self.capacity_bytes:
                k, v = self._data.popitem(last=False)
                self._bytes -= len(v)
                evicted.append((k, v))
            self._data[key] = value
            self._bytes += len(value)
            assert 0 <= self._bytes <= self.capacity_bytes
        self._counters.put(len(value), time.perf_counter() - t0)
        if evicted:
            self._counters.evict(len(evicted))
            if self.on_evict is not None:
                for k, v in evicted:
                    self.on_evict(k, v)
        return True

    def get(self, key: str) -> bytes | None:
        """The value, marked most recently used; None when absent."""
        t0 = time.perf_counter()
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
        if value is None:
            self._counters.miss()
            return None
        self._counters.hit(len(value), time.perf_counter() - t0)
        return value

    def peek(self, key: str) -> bytes | None:
        """The value without touching the LRU order or the counters."""
        with self._lock:
            return self._data.get(key)

    def contains(self, key: str) -> bool:
        """Membership without touching the LRU order."""
        with self._lock:
            return key in self._data

    def delete(self, key: str) -> bool:
        """Drop one entry (not reported to `on_evict`)."""
        with self._lock:
            value = self._data.pop(key, None)
            if value is not None:
                self._bytes -= len(value)
        return value is not None

    def keys(self) -> list[str]:
        """Keys from least to most recently used (for write-back flushing and tests)."""
        with self._lock:
            return list(self._data)

    def clear(self) -> None:
        """Drop everything (not reported to `on_evict`)."""
        with self._lock:
            self._data.clear()
            self._bytes = 0

    def close(self) -> None:
        """Free the memory; later puts are refused."""
        self._closed = True
        self.clear()

    @property
    def enabled(self) -> bool:
        return not self._closed

    def stats(self) -> StoreStats:
        with self._lock:
            entries, nbytes = len(self._data), self._bytes
        return self._counters.snapshot(
            name=self.name,
            kind=self.kind,
            enabled=self.enabled,
            degraded=False,
            entries=entries,
            nbytes=nbytes,
            capacity_bytes=self.capacity_bytes,
        )
