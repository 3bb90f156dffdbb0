"""Per-tier counters and latency histograms, kept by every back end and read by the metrics exporter."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

# Upper bounds (seconds) of the latency buckets: 50 µs to 10 s, roughly ×2.5 apart.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


@dataclass
class LatencyHistogram:
    """Fixed-bucket histogram of durations; `counts[i]` counts observations ≤ bounds[i] (last: +Inf)."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    count: int = 0
    sum: float = 0.0

    def observe(self, seconds: float) -> None:
        """Add one duration (callers hold the owner's lock)."""
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.count += 1
        self.sum += seconds

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus-style cumulative buckets as (le, count), ending with +Inf."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), total))
        return out

    def copy(self) -> LatencyHistogram:
        """A snapshot independent of later observations."""
        return LatencyHistogram(self.bounds, list(self.counts), self.count, self.sum)


@dataclass
class StoreStats:
    """A snapshot of one tier. `entries`/`bytes` are None where the tier cannot know them (shared Redis)."""

    name: str
    kind: str
    enabled: bool
    degraded: bool
    entries: int | None
    bytes: int | None
    capacity_bytes: int | None
    hits: int
    misses: int
    puts: int
    rejected: int
    errors: int
    evictions: int
    bytes_read: int
    bytes_written: int
    load_seconds: LatencyHistogram
    store_seconds: LatencyHistogram


class StoreCounters:
    """Thread-safe counters of a back end: `get` outcomes are hits/misses, `put` outcomes puts/rejected."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.hits = self.misses = self.puts = self.rejected = 0
        self.errors = self.evictions = self.bytes_read = self.bytes_written = 0
        self.load_seconds = LatencyHistogram()
        self.store_seconds = LatencyHistogram()

    def hit(self, nbytes: int, seconds: float) -> None:
        """A `get` that returned a value."""
        with self.lock:
            self.hits += 1
            self.bytes_read += nbytes
            self.load_seconds.observe(seconds)

    def miss(self, n: int = 1) -> None:
        """`n` gets that returned None."""
        with self.lock:
            self.misses += n

    def put(self, nbytes: int, seconds: float) -> None:
        """A `put` that stored its value."""
        with self.lock:
            self.puts += 1
            self.bytes_written += nbytes
            self.store_seconds.observe(seconds)

    def reject(self) -> None:
        """A `put` refused without an error (too large, tier disabled or degraded)."""
        with self.lock:
            self.rejected += 1

    def error(self, n: int = 1) -> None:
        """An I/O, connection or integrity failure."""
        with self.lock:
            self.errors += n

    def evict(self, n: int = 1) -> None:
        """Entries dropped to stay under the byte cap."""
        with self.lock:
            self.evictions += n

    def snapshot(
        self,
        *,
        name: str,
        kind: str,
        enabled: bool,
        degraded: bool,
        entries: int | None,
        nbytes: int | None,
        capacity_bytes: int | None,
    ) -> StoreStats:
        """Freeze the counters together with the caller's gauges."""
        with self.lock:
            return StoreStats(
                name=name,
                kind=kind,
                enabled=enabled,
                degraded=degraded,
                entries=entries,
                bytes=nbytes,
                capacity_bytes=capacity_bytes,
                hits=self.hits,
                misses=self.misses,
                puts=self.puts,
                rejected=self.rejected,
                errors=self.errors,
                evictions=self.evictions,
                bytes_read=self.bytes_read,
                bytes_written=self.bytes_written,
                load_seconds=self.load_seconds.copy(),
                store_seconds=self.store_seconds.copy(),
            )
