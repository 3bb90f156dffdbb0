"""The KV cache manager: the one owner of every request's blocks.

It maps request id -> block table (the pool blocks a request holds, and the logical block each one holds), and
every change to a table goes through it: admission, growth, eviction, preemption, rollback of rejected drafted
rows, registration in the prefix cache and pins. Callers get frozen results (`KVBlocks`, `Allocation`); the
scheduler and the engine never write a table themselves. The block pool below it (`BlockManager`) counts
references, holds the prefix cache and evicts least recently used blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hafiza.cache.block_manager import Allocation, BlockManager, PrefixMatch
from hafiza.cache.eviction import AttentionScores, EvictionPolicy
from hafiza.cache.hashing import BlockHash


@dataclass(frozen=True)
class KVBlocks:
    """A request's blocks as the runner reads them: `block_ids[i]` holds logical block `logical[i]` (the
    identity until eviction drops blocks; `evicted` then says kept blocks keep their original positions)."""

    block_ids: tuple[int, ...] = ()
    logical: tuple[int, ...] = ()
    evicted: bool = False


@dataclass
class _Table:
    """The manager's own record of one request: its blocks, and how many leading full blocks are registered in
    the prefix cache (or, once evicted, skipped: K/V computed without the dropped tokens is never a prefix)."""

    block_ids: list[int] = field(default_factory=list)
    logical: list[int] = field(default_factory=list)
    evicted: bool = False
    num_registered: int = 0


class KVCacheManager:
    """Per-request block tables over one block pool. With an eviction policy and `budget_blocks`, no request keeps
    more than that many blocks: before growing, the policy picks the blocks to keep and the rest are freed."""

    def __init__(self, pool: BlockManager, eviction: EvictionPolicy | None = None, budget_blocks: int | None = None,
                 scores: AttentionScores | None = None) -> None:
        self.pool, self.eviction, self.budget_blocks, self.scores = pool, eviction, budget_blocks, scores
        self.block_size = pool.block_size
        self.evicted_tokens = 0  # tokens all requests dropped by eviction, since start
        self._tables: dict[str, _Table] = {}

    def blocks(self, request_id: str) -> KVBlocks:
        """The request's blocks now (empty if it holds none)."""
        t = self._tables.get(request_id)
        return KVBlocks() if t is None else KVBlocks(tuple(t.block_ids), tuple(t.logical), t.evicted)

    def holds(self, request_id: str) -> bool:
        """Whether the request holds any block."""
        return request_id in self._tables

    def num_registered(self, request_id: str) -> int:
        """Leading full blocks of the request already registered in the prefix cache (or skipped, once evicted)."""
        t = self._tables.get(request_id)
        return t.num_registered if t is not None else 0

    def evicted(self, request_id: str) -> bool:
        t = self._tables.get(request_id)
        return t is not None and t.evicted

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Fresh blocks the request needs to hold K/V for its first `num_tokens` positions."""
        t = self._tables.get(request_id)
        held = t.logical[-1] + 1 if t is not None and t.logical else 0
        return max(0, -(-num_tokens // self.block_size) - held)

    def admit(self, request_id: str, match: PrefixMatch, num_fresh: int, num_query_tokens: int,
              ) -> Allocation | None:
        """Give a request holding nothing the pool's prefix `match` and `num_fresh` fresh blocks (see
        `BlockManager.admit`); None, changing nothing, when they do not fit."""
        assert request_id not in self._tables, f"request {request_id} is admitted while it holds blocks"
        alloc = self.pool.admit(match, num_fresh, num_query_tokens)
        if alloc is None:
            return None
        if self.scores is not None and alloc.fresh:
            self.scores.reset(list(alloc.fresh))
        ids = alloc.block_ids
        self._tables[request_id] = _Table(ids, list(range(len(ids))))
        return alloc

    def register_loaded(self, request_id: str, hashes: Sequence[BlockHash], token_ids: Sequence[int], start: int,
                        end: int, partition: str | None) -> None:
        """Register blocks `start`..`end - 1` that a tier below the pool just filled (prefix-cache hits)."""
        self.pool.cache_loaded(self._tables[request_id].block_ids, hashes, token_ids, start, end, partition)

    def admitted(self, request_id: str, num_cached_blocks: int) -> None:
        """Admission is done: the first `num_cached_blocks` blocks (pool hit and loaded) are registered."""
        self._tables[request_id].num_registered = num_cached_blocks

    def grow(self, request_id: str, need: int) -> None:
        """Append `need` fresh blocks after the request's last logical block (the caller checked they fit)."""
        t = self._tables.setdefault(request_id, _Table())
        held = t.logical[-1] + 1 if t.logical else 0
        fresh = self.pool.allocate(need)
        t.block_ids += fresh
        t.logical += range(held, held + need)
        if self.scores is not None and fresh:
            self.scores.reset(fresh)

    def evict_for(self, request_id: str, need: int) -> None:
        """Drop the blocks the eviction policy chooses so the request stays within its budget after growing by
        `need` (no-op without a policy, or while it fits)."""
        t = self._tables.get(request_id)
        if (self.eviction is None or self.budget_blocks is None or t is None
                or len(t.block_ids) + need <= self.budget_blocks):
            return
        bs = self.block_size
        scores = self.scores.score(t.block_ids) if self.scores is not None else None
        keep = self.eviction.select(len(t.block_ids), self.budget_blocks - need, bs, scores)
        kept = set(keep)
        dropped = [b for i, b in enumerate(t.block_ids) if i not in kept]
        self.pool.free(dropped)
        t.block_ids = [t.block_ids[i] for i in keep]
        t.logical = [t.logical[i] for i in keep]
        t.evicted = True
        self.evicted_tokens += len(dropped) * bs

    def truncate(self, request_id: str, num_computed: int) -> None:
        """Free the blocks past the one holding position `num_computed - 1` (written only for rejected drafted
        rows). A partly rejected block is kept: its stale slots are overwritten before it fills."""
        t = self._tables.get(request_id)
        keep = -(-num_computed // self.block_size)
        if t is not None and len(t.block_ids) > keep:
            self.pool.free(t.block_ids[keep:])
            del t.block_ids[keep:], t.logical[keep:]

    def free(self, request_id: str) -> None:
        """Release every block of the request (finished, aborted or preempted); its full blocks stay cached."""
        t = self._tables.pop(request_id, None)
        if t is not None:
            self.pool.free(t.block_ids)

    def register_full(self, request_id: str, hashes: Sequence[BlockHash], token_ids: Sequence[int], num_full: int,
                      partition: str | None) -> list[tuple[BlockHash, int]]:
        """Register the request's full blocks up to `num_full` in the prefix cache; returns each newly full block
        as (hash, pool block) for the tiers below. An evicted request's blocks are skipped, never offered."""
        t = self._tables[request_id]
        if t.evicted:
            t.num_registered = max(t.num_registered, num_full)
            return []
        if num_full <= t.num_registered:
            return []
        self.pool.cache_chain(t.block_ids, hashes, token_ids, t.num_registered, num_full, partition)
        new = [(hashes[b], t.block_ids[b]) for b in range(t.num_registered, num_full)]
        t.num_registered = num_full
        return new

    def pin(self, hashes: Sequence[BlockHash], ttl_s: float) -> int:
        """Keep the cached blocks of `hashes` for `ttl_s` seconds (an API cache breakpoint)."""
        return self.pool.pin(hashes, ttl_s)

    def check_integrity(self, computed: Mapping[str, int], hashes: Mapping[str, Sequence[BlockHash]]) -> None:
        """The pool's invariants, plus: only live requests hold tables (`computed`: live request id -> tokens
        computed), each pool block's reference count is the number of tables holding it, no request registered
        more than it computed, and a registered block is cached under its own chain's hash (or not at all: a
        duplicate of a block cached first elsewhere)."""
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for rid, t in self._tables.items():
            assert rid in computed, f"request {rid} holds blocks but is not live"
            assert len(t.block_ids) == len(t.logical), f"request {rid}: table and logical positions differ in length"
            for bid in t.block_ids:
                refs[bid] = refs.get(bid, 0) + 1
            assert t.num_registered * self.block_size <= computed[rid], (
                f"request {rid}: {t.num_registered} blocks registered, {computed[rid]} tokens computed")
            if not t.evicted:
                own = hashes.get(rid, ())
                for i, bid in enumerate(t.block_ids[: t.num_registered]):
                    held = self.pool.blocks[bid].hash
                    assert held in (None, own[i]), (
                        f"request {rid}: its block {i} (pool block {bid}) is cached under another hash")
        for b in self.pool.blocks:
            assert refs.get(b.block_id, 0) == b.ref_count, (
                f"block {b.block_id}: ref_count {b.ref_count} but {refs.get(b.block_id, 0)} table references")
