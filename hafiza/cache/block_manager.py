"""Ref-counted KV blocks with prefix caching, LRU eviction and TTL pins.

Every block is in exactly one state: *free* (no content worth keeping), *cached* (ref_count 0, keeps its
contents and hash, reusable by a prefix hit until evicted) or *in use* (ref_count > 0). Free and cached blocks
sit in the free queue, whose order is the eviction (LRU) order. A pinned block (an API cache breakpoint with a
TTL) is cached or in use; while its pin lasts it waits in a second queue that is only evicted from when no
unpinned block is left — so a running request never deadlocks on pins, and the eviction is counted.

A cached block knows its place in its prefix chain (`parent`: the previous block's hash, `position`: its block
index), so the cached prefixes can be listed from the pool alone (`chains`). Admission is `match_prefix` (a
`PrefixMatch`, no side effects) then `admit` (an `Allocation`, or None when it does not fit); the block manager
counts its own prefix-cache queries and hits there and in `cache_loaded`. An `events` sink (optional) hears of
every block registered (with its cache partition) and every cached block evicted.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from hafiza.cache.events import BlockEventSink

log = logging.getLogger("hafiza.cache")


class NoFreeBlocksError(RuntimeError):
    """Raised if allocation is attempted without checking capacity first (a scheduler bug, never user input)."""


@dataclass
class Block:
    """One KV block's bookkeeping; its K/V live in the pool at index `block_id`. While cached (`hash` set):
    `parent` is the hash of the block before it in its chain (None at `position` 0), `uses` counts the requests
    that registered or hit it, `last_used` is when one last took or released it (the manager's clock)."""

    block_id: int
    ref_count: int = 0
    hash: str | None = None
    token_ids: tuple[int, ...] = ()
    pin_expiry: float = 0.0
    pin_ttl: float = 0.0
    parent: str | None = None
    position: int = 0
    uses: int = 0
    last_used: float = 0.0


@dataclass(frozen=True)
class PrefixMatch:
    """The pool's cached prefix of a prompt: `block_ids` hold its first blocks, in order; `num_unheld` of them no
    request holds (they sit in a free queue, so taking them uses allocatable blocks)."""

    block_ids: tuple[int, ...] = ()
    num_unheld: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class Allocation:
    """Blocks an admission took: the prefix hit's `hit` blocks (one reference each), then `fresh` ones."""

    hit: tuple[int, ...]
    fresh: tuple[int, ...]

    @property
    def block_ids(self) -> list[int]:
        return [*self.hit, *self.fresh]


class ChainLink(NamedTuple):
    """One cached block as a chain sees it: its id and hash, its parent's hash and its position."""

    block_id: int
    hash: str
    parent: str | None
    position: int


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

    def __init__(self, num_blocks: int, block_size: int, clock: Callable[[], float] = time.monotonic,
                 events: BlockEventSink | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a block pool needs at least one block of at least one token")
        self.block_size, self.clock, self.events = block_size, clock, events
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

    def match_prefix(self, token_ids: Sequence[int], hashes: Sequence[str],
                     max_blocks: int | None = None) -> PrefixMatch:
        """The longest cached prefix of `token_ids` (at most `max_blocks` blocks), verified token by token, capped
        so that at least the last prompt token is recomputed (its logits are needed). Changes nothing: no
        references, no counts (`admit` takes and counts it)."""
        limit = min(len(hashes), (len(token_ids) - 1) // self.block_size)
        if max_blocks is not None:
            limit = min(limit, max_blocks)
        hit: list[int] = []
        bs = self.block_size
        for i in range(limit):
            bid = self.hash_to_block.get(hashes[i])
            if bid is None or self.blocks[bid].token_ids != tuple(token_ids[i * bs : (i + 1) * bs]):
                break
            hit.append(bid)
        return PrefixMatch(tuple(hit), sum(1 for b in hit if self.blocks[b].ref_count == 0))

    def admit(self, match: PrefixMatch, num_fresh: int, num_query_tokens: int) -> Allocation | None:
        """Take a reference on each block of `match` (from `match_prefix`, unchanged since) and `num_fresh` fresh
        blocks; None, changing and counting nothing, when they do not fit. Counts `num_query_tokens` prompt
        tokens looked up (0 when prefix caching is off) and the match's tokens as hits."""
        if num_fresh > self.num_allocatable() - match.num_unheld:
            return None
        now = self.clock()
        self.acquire(match.block_ids)
        for bid in match.block_ids:
            self.blocks[bid].uses += 1
            self.blocks[bid].last_used = now
        fresh = self.allocate(num_fresh)
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += match.num_blocks * self.block_size
        return Allocation(match.block_ids, tuple(fresh))

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
            if self.events is not None:
                self.events.evicted(block.hash)  # type: ignore[arg-type]
        block.hash, block.token_ids, block.pin_expiry, block.pin_ttl = None, (), 0.0, 0.0
        block.parent, block.position, block.uses, block.last_used = None, 0, 0, 0.0
        self.evictions += 1

    def cache_block(self, block_id: int, block_hash: str, token_ids: Sequence[int], parent: str | None = None,
                    position: int = 0, partition: str | None = None) -> bool:
        """Register a now-full block under its chained hash so later requests can hit it; `parent` is the hash
        of the block before it in its chain (None for a chain's first block, at `position` 0). Returns whether it
        was registered: an already cached block, or content another block already holds (computed twice
        concurrently: the first is kept and counted as used once more), is not. `partition` is the chain's cache
        partition (None: shared), told to the events sink."""
        if (parent is None) != (position == 0):
            raise ValueError(f"a chain's block at position {position} needs a parent hash exactly when position > 0")
        block = self.blocks[block_id]
        if block.hash is not None:
            return False
        now = self.clock()
        if block_hash in self.hash_to_block:
            kept = self.blocks[self.hash_to_block[block_hash]]
            kept.uses, kept.last_used = kept.uses + 1, now
            return False
        block.hash, block.token_ids, block.parent, block.position = block_hash, tuple(token_ids), parent, position
        block.uses, block.last_used = 1, now
        self.hash_to_block[block_hash] = block_id
        if self.events is not None:
            self.events.registered(block_hash, parent, block.token_ids, partition)
        return True

    def cache_chain(self, block_ids: Sequence[int], hashes: Sequence[str], token_ids: Sequence[int], start: int,
                    end: int, partition: str | None = None) -> int:
        """Register the full blocks `start`..`end - 1` of one chain: block i holds
        `token_ids[i * block_size : (i + 1) * block_size]` in `block_ids[i]` under `hashes[i]`, in cache
        partition `partition`. Returns how many were registered."""
        bs = self.block_size
        return sum(self.cache_block(block_ids[i], hashes[i], token_ids[i * bs : (i + 1) * bs],
                                    hashes[i - 1] if i else None, i, partition) for i in range(start, end))

    def cache_loaded(self, block_ids: Sequence[int], hashes: Sequence[str], token_ids: Sequence[int], start: int,
                     end: int, partition: str | None = None) -> None:
        """`cache_chain` for blocks a tier below the pool just filled: their tokens count as prefix-cache hits
        (the request did not compute them)."""
        self.cache_chain(block_ids, hashes, token_ids, start, end, partition)
        self.prefix_cache_hits += (end - start) * self.block_size

    def chains(self) -> list[ChainLink]:
        """Every cached block with its chain link, by block id."""
        return [ChainLink(b.block_id, b.hash, b.parent, b.position) for b in self.blocks if b.hash is not None]

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per block, tail first, so a sequence's last blocks are evicted before its head."""
        now = self.clock()
        for bid in reversed(block_ids):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise AssertionError(f"block {bid} freed more often than acquired")
            if block.hash is not None:
                block.last_used = now
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
        the hash map and the blocks agree, chain links are consistent, the counters are ordered."""
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
                assert (b.parent is None) == (b.position == 0), f"block {b.block_id}: parent {b.parent} at " \
                                                                f"position {b.position}"
                assert b.parent != b.hash, f"block {b.block_id} is its own parent"
                assert b.uses >= 1, f"cached block {b.block_id} counts {b.uses} uses"
                pid = self.hash_to_block.get(b.parent or "")
                if pid is not None:
                    parent = self.blocks[pid]
                    assert parent.position == b.position - 1, \
                        f"block {b.block_id} at position {b.position} has its parent {pid} at {parent.position}"
            else:
                assert (b.parent, b.position, b.uses) == (None, 0, 0), f"free block {b.block_id} keeps chain data"
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
        assert 0 <= self.prefix_cache_hits <= self.prefix_cache_queries, \
            f"{self.prefix_cache_hits} prefix-cache hits for {self.prefix_cache_queries} queried tokens"
        assert self.prefix_cache_hits % self.block_size == 0, f"{self.prefix_cache_hits} hit tokens: not whole blocks"
        assert 0 <= self.pinned_evictions <= self.evictions, \
            f"{self.pinned_evictions} pinned evictions of {self.evictions} evictions"
