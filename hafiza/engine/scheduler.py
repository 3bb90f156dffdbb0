"""Continuous batching: every step, running decodes first, then prefill chunks, within a token budget.

Sequences join and leave the batch at every step. A long prompt is prefilled in chunks so running streams keep
decoding. Admission needs free blocks; when a running sequence cannot grow, the most recently admitted one is
preempted by recompute: its blocks are freed (their full blocks stay cached, so recomputing mostly hits the
prefix cache) and it returns to the front of the queue with prompt + generated tokens.

Admission runs in four steps, each with a named result: the pool match (`PrefixMatch`, the block manager's cached
prefix), the tier match (`TierMatch`, what the tiers below the pool offer past it), the allocation
(`Allocation`, or nothing when it does not fit: the sequence waits) and the registration (`Registration`: the
blocks loaded from the tiers are registered in the pool, the tier outcome is recorded on the sequence).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from hafiza.cache.block_manager import Allocation, PrefixMatch
from hafiza.cache.errors import EvictionError
from hafiza.cache.hashing import BlockHash
from hafiza.cache.kv_cache_manager import KVBlocks, KVCacheManager
from hafiza.engine.connector import KVConnector, TierDecision, TierHit, TierLoad, TierOutcome
from hafiza.engine.sequence import Sequence, Status

Proposer = Callable[[Sequence, int], list[int]]  # (decoding sequence, most tokens) -> tokens drafted past it


@dataclass
class SchedulerConfig:
    """Batch limits: at most `max_num_seqs` running, at most `max_num_batched_tokens` tokens per step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True


@dataclass
class ScheduledBatch:
    """What one forward step computes: `num_new[i]` tokens of `seqs[i]`, single-token decodes first, into the
    blocks `blocks[i]` (the cache manager's tables once the step was planned)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    blocks: list[KVBlocks] = field(default_factory=list)

    def alone(self, i: int) -> ScheduledBatch:
        """Entry `i` as a batch of its own."""
        return ScheduledBatch([self.seqs[i]], [self.num_new[i]], [self.blocks[i]])

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


@dataclass(frozen=True)
class TierMatch:
    """Admission's second step: what the tiers below the pool offer past the pool's prefix. `hit` is their
    answer, None when they were not asked (`skipped` says why); the first `num_blocks` of its blocks are to be
    loaded (none unless loading beats recomputing)."""

    hit: TierHit | None = None
    skipped: str = ""

    @property
    def num_blocks(self) -> int:
        return self.hit.num_blocks if self.hit is not None and self.hit.load else 0


@dataclass(frozen=True)
class Registration:
    """Admission's last step: the sequence starts with `num_cached_blocks` blocks of K/V it need not compute (pool
    hit plus blocks loaded from the tiers, all registered in the pool) and computes `num_new` tokens this step;
    `tiers` is what this admission got from the pool and the tiers."""

    num_cached_blocks: int
    num_new: int
    tiers: TierOutcome


class Scheduler:
    """Owns the waiting queue and the running list; decides each step's batch. Blocks are asked of the cache
    manager, which owns every table; the scheduler only decides who gets them."""

    def __init__(self, config: SchedulerConfig, cache: KVCacheManager) -> None:
        """With the cache manager's eviction policy, no sequence keeps more than its `budget_blocks` blocks (sinks,
        recent window, heavy hitters are kept), so prefill chunks are capped to fit in that budget."""
        self.config, self.cache, self.blocks = config, cache, cache.pool
        eviction, budget_blocks = cache.eviction, cache.budget_blocks
        self.max_chunk = config.max_num_batched_tokens
        if eviction is not None and budget_blocks is not None:
            sinks = -(-getattr(eviction, "sink_tokens", 0) // cache.block_size)
            if budget_blocks < sinks + 3:
                bs = cache.block_size
                raise EvictionError(
                    f"a KV token budget of {budget_blocks} blocks ({budget_blocks * bs} tokens) is too small: "
                    f"{eviction.name} eviction keeps {sinks} sink blocks and needs at least {sinks + 3} blocks "
                    f"({(sinks + 3) * bs} tokens)", setting="kv_budget_tokens")
            self.max_chunk = min(self.max_chunk, (budget_blocks - sinks - 2) * cache.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.connector: KVConnector | None = None
        self.propose: Proposer | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.free(seq.request_id)
        seq.status = Status.FINISHED

    def _blocks_needed(self, seq: Sequence, num_new: int) -> int:
        return self.cache.blocks_needed(seq.request_id, seq.num_computed + num_new)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.free(seq.request_id)
        seq.num_computed, seq.draft = 0, []
        seq.status = Status.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        decodes = [s for s in self.running if s.num_tokens - s.num_computed == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed > 1]
        preempted = False
        for rank, seq in enumerate(decodes + prefills):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            seq.draft = []
            n = min(seq.num_tokens - seq.num_computed, budget, self.max_chunk)
            if rank < len(decodes) and self.propose is not None and not self.cache.evicted(seq.request_id):
                n += self._draft(seq, min(budget - (len(decodes) - rank), self.max_chunk - 1))
            need = self._blocks_needed(seq, n)
            self.cache.evict_for(seq.request_id, need)
            while need > self.blocks.num_allocatable():
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim in batch.seqs:
                    i = batch.seqs.index(victim)
                    budget += batch.num_new.pop(i)
                    batch.seqs.pop(i)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            self.cache.grow(seq.request_id, need)
            batch.seqs.append(seq)
            batch.num_new.append(n)
            budget -= n
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq, budget, batch):
                break
            self.waiting.popleft()
            budget -= batch.num_new[-1]
        return self._decodes_first(batch)

    def _draft(self, seq: Sequence, room: int) -> int:
        """Draft up to `room` tokens past a decoding sequence (rows the step verifies with its next token), as many
        as its new blocks leave room for without preempting anyone; returns how many."""
        draft = self.propose(seq, room) if self.propose is not None and room > 0 else []
        while draft and self._blocks_needed(seq, 1 + len(draft)) > self.blocks.num_allocatable():
            draft.pop()
        seq.draft = draft
        return len(draft)

    def _admit(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> bool:
        """Give a waiting sequence its cached prefix (pool, then tiers) and blocks for its first chunk, if they
        fit; see the module docstring for the steps."""
        bs = self.blocks.block_size
        hashes = seq.hashes(bs)
        pool = self._match_pool(seq, hashes)
        tiers = self._match_tiers(seq, hashes, pool)
        cached = pool.num_blocks + tiers.num_blocks
        num_new = min(seq.num_tokens - cached * bs, budget, self.max_chunk)
        query = seq.num_tokens if self.config.enable_prefix_caching else 0
        alloc = self.cache.admit(seq.request_id, pool, -(-(cached * bs + num_new) // bs) - pool.num_blocks, query)
        if alloc is None:
            return False
        seq.draft = []
        reg = self._register(seq, hashes, alloc, tiers, num_new, budget)
        self.cache.admitted(seq.request_id, reg.num_cached_blocks)
        seq.num_computed = reg.num_cached_blocks * bs
        if seq.tiers is None:  # the first admission's outcome is the request's; a re-admission mostly hits itself
            seq.tiers = reg.tiers
        seq.status = Status.RUNNING
        self.running.append(seq)
        batch.seqs.append(seq)
        batch.num_new.append(reg.num_new)
        return True

    def _uncached_because(self, seq: Sequence) -> str:
        """Why a sequence may not start from cached K/V at all ("" when it may)."""
        if not self.config.enable_prefix_caching:
            return "prefix caching is off"
        if seq.needs_prompt_logits:
            return "prompt logprobs need every prompt position's logits: the prompt is computed"
        return ""

    def _match_pool(self, seq: Sequence, hashes: list[BlockHash]) -> PrefixMatch:
        """Step 1: the pool's cached prefix, at most half an eviction budget (leaving room to grow within it)."""
        if self._uncached_because(seq):
            return PrefixMatch()
        budget = self.cache.budget_blocks
        cap = budget // 2 if budget is not None else None
        return self.blocks.match_prefix(seq.token_ids, hashes, max_blocks=cap)

    def _match_tiers(self, seq: Sequence, hashes: list[BlockHash], pool: PrefixMatch) -> TierMatch:
        """Step 2: ask the tiers for the blocks past the pool's prefix (never the last prompt token's block)."""
        limit = (seq.num_tokens - 1) // self.blocks.block_size
        skipped = (self._uncached_because(seq)
                   or ("no tiers are attached" if self.connector is None else "")
                   or ("an eviction budget is set: blocks are not loaded from the tiers"
                       if self.cache.budget_blocks is not None else "")
                   or ("the pool holds every reusable block" if pool.num_blocks >= limit else ""))
        if skipped or self.connector is None:
            return TierMatch(skipped=skipped)
        return TierMatch(self.connector.lookup(hashes[pool.num_blocks : limit], seq.token_ids, pool.num_blocks))

    def _register(self, seq: Sequence, hashes: Seq[BlockHash], alloc: Allocation, tiers: TierMatch, num_new: int,
                  budget: int) -> Registration:
        """Step 4: load the tiers' blocks into the fresh blocks and register those that arrived; a shortfall is
        recomputed, in the blocks already allocated."""
        bs = self.blocks.block_size
        start = len(alloc.hit)
        loaded = TierLoad()
        if tiers.num_blocks and tiers.hit is not None and self.connector is not None:
            loaded = self.connector.load(tiers.hit, alloc.fresh[: tiers.num_blocks])
            self.cache.register_loaded(seq.request_id, hashes, seq.token_ids, start, start + loaded.num_blocks,
                                       seq.partition)
            cached = start + loaded.num_blocks
            num_new = min(seq.num_tokens - cached * bs, budget, len(alloc.block_ids) * bs - cached * bs)
        return Registration(start + loaded.num_blocks, num_new, self._outcome(start, tiers, loaded))

    def _outcome(self, pool_blocks: int, tiers: TierMatch, loaded: TierLoad) -> TierOutcome:
        """What this admission got from the pool and the tiers, in tokens."""
        bs = self.blocks.block_size
        if tiers.hit is None:
            return TierOutcome(TierDecision.NONE, tiers.skipped, pool_tokens=pool_blocks * bs)
        per_tier: dict[str, int] = {}
        for source in loaded.sources:
            per_tier[source] = per_tier.get(source, 0) + bs
        reason = f"{tiers.hit.reason}; {loaded.note}" if loaded.note else tiers.hit.reason
        return TierOutcome(tiers.hit.decision, reason, pool_blocks * bs, loaded.num_blocks, loaded.num_blocks * bs,
                           per_tier)

    def _decodes_first(self, batch: ScheduledBatch) -> ScheduledBatch:
        """The planned batch, decodes first, with each sequence's blocks as the cache manager now holds them."""
        order = sorted(range(len(batch)), key=lambda i: batch.num_new[i] != 1)
        seqs = [batch.seqs[i] for i in order]
        return ScheduledBatch(seqs, [batch.num_new[i] for i in order], [self.cache.blocks(s.request_id) for s in seqs])
