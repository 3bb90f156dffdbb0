"""Ref-counted KV blocks with prefix caching, LRU eviction and TTL pins.

Every block is in exactly one state: *free* (no content worth keeping), *cached* (ref_count 0, keeps its
contents and hash, reusable by a prefix hit until evicted) or *in use* (ref_count > 0). Free and cached blocks
sit in the free queue, whose order is the eviction (LRU) order. A pinned block (an API cache breakpoint with a
TTL) is cached or in use; while its pin lasts it waits in a second queue that is only evicted from when no
unpinned block is left — so a running request never deadlocks on pins, and the eviction is counted.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger("hafiza.cache")


class NoFreeBlocksError(RuntimeError):
    """Raised if allocation is attempted without checking capacity first (a scheduler bug, never user input)."""


@dataclass
class Block:
    """One KV block's bookkeeping; its K/V live in the pool at index `block_id`."""

    block_id: int
    ref_count: int = 0
    hash: str | None = None
    token_ids: tuple[int, ...] = ()
    pin_expiry: float = 0.0
    pin_ttl: float = 0.0


@dataclass
class BlockStats:
    """Counts by state and the prefix-cache counters (in tokens, as vLLM reports them)."""

    total: int
    free: int
    cached: int
    in_use: int
    pinned: int
    block_size: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    evictions: int
    pinned_evictions: int

    @property
    def usage_perc(self) -> float:
        """Fraction of blocks held by running requests (vLLM's kv_cache_usage_perc)."""
        return self.in_use / self.total if self.total else 0.0


class BlockManager:
    """Allocation, prefix matching, caching, pinning and freeing of KV blocks. Not thread-safe: one engine
    thread owns it."""

    def __init__(self, num_blocks: int, block_size: int, clock: Callable[[], float] = time.monotonic) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a block pool needs at least one block of at least one token")
        self.block_size, self.clock = block_size, clock
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.free_pinned: OrderedDict[int, None] = OrderedDict()
        self.hash_to_block: dict[str, int] = {}
        self._pin_heap: list[tuple[float, int]] = []
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.evictions = 0
        self.pinned_evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def num_allocatable(self) -> int:
        """Blocks an allocation may take: free and cached ones (pinned cached ones as a last resort)."""
        return len(self.free_queue) + len(self.free_pinned)

    def match_prefix(self, token_ids: Sequence[int], hashes: Sequence[str], count: bool = True) -> list[int]:
        """Blocks holding the longest cached prefix of `token_ids`, verified token by token, capped so that at
        least the last prompt token is recomputed (its logits are needed). Takes no references."""
        limit = min(len(hashes), (len(token_ids) - 1) // self.block_size)
        hit: list[int] = []
        bs = self.block_size
        for i in range(limit):
            bid = self.hash_to_block.get(hashes[i])
            if bid is None or self.blocks[bid].token_ids != tuple(token_ids[i * bs : (i + 1) * bs]):
                break
            hit.append(bid)
        if count:
            self.prefix_cache_queries += len(token_ids)
            self.prefix_cache_hits += len(hit) * bs
        return hit

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks (a prefix hit); a hit refreshes the blocks' pin TTLs."""
        now = self.clock()
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref_count == 0:
                self.free_queue.pop(bid, None)
                self.free_pinned.pop(bid, None)
            block.ref_count += 1
            if block.pin_expiry > now:
                self._set_pin(block, now + block.pin_ttl)

    def allocate(self, n: int) -> list[int]:
        """Take `n` fresh blocks (ref_count 1), evicting least recently used cached blocks as needed."""
        if n > self.num_allocatable():
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_allocatable()} allocatable")
        self._expire_pins()
        out = []
        for _ in range(n):
            if self.free_queue:
                bid, _ = self.free_queue.popitem(last=False)
            else:
                bid, _ = self.free_pinned.popitem(last=False)
                self.pinned_evictions += 1
                log.warning("KV memory exhausted: evicting pinned block %d before its TTL", bid)
            block = self.blocks[bid]
            if block.hash is not None:
                self._evict(block)
            block.ref_count = 1
            out.append(bid)
        return out

    def _evict(self, block: Block) -> None:
        if self.hash_to_block.get(block.hash or "") == block.block_id:
            del self.hash_to_block[block.hash]  # type: ignore[arg-type]
        block.hash, block.token_ids, block.pin_expiry, block.pin_ttl = None, (), 0.0, 0.0
        self.evictions += 1

    def cache_block(self, block_id: int, block_hash: str, token_ids: Sequence[int]) -> None:
        """Register a now-full block under its chained hash so later requests can hit it."""
        block = self.blocks[block_id]
        if block.hash is not None or block_hash in self.hash_to_block:
            return  # already cached, or the same content computed twice concurrently: keep the first
        block.hash, block.token_ids = block_hash, tuple(token_ids)
        self.hash_to_block[block_hash] = block_id

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per block, tail first, so a sequence's last blocks are evicted before its head."""
        now = self.clock()
        for bid in reversed(block_ids):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise AssertionError(f"block {bid} freed more often than acquired")
            if block.ref_count > 0:
                continue
            if block.hash is None:
                self.free_queue[bid] = None
                self.free_queue.move_to_end(bid, last=False)
            elif block.pin_expiry > now:
                self.free_pinned[bid] = None
            else:
                self.free_queue[bid] = None

    def pin(self, hashes: Sequence[str], ttl_s: float) -> int:
        """Keep the cached blocks holding `hashes` ahead of eviction for `ttl_s` seconds (extends, never shortens,
        a pin). Pins by content: a request whose own copy of a block was a duplicate pins the cached one.
        Returns how many blocks were pinned (hashes no longer cached are skipped)."""
        now = self.clock()
        pinned = 0
        for h in hashes:
            bid = self.hash_to_block.get(h)
            if bid is None:
                continue
            block = self.blocks[bid]
            block.pin_ttl = max(block.pin_ttl if block.pin_expiry > now else 0.0, ttl_s)
            self._set_pin(block, max(block.pin_expiry, now + ttl_s))
            pinned += 1
        return pinned

    def _set_pin(self, block: Block, expiry: float) -> None:
        block.pin_expiry = expiry
        heapq.heappush(self._pin_heap, (expiry, block.block_id))
        if block.ref_count == 0 and block.block_id in self.free_queue:
            del self.free_queue[block.block_id]
            self.free_pinned[block.block_id] = None

    def _expire_pins(self) -> None:
        """Expired pins turn their blocks into ordinary cached blocks at the cold end of the LRU queue."""
        now = self.clock()
        while self._pin_heap and self._pin_heap[0][0] <= now:
            expiry, bid = heapq.heappop(self._pin_heap)
            block = self.blocks[bid]
            if block.pin_expiry != expiry:
                continue  # refreshed or evicted since
            block.pin_expiry, block.pin_ttl = 0.0, 0.0
            if bid in self.free_pinned:
                del self.free_pinned[bid]
                self.free_queue[bid] = None
                self.free_queue.move_to_end(bid, last=False)

    def drop(self, hashes: Sequence[str]) -> int:
        """Evict the given cached blocks now (the dashboard's "drop prefix"); blocks in use are left alone.
        Returns how many were dropped."""
        dropped = 0
        for h in hashes:
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].ref_count > 0:
                continue
            self.free_pinned.pop(bid, None)
            self.free_queue[bid] = None
            self.free_queue.move_to_end(bid, last=False)
            self._evict(self.blocks[bid])
            dropped += 1
        return dropped

    def stats(self) -> BlockStats:
        self._expire_pins()
        now = self.clock()
        in_use = sum(1 for b in self.blocks if b.ref_count > 0)
        cached = sum(1 for b in self.blocks if b.ref_count == 0 and b.hash is not None)
        pinned = sum(1 for b in self.blocks if b.pin_expiry > now and b.hash is not None)
        return BlockStats(
            total=self.num_blocks, free=self.num_blocks - in_use - cached, cached=cached, in_use=in_use,
            pinned=pinned, block_size=self.block_size, prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits, evictions=self.evictions,
            pinned_evictions=self.pinned_evictions,
        )

    def check_integrity(self) -> None:
        """Assert the invariants: states partition the pool, ref_count 0 ⇔ queued, pinned ⊆ cached/in use,
        the hash map and the blocks agree."""
        queued = set(self.free_queue)
        pinned_q = set(self.free_pinned)
        assert not queued & pinned_q, "a block is in both free queues"
        free = cached = in_use = 0
        now = self.clock()
        for b in self.blocks:
            assert b.ref_count >= 0, f"block {b.block_id} has negative ref_count"
            in_queue = b.block_id in queued or b.block_id in pinned_q
            assert (b.ref_count == 0) == in_queue, f"block {b.block_id}: ref_count {b.ref_count}, queued {in_queue}"
            if b.hash is not None:
                assert self.hash_to_block.get(b.hash) == b.block_id, f"block {b.block_id} hash not in the map"
                assert len(b.token_ids) == self.block_size, f"cached block {b.block_id} is not full"
            if b.block_id in pinned_q:
                assert b.hash is not None, f"unhashed block {b.block_id} in the pinned queue"
            if b.pin_expiry > now:
                assert b.hash is not None, f"pinned block {b.block_id} is not cached"
            if b.ref_count > 0:
                in_use += 1
            elif b.hash is not None:
                cached += 1
            else:
                free += 1
        for h, bid in self.hash_to_block.items():
            assert self.blocks[bid].hash == h, f"hash map points {h} at block {bid} holding {self.blocks[bid].hash}"
        assert free + cached + in_use == self.num_blocks, "free + cached + in_use != total"
