"""StoreConnector: the engine's KVConnector over a TieredStore (RAM → disk → Redis).

- `save` (engine thread): copy the full block out of the pool and queue it; an encoder thread skips keys the
  tiers already hold, encodes the rest with the codec and hands them to the store's writer (`put_async`).
  The engine thread never waits on the codec or on I/O; a full queue drops the save (counted).
- `lookup` (engine thread, at admission): the longest prefix some tier holds, and the cost model's load vs
  recompute decision (stored bytes over measured tier bandwidth + measured decode time, against tokens over
  the measured prefill speed the engine feeds through `observe_prefill`).
- `load` (engine thread): takes the `TierHit` that `lookup` returned; fetch, decode (the codec's checksums: a
  corrupt entry is dropped from every tier and recomputed), write into the pool. It returns a `TierLoad`: the
  tier of each block that arrived, and a note when fewer blocks than promised did.

TTL (only Redis applies one; RAM and disk evict by LRU): a block under an API cache breakpoint (`CachePin`,
Anthropic `cache_control`) is written with the pin's TTL (e.g. 1 h), never less than the default; any other
block gets `default_ttl_s` (5 min, the API's default cache TTL).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hafiza.engine.connector import KVConnector, TierHit, TierLoad
from hafiza.store.codecs import DEFAULT_STORE_CODEC, check_codec, decode_block, encode_block
from hafiza.store.keys import block_key
from hafiza.store.logs import store_log
from hafiza.store.redis_store import DEFAULT_TTL_S
from hafiza.store.tiered import TieredStore

if TYPE_CHECKING:
    from hafiza.cache.pool import KVPool
    from hafiza.engine.engine import LLMEngine


PinTTL = Callable[[int], "float | None"]


@dataclass
class ConnectorStats:
    """Counters of the connector's own work (the tiers count theirs in `TieredStore.stats`)."""

    saves: int = 0
    saves_skipped: int = 0
    saves_dropped: int = 0
    encode_errors: int = 0
    encoded_blocks: int = 0
    lookups: int = 0
    loads: int = 0
    blocks_loaded: int = 0
    blocks_corrupt: int = 0
    lookup_errors: int = 0
    pending_bytes: int = 0
    decisions: dict[str, int] = field(default_factory=lambda: {"load": 0, "recompute": 0, "miss": 0})


@dataclass
class _Save:
    key: str
    block: torch.Tensor
    ttl_s: float | None

    @property
    def nbytes(self) -> int:
        return self.block.numel() * self.block.element_size()


class _Average:
    """An exponential moving average that starts at its first sample."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha, self.value, self.samples = alpha, 0.0, 0

    def add(self, x: float) -> None:
        self.value = x if self.samples == 0 else self.value + self.alpha * (x - self.value)
        self.samples += 1


class StoreConnector(KVConnector):
    """Write-through of full blocks, prefix lookup with a cost model, verified loads; see the module docstring."""

    def __init__(
        self,
        store: TieredStore,
        pool: KVPool,
        *,
        model_fingerprint: str,
        kv_dtype: str,
        block_shape: tuple[int, int, int, int],
        torch_dtype: torch.dtype,
        codec: str = DEFAULT_STORE_CODEC,
        default_ttl_s: float | None = DEFAULT_TTL_S,
        pin_ttl: PinTTL | None = None,
        max_pending_bytes: int = 128 << 20,
    ) -> None:
        """`block_shape` is (layers, block_size, kv_heads, head_dim); `pin_ttl(block_id)` gives the TTL of a
        block under an API cache breakpoint (None when unpinned)."""
        self.store, self.pool = store, pool
        self.codec = check_codec(codec)
        self.model_fingerprint, self.kv_dtype = model_fingerprint, kv_dtype
        layers, self.block_size, heads, dim = block_shape
        self.shape = (layers, 2, self.block_size, heads, dim)
        self.torch_dtype = torch_dtype
        self.raw_block_bytes = 2 * layers * self.block_size * heads * dim * torch.finfo(torch_dtype).bits // 8
        self.default_ttl_s = default_ttl_s
        self.pin_ttl = pin_ttl
        self.max_pending_bytes = max_pending_bytes
        self.stats = ConnectorStats()
        self._stored_bytes = _Average()
        self._decode_s = _Average()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queued = 0
        self._queue: queue.SimpleQueue[_Save | None] = queue.SimpleQueue()
        self._closed = False
        self._worker = threading.Thread(target=self._encode_loop, name="hafiza-store-encoder", daemon=True)
        self._worker.start()

    @classmethod
    def for_engine(
        cls, engine: LLMEngine, store: TieredStore, *, codec: str = DEFAULT_STORE_CODEC,
        default_ttl_s: float | None = DEFAULT_TTL_S, max_pending_bytes: int = 128 << 20,
    ) -> StoreConnector:
        """A connector for `engine`'s pool, model fingerprint, KV dtype, block size and cache pins. The stored
        block's shape and dtype are whatever the pool's `read_blocks` gives (the storage dtype of a
        full-precision pool, e.g. bf16 under fp32 compute)."""
        model_fp, kv_dtype, block_size = engine.extra_keys
        probe = engine.kv.read_blocks([0])
        layers, _, _, probe_bs, heads, dim = probe.shape
        assert probe_bs == block_size, f"pool blocks hold {probe_bs} tokens, the engine says {block_size}"
        return cls(
            store, engine.kv, model_fingerprint=model_fp, kv_dtype=kv_dtype,
            block_shape=(layers, block_size, heads, dim), torch_dtype=probe.dtype,
            codec=codec, default_ttl_s=default_ttl_s, pin_ttl=engine_pin_ttl(engine),
            max_pending_bytes=max_pending_bytes,
        )  # fmt: skip

    def key(self, block_hash: str) -> str:
        """The store key of a block: its chained prefix hash qualified by model, KV dtype, block size, codec."""
        return block_key(block_hash, self.model_fingerprint, self.kv_dtype, self.block_size, self.codec)

    # -- save: engine thread copies, encoder thread encodes and queues the write -----------------------------

    def save(self, block_hash: str, block_id: int) -> None:
        """Copy the block out and queue it (dropped, and counted, when the encoder is too far behind)."""
        if self._closed:
            return
        self.stats.saves += 1
        try:
            job = _Save(self.key(block_hash), self.pool.read_blocks([block_id])[:, :, 0], self._ttl(block_id))
        except Exception:
            store_log.error(f"connector {id(self)} copy", "store: cannot copy block %d out of the pool; not saved",
                            block_id, exc_info=True)  # fmt: skip
            return
        with self._lock:
            if self._queued and self.stats.pending_bytes + job.nbytes > self.max_pending_bytes:
                self.stats.saves_dropped += 1
                return
            self._queued += 1
            self.stats.pending_bytes += job.nbytes
        self._queue.put(job)

    def _ttl(self, block_id: int) -> float | None:
        """The pin's TTL for a block under a cache breakpoint (never below the default), else the default."""
        if self.default_ttl_s is None:
            return None
        pinned = self.pin_ttl(block_id) if self.pin_ttl is not None else None
        return max(self.default_ttl_s, pinned or 0.0)

    def _present(self, key: str) -> bool:
        """Whether the store already holds `key` where a write would put it (every tier; write-back: RAM)."""
        tiers = self.store.tiers[:1] if self.store.write_back else self.store.tiers
        return bool(tiers) and all(t.contains(key) for t in tiers)

    def _encode_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                if self._present(job.key):
                    self.stats.saves_skipped += 1
                    continue
                blob = encode_block(job.block, self.codec)
                with self._lock:
                    self._stored_bytes.add(len(blob))
                    self.stats.encoded_blocks += 1
                self.store.put_async(job.key, blob, ttl_s=job.ttl_s, raw_nbytes=job.nbytes)
            except Exception:
                self.stats.encode_errors += 1
                store_log.error(f"connector {id(self)} encode", "store: encoding block %s failed; not saved", job.key,
                                exc_info=True)  # fmt: skip
            finally:
                with self._lock:
                    self._queued -= 1
                    self.stats.pending_bytes -= job.nbytes
                    if self._queued == 0:
                        self._idle.notify_all()

    # -- lookup and load: engine thread, at admission ------------------------------------------------------

    def lookup(self, hashes: Sequence[str]) -> TierHit:
        """The tiers' longest run of `hashes` and whether loading it beats recomputing.

        Runs on the engine thread, so it never raises: any failure is a miss (the request recomputes).
        """
        self.stats.lookups += 1
        if not hashes or self._closed:
            return TierHit()
        try:
            return self._lookup(hashes)
        except Exception as e:
            self.stats.lookup_errors += 1
            self.stats.decisions["miss"] += 1
            store_log.error(f"connector {id(self)} lookup", "store: lookup of %d blocks failed; recomputing",
                            len(hashes), exc_info=True)  # fmt: skip
            return TierHit(reason=f"miss: store lookup failed ({type(e).__name__}: {e})")

    def _lookup(self, hashes: Sequence[str]) -> TierHit:
        keys = [self.key(h) for h in hashes]
        found = self.store.lookup_prefix(keys)
        n = found.num_hits
        if n == 0:
            self.stats.decisions["miss"] += 1
            return TierHit(reason=f"miss: none of the next {len(keys)} blocks is in a store tier")
        per_block = self._stored_bytes.value if self._stored_bytes.samples else self.raw_block_bytes
        by_tier = {tier: int(count * per_block) for tier, count in found.per_tier().items()}
        decode_s = self._decode_s.value * n
        decision = self.store.cost.decide(n * self.block_size, by_tier, extra_s=decode_s)
        self.stats.decisions["load" if decision.load else "recompute"] += 1
        return TierHit(tuple(hashes[:n]), tuple(found.sources[:n]), decision.load, decision.reason)

    def load(self, hit: TierHit, block_ids: Sequence[int]) -> TierLoad:
        """Fetch, verify and write the hit's leading blocks into `block_ids`; which arrived intact, from where."""
        keys = [self.key(h) for h in hit.hashes[: len(block_ids)]]
        self.stats.loads += 1
        blocks: list[torch.Tensor] = []
        try:
            values = self.store.load(keys)
            t0 = time.perf_counter()
            for key, value in zip(keys, values, strict=False):
                try:
                    blocks.append(decode_block(value, self.shape, self.torch_dtype))
                except Exception as exc:
                    self._drop_corrupt(key, exc)
                    break
            if blocks:
                self._decode_s.add((time.perf_counter() - t0) / len(blocks))
                self.pool.write_blocks(list(block_ids[: len(blocks)]), torch.stack(blocks, dim=2))
        except Exception:
            store_log.error(f"connector {id(self)} load", "store: loading %d blocks failed; recomputing them",
                            len(keys), exc_info=True)  # fmt: skip
            blocks = []
        n = len(blocks)
        self.stats.blocks_loaded += n
        note = f"only {n} of {len(keys)} blocks arrived intact, the rest were recomputed" if n < len(keys) else ""
        return TierLoad(hit.sources[:n], note)

    def _drop_corrupt(self, key: str, exc: Exception) -> None:
        """A block failed the codec's checks: delete it everywhere so nobody loads it again."""
        self.stats.blocks_corrupt += 1
        store_log.warning(
            f"connector {id(self)} corrupt",
            "store: block %s is corrupt (%s); dropped from every tier, recomputing", key, exc,
        )  # fmt: skip
        for tier in self.store.tiers:
            tier.delete(key)

    # -- engine hooks and shutdown ---------------------------------------------------------------------------

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """Measured prefill speed: the recompute side of the cost model."""
        self.store.observe_prefill(num_tokens, seconds)

    def flush(self, timeout_s: float = 30.0) -> bool:  # type: ignore[override]
        """Encode everything queued and write it down every tier; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._queued:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return self.store.flush(max(0.0, deadline - time.monotonic()))

    def close(self, timeout_s: float = 30.0) -> None:
        """Flush pending writes, stop the encoder and close the tiers."""
        if self._closed:
            return
        flushed = self.flush(timeout_s)
        self._closed = True
        self._queue.put(None)
        if flushed:
            self._worker.join()
        self.store.close(timeout_s if flushed else 0.0)


def engine_pin_ttl(engine: LLMEngine) -> PinTTL:
    """TTL of the cache breakpoint covering a block of a running request (engine thread only), else None."""

    def ttl(block_id: int) -> float | None:
        best = None
        bs = engine.layout.block_size
        for seq in engine.scheduler.running:
            for pin in seq.pins:
                covered = min(pin.num_tokens, seq.num_prompt_tokens) // bs
                if block_id in seq.block_table[:covered]:
                    best = max(best or 0.0, pin.ttl_s)
        return best

    return ttl
