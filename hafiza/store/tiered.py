"""The tier stack below the working pool (fastest first, e.g. RAM → disk → Redis) as one cache.

- `lookup_prefix(keys)`: how many leading keys of a block chain some tier holds, and which tier supplies each.
- `load(keys)`: the leading run of values actually fetched; each hit is promoted into the faster tiers above
  its source (RAM directly, others through the writer).
- `put_async`: write-through (every tier, on a background writer thread with a queue bounded in jobs and
  bytes; a full queue drops the write instead of blocking the engine) or write-back (RAM now; lower tiers
  when RAM evicts the entry or on `flush`). `flush(timeout)` drains everything pending (graceful shutdown).
- `should_load`/`decide`: the cost model (cost.py) over the tiers' measured bandwidth.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from hafiza.store.base import KVStore
from hafiza.store.cost import CostModel, LoadDecision
from hafiza.store.logs import store_log
from hafiza.store.memory import MemoryStore
from hafiza.store.stats import StoreStats

log = logging.getLogger("hafiza.store")


@dataclass
class PrefixLookup:
    """The leading `num_hits` of `num_keys` keys are available; `sources[i]` names the tier holding key i."""

    num_keys: int
    num_hits: int
    sources: list[str]

    def per_tier(self) -> dict[str, int]:
        """How many of the leading hits each tier supplies."""
        out: dict[str, int] = {}
        for s in self.sources:
            out[s] = out.get(s, 0) + 1
        return out


@dataclass
class TierReport:
    """One tier's stats plus what the stack knows about it."""

    stats: StoreStats
    bandwidth_bytes_per_s: float
    bandwidth_measured: bool
    lookup_hits: int
    raw_bytes_written: int
    compression_ratio: float | None


@dataclass
class TieredStats:
    """A snapshot of the whole stack."""

    tiers: list[TierReport]
    write_back: bool
    queue_depth: int
    queue_capacity: int
    writes_enqueued: int
    writes_dropped: int
    lookups: int
    lookup_keys: int
    lookup_hit_keys: int
    prefill_tokens_per_s: float | None


@dataclass
class _Job:
    key: str
    value: bytes
    ttl_s: float | None
    raw_nbytes: int | None
    targets: tuple[int, ...]


@dataclass
class _TierCounters:
    lookup_hits: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0


class TieredStore:
    """An ordered list of KVStores, fastest first; see the module docstring."""

    def __init__(
        self,
        tiers: Sequence[KVStore],
        *,
        write_back: bool = False,
        queue_size: int = 1024,
        max_pending_bytes: int = 256 << 20,
        cost: CostModel | None = None,
    ):
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        if write_back and not (tiers and isinstance(tiers[0], MemoryStore)):
            raise ValueError("write-back needs a RAM tier first")
        if queue_size <= 0:
            raise ValueError(f"queue_size={queue_size} must be > 0")
        self.tiers = list(tiers)
        self.write_back = write_back and len(self.tiers) > 1
        self.cost = cost or CostModel()
        for t in self.tiers:
            self.cost.add_tier(t.name, t.kind)
        self._tc = [_TierCounters() for _ in self.tiers]
        self._dirty: dict[str, tuple[float | None, int | None]] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=queue_size)
        self.queue_size = queue_size
        self.max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        self.writes_enqueued = self.writes_dropped = 0
        self.lookups = self.lookup_keys = self.lookup_hit_keys = 0
        self._closed = False
        if self.write_back:
            ram = self.tiers[0]
            assert isinstance(ram, MemoryStore)
            ram.on_evict = self._on_ram_evict
        self._writer = threading.Thread(target=self._write_loop, name="hafiza-store-writer", daemon=True)
        self._writer.start()

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tiers]

    # -- reading -----------------------------------------------------------------------------------------

    def lookup_prefix(self, keys: Sequence[str]) -> PrefixLookup:
        """Longest leading run of `keys` that some tier holds (a chain stops at its first miss)."""
        n = len(keys)
        sources: list[str | None] = [None] * n
        for tier in self.tiers:
            todo = [i for i in range(n) if sources[i] is None]
            if not todo:
                break
            for i, found in zip(todo, self._contains_many(tier, [keys[i] for i in todo]), strict=True):
                if found:
                    sources[i] = tier.name
        hits = next((i for i, s in enumerate(sources) if s is None), n)
        lead = [s for s in sources[:hits] if s is not None]
        with self._lock:
            self.lookups += 1
            self.lookup_keys += n
            self.lookup_hit_keys += hits
            for j, tier in enumerate(self.tiers):
                self._tc[j].lookup_hits += sum(1 for s in lead if s == tier.name)
        return PrefixLookup(num_keys=n, num_hits=hits, sources=lead)

    def load(self, keys: Sequence[str]) -> list[bytes]:
        """Values of the leading run of `keys` actually fetched (may be shorter than a lookup promised)."""
        n = len(keys)
        values: list[bytes | None] = [None] * n
        source = [-1] * n
        for j, tier in enumerate(self.tiers):
            todo = [i for i in range(n) if values[i] is None]
            if not todo:
                break
            t0 = time.perf_counter()
            got = self._get_many(tier, [keys[i] for i in todo])
            seconds = time.perf_counter() - t0
            nbytes = 0
            for i, v in zip(todo, got, strict=True):
                if v is not None:
                    values[i], source[i] = v, j
                    nbytes += len(v)
            self.cost.observe_load(tier.name, nbytes, seconds)
        hits = next((i for i, v in enumerate(values) if v is None), n)
        out = [v for v in values[:hits] if v is not None]
        for i in range(hits):
            if source[i] > 0:
                self._promote(keys[i], out[i], source[i])
        return out

    def _contains_many(self, tier: KVStore, keys: list[str]) -> list[bool]:
        """`tier.contains_many`, as all misses if the back end breaks its contract and raises."""
        try:
            return tier.contains_many(keys)
        except Exception:
            store_log.error(f"tier {tier.name} {id(tier)} contains", "store tier %s raised in contains_many",
                            tier.name, exc_info=True)  # fmt: skip
            return [False] * len(keys)

    def _get_many(self, tier: KVStore, keys: list[str]) -> list[bytes | None]:
        """`tier.get_many`, as all misses if the back end breaks its contract and raises."""
        try:
            return tier.get_many(keys)
        except Exception:
            store_log.error(f"tier {tier.name} {id(tier)} get", "store tier %s raised in get_many", tier.name,
                            exc_info=True)  # fmt: skip
            return [None] * len(keys)

    def _promote(self, key: str, value: bytes, source: int) -> None:
        """Copy a hit into every faster tier: RAM at once, the others through the writer."""
        queued = []
        for j in range(source):
            if isinstance(self.tiers[j], MemoryStore):
                self.tiers[j].put(key, value)
            else:
                queued.append(j)
        if queued:
            self._enqueue(_Job(key, value, None, None, tuple(queued)))

    # -- writing -----------------------------------------------------------------------------------------

    def put_async(self, key: str, value: bytes, ttl_s: float | None = None, raw_nbytes: int | None = None) -> bool:
        """Queue `value` for the tiers (write-back: store in RAM now); False when dropped.

        `raw_nbytes` is the block's size before the codec, for the compression-ratio metric.
        """
        if self._closed or not self.tiers:
            return False
        value = bytes(value)
        if self.write_back:
            with self._lock:
                self._dirty[key] = (ttl_s, raw_nbytes)
            ok = self.tiers[0].put(key, value, ttl_s)
            if ok:
                self._count_write(0, value, raw_nbytes)
            else:  # too large for RAM: write it down directly
                with self._lock:
                    self._dirty.pop(key, None)
                return self._enqueue(_Job(key, value, ttl_s, raw_nbytes, tuple(range(1, len(self.tiers)))))
            return True
        return self._enqueue(_Job(key, value, ttl_s, raw_nbytes, tuple(range(len(self.tiers)))))

    def put(self, key: str, value: bytes, ttl_s: float | None = None, raw_nbytes: int | None = None) -> int:
        """Write-through now, on the caller's thread; the number of tiers that stored the value."""
        value = bytes(value)
        return sum(self._write(j, key, value, ttl_s, raw_nbytes) for j in range(len(self.tiers)))

    def _on_ram_evict(self, key: str, value: bytes) -> None:
        """Write-back: an entry leaving RAM goes down to the lower tiers if they have not got it yet."""
        with self._lock:
            meta = self._dirty.pop(key, None)
        if meta is not None:
            self._enqueue(_Job(key, value, meta[0], meta[1], tuple(range(1, len(self.tiers)))))

    def _enqueue(self, job: _Job) -> bool:
        """Hand a job to the writer; False (dropped) when the queue is closed or full in jobs or bytes."""
        with self._lock:
            if self._closed:
                return False
            over = self._pending and self._pending_bytes + len(job.value) > self.max_pending_bytes
            try:
                if over:
                    raise queue.Full
                self._queue.put_nowait(job)
            except queue.Full:
                self.writes_dropped += 1
                return False
            self._pending += 1
            self._pending_bytes += len(job.value)
            self.writes_enqueued += 1
        return True

    def _write(self, j: int, key: str, value: bytes, ttl_s: float | None, raw_nbytes: int | None) -> bool:
        try:
            ok = self.tiers[j].put(key, value, ttl_s)
        except Exception:  # a back end broke its contract; keep the writer alive
            store_log.error(f"tier {self.tiers[j].name} {id(self.tiers[j])} put", "store tier %s raised in put",
                            self.tiers[j].name, exc_info=True)  # fmt: skip
            return False
        if ok:
            self._count_write(j, value, raw_nbytes)
        return ok

    def _count_write(self, j: int, value: bytes, raw_nbytes: int | None) -> None:
        if raw_nbytes is not None:
            with self._lock:
                self._tc[j].raw_bytes += raw_nbytes
                self._tc[j].stored_bytes += len(value)

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                for j in job.targets:
                    self._write(j, job.key, job.value, job.ttl_s, job.raw_nbytes)
            finally:
                with self._lock:
                    self._pending -= 1
                    self._pending_bytes -= len(job.value)
                    if self._pending == 0:
                        self._idle.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Write every pending entry down (write-back: all dirty RAM entries too); False on timeout."""
        if self.write_back:
            ram = self.tiers[0]
            assert isinstance(ram, MemoryStore)
            with self._lock:
                dirty = list(self._dirty)
            for key in dirty:
                value = ram.peek(key)
                if value is None:
                    continue  # evicted meanwhile: the eviction callback writes it down
                with self._lock:
                    meta = self._dirty.pop(key, None)
                if meta is None:
                    continue
                job = _Job(key, value, meta[0], meta[1], tuple(range(1, len(self.tiers))))
                while not self._enqueue(job) and not self._closed:
                    time.sleep(0.001)  # queue full: wait for the writer rather than lose the entry
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout: float | None = 30.0) -> bool:
        """Flush, stop the writer and close every tier; False when pending writes were abandoned."""
        if self._closed:
            return True
        flushed = self.flush(timeout)
        with self._lock:
            self._closed = True
        if flushed:
            self._queue.put(None)
            self._writer.join()
        else:
            log.warning("store: closing with %d writes still pending", self._pending)
        for t in self.tiers:
            t.close()
        return flushed

    # -- cost model --------------------------------------------------------------------------------------

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """Tell the cost model how fast prefill (the recompute alternative) runs."""
        self.cost.observe_prefill(num_tokens, seconds)

    def should_load(self, num_tokens: int, nbytes: int, tier: str | None = None) -> LoadDecision:
        """Load vs recompute for `nbytes` covering `num_tokens`, from `tier` (default: the slowest tier)."""
        if tier is None:
            if not self.tiers:
                return LoadDecision(False, "recompute: no store tiers", 0.0, None)
            tier = min(self.names, key=lambda name: self.cost.bandwidth(name)[0])
        return self.cost.decide(num_tokens, {tier: nbytes})

    def decide(self, lookup: PrefixLookup, tokens_per_key: int, bytes_per_key: int) -> LoadDecision:
        """Load vs recompute for a lookup's leading hits, each tier's share at its own bandwidth."""
        by_tier = {name: n * bytes_per_key for name, n in lookup.per_tier().items()}
        return self.cost.decide(lookup.num_hits * tokens_per_key, by_tier)

    # -- stats -------------------------------------------------------------------------------------------

    def stats(self) -> TieredStats:
        reports = []
        for j, tier in enumerate(self.tiers):
            bw, measured = self.cost.bandwidth(tier.name)
            with self._lock:
                tc = self._tc[j]
                ratio = tc.raw_bytes / tc.stored_bytes if tc.stored_bytes else None
                lookup_hits, raw = tc.lookup_hits, tc.raw_bytes
            reports.append(TierReport(tier.stats(), bw, measured, lookup_hits, raw, ratio))
        with self._lock:
            return TieredStats(
                tiers=reports,
                write_back=self.write_back,
                queue_depth=self._pending,
                queue_capacity=self.queue_size,
                writes_enqueued=self.writes_enqueued,
                writes_dropped=self.writes_dropped,
                lookups=self.lookups,
                lookup_keys=self.lookup_keys,
                lookup_hit_keys=self.lookup_hit_keys,
                prefill_tokens_per_s=self.cost.prefill_rate(),
            )
