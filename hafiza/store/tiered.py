"""The tier stack below the working pool (fastest first, e.g. RAM → disk → Redis) as one cache.

Entries are named (e.g. by a block's prefix hash); `key_of(tier_index, name)` gives each tier's key, so tiers
with different codecs keep different keys for the same block.

- `lookup_prefix(names)`: how many leading names of a block chain some tier holds, and which tier supplies each.
- `load(names)`: the leading run of values actually fetched, and the tier each came from.
- `put_async`: the store's one background pipeline. A job is a value, or a function giving each target tier's
  value (the connector encodes there, per tier codec, off the engine thread). Write-through (every tier) or
  write-back (RAM; lower tiers when RAM evicts the entry or on `flush`). The queue is bounded in jobs and bytes;
  a full queue drops the write instead of blocking the engine. `flush(timeout)` drains everything pending.
- `cost`: the cost model (cost.py), fed with each tier's measured load bandwidth.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hafiza.store.base import KVStore
from hafiza.store.cost import CostModel
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
    fallback: list[bool] = field(default_factory=list)  # key i was found under its tier's fallback key

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
    queue_bytes: int
    queue_capacity: int
    writes_enqueued: int
    writes_dropped: int
    lookups: int
    lookup_keys: int
    lookup_hit_keys: int
    prefill_tokens_per_s: float | None


@dataclass(frozen=True)
class Fallback:
    """A value function's answer meaning: write these bytes under the tier's fallback key (`fallback_key_of`),
    e.g. a block the speculative tier stores in its fallback codec."""

    value: bytes


TierValue = Callable[[int], "bytes | Fallback | None"]
KeyOf = Callable[[int, str], str]
FallbackKeyOf = Callable[[int, str], "str | None"]


@dataclass
class Loaded:
    """The leading run of values `load` fetched; `sources[i]` is the index of the tier value i came from."""

    values: list[bytes]
    sources: list[int]
    fallback: list[bool] = field(default_factory=list)  # value i came from its tier's fallback key


@dataclass
class _Job:
    name: str
    value: bytes | TierValue  # the bytes for every target tier, or a function of the tier (None: skip it)
    ttl_s: float | None
    raw_nbytes: int | None
    targets: tuple[int, ...]
    nbytes: int  # what the job holds while queued (the byte cap)

    def value_for(self, j: int) -> bytes | Fallback | None:
        return self.value if isinstance(self.value, bytes) else self.value(j)


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
        key_of: KeyOf | None = None,
        fallback_key_of: FallbackKeyOf | None = None,
    ):
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        if write_back and not (tiers and isinstance(tiers[0], MemoryStore)):
            raise ValueError("write-back needs a RAM tier first")
        if queue_size <= 0:
            raise ValueError(f"queue_size={queue_size} must be > 0")
        self.tiers = list(tiers)
        self.key_of: KeyOf = key_of or (lambda j, name: name)
        self.fallback_key_of: FallbackKeyOf = fallback_key_of or (lambda j, name: None)
        self.write_back = write_back and len(self.tiers) > 1
        self.cost = cost or CostModel()
        for t in self.tiers:
            self.cost.add_tier(t.name, t.kind)
        self._tc = [_TierCounters() for _ in self.tiers]
        self._dirty: dict[str, tuple[str, float | None, int | None]] = {}  # RAM key: (name, ttl, raw bytes)
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

    def bind_keys(self, key_of: KeyOf, fallback_key_of: FallbackKeyOf) -> None:
        """Name entries by these functions from now on: the connector's block keys (model, KV dtype, block size
        and each tier's codec qualify a block's hash)."""
        self.key_of, self.fallback_key_of = key_of, fallback_key_of

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tiers]

    # -- reading -----------------------------------------------------------------------------------------

    def lookup_prefix(self, names: Sequence[str]) -> PrefixLookup:
        """Longest leading run of `names` that some tier holds (a chain stops at its first miss)."""
        n = len(names)
        sources: list[str | None] = [None] * n
        fallback = [False] * n
        for j, tier in enumerate(self.tiers):
            for alt in (False, True):
                todo = [i for i in range(n) if sources[i] is None]
                keys = [self._key(j, names[i], alt) for i in todo]
                todo = [i for i, k in zip(todo, keys, strict=True) if k is not None]
                if not todo:
                    continue
                found = self._contains_many(tier, [k for k in keys if k is not None])
                for i, hit in zip(todo, found, strict=True):
                    if hit:
                        sources[i], fallback[i] = tier.name, alt
        hits = next((i for i, s in enumerate(sources) if s is None), n)
        lead = [s for s in sources[:hits] if s is not None]
        with self._lock:
            self.lookups += 1
            self.lookup_keys += n
            self.lookup_hit_keys += hits
            for j, tier in enumerate(self.tiers):
                self._tc[j].lookup_hits += sum(1 for s in lead if s == tier.name)
        return PrefixLookup(num_keys=n, num_hits=hits, sources=lead, fallback=fallback[:hits])

    def _key(self, j: int, name: str, fallback: bool) -> str | None:
        """Tier j's key for `name`, or its fallback key (None where the tier has none)."""
        return self.fallback_key_of(j, name) if fallback else self.key_of(j, name)

    def load(self, names: Sequence[str]) -> Loaded:
        """Values of the leading run of `names` actually fetched (may be shorter than a lookup promised), each
        from the fastest tier holding it. Promotion into faster tiers is the caller's (their codecs may differ)."""
        n = len(names)
        values: list[bytes | None] = [None] * n
        source = [-1] * n
        fallback = [False] * n
        for j, tier in enumerate(self.tiers):
            for alt in (False, True):
                todo = [i for i in range(n) if values[i] is None]
                keys = [self._key(j, names[i], alt) for i in todo]
                todo = [i for i, k in zip(todo, keys, strict=True) if k is not None]
                if not todo:
                    continue
                t0 = time.perf_counter()
                got = self._get_many(tier, [k for k in keys if k is not None])
                seconds = time.perf_counter() - t0
                nbytes = 0
                for i, v in zip(todo, got, strict=True):
                    if v is not None:
                        values[i], source[i], fallback[i] = v, j, alt
                        nbytes += len(v)
                self.cost.observe_load(tier.name, nbytes, seconds)
        hits = next((i for i, v in enumerate(values) if v is None), n)
        return Loaded([v for v in values[:hits] if v is not None], source[:hits], fallback[:hits])

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

    # -- writing -----------------------------------------------------------------------------------------

    def put_async(self, name: str, value: bytes | TierValue, ttl_s: float | None = None,
                  raw_nbytes: int | None = None, *, targets: Sequence[int] | None = None,
                  nbytes: int | None = None) -> bool:
        """Queue `value` (bytes, or a function giving tier j's bytes or None to skip it) for the `targets` tiers
        (default: all; write-back: RAM, the rest later); False when dropped.

        `raw_nbytes` is the block's size before the codec, for the compression-ratio metric; `nbytes` what a
        function-valued job holds while queued (default `raw_nbytes`), for the queue's byte cap.
        """
        if self._closed or not self.tiers:
            return False
        if isinstance(value, (bytearray, memoryview)):
            value = bytes(value)
        size = len(value) if isinstance(value, bytes) else (nbytes or raw_nbytes or 0)
        if targets is None:
            targets = (0,) if self.write_back else range(len(self.tiers))
        return self._enqueue(_Job(name, value, ttl_s, raw_nbytes, tuple(targets), size))

    def _on_ram_evict(self, key: str, value: bytes) -> None:
        """Write-back: an entry leaving RAM goes down to the lower tiers if they have not got it yet (write-back
        needs one codec for every tier, so RAM's key and bytes are the lower tiers' too)."""
        with self._lock:
            meta = self._dirty.pop(key, None)
        if meta is not None:
            self._enqueue(_Job(meta[0], value, meta[1], meta[2], tuple(range(1, len(self.tiers))), len(value)))

    def _enqueue(self, job: _Job) -> bool:
        """Hand a job to the writer; False (dropped) when the queue is closed or full in jobs or bytes."""
        with self._lock:
            if self._closed:
                return False
            over = self._pending and self._pending_bytes + job.nbytes > self.max_pending_bytes
            try:
                if over:
                    raise queue.Full
                self._queue.put_nowait(job)
            except queue.Full:
                self.writes_dropped += 1
                return False
            self._pending += 1
            self._pending_bytes += job.nbytes
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
                    value = job.value_for(j)
                    key = self.key_of(j, job.name)
                    if isinstance(value, Fallback):
                        key, value = self.fallback_key_of(j, job.name), value.value
                        if key is None:
                            raise ValueError(f"tier {self.tiers[j].name} has no fallback key")
                    if value is not None and self._write(j, key, value, job.ttl_s, job.raw_nbytes) \
                            and j == 0 and self.write_back:
                        with self._lock:
                            self._dirty[key] = (job.name, job.ttl_s, job.raw_nbytes)
            except Exception:  # a value function failed (e.g. an encoder): drop the job, keep the writer alive
                store_log.error(f"tiered {id(self)} job", "store: preparing %s for the tiers failed; not written",
                                job.name, exc_info=True)  # fmt: skip
            finally:
                with self._lock:
                    self._pending -= 1
                    self._pending_bytes -= job.nbytes
                    if self._pending == 0:
                        self._idle.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Write every pending entry down (write-back: all dirty RAM entries too); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._drain(deadline):
            return False
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
                job = _Job(meta[0], value, meta[1], meta[2], tuple(range(1, len(self.tiers))), len(value))
                while not self._enqueue(job) and not self._closed:
                    time.sleep(0.001)  # queue full: wait for the writer rather than lose the entry
        return self._drain(deadline)

    def _drain(self, deadline: float | None) -> bool:
        """Wait until the writer has nothing pending; False at `deadline` (monotonic seconds)."""
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
                queue_bytes=self._pending_bytes,
                queue_capacity=self.queue_size,
                writes_enqueued=self.writes_enqueued,
                writes_dropped=self.writes_dropped,
                lookups=self.lookups,
                lookup_keys=self.lookup_keys,
                lookup_hit_keys=self.lookup_hit_keys,
                prefill_tokens_per_s=self.cost.prefill_rate(),
            )
