"""Continuous batching: every step, running decodes first, then prefill chunks, within a token budget.

Sequences join and leave the batch at every step. A long prompt is prefilled in chunks so running streams keep
decoding. Admission needs free blocks; when a running sequence cannot grow, the most recently admitted one is
preempted by recompute: its blocks are freed (their full blocks stay cached, so recomputing mostly hits the
prefix cache) and it returns to the front of the queue with prompt + generated tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hafiza.cache.block_manager import BlockManager
from hafiza.cache.errors import EvictionError
from hafiza.cache.eviction import AttentionScores, EvictionPolicy
from hafiza.engine.connector import KVConnector
from hafiza.engine.sequence import Sequence, Status


@dataclass
class SchedulerConfig:
    """Batch limits: at most `max_num_seqs` running, at most `max_num_batched_tokens` tokens per step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True


@dataclass
class ScheduledBatch:
    """What one forward step computes: `num_new[i]` tokens of `seqs[i]`, single-token decodes first."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


class Scheduler:
    """Owns the waiting queue and the running list; decides each step's batch."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager, eviction: EvictionPolicy | None = None,
                 budget_blocks: int | None = None, scores: AttentionScores | None = None) -> None:
        """With `eviction`, no sequence keeps more than `budget_blocks` blocks: before growing, the policy picks
        the blocks to keep (sinks, recent window, heavy hitters) and the rest are freed."""
        self.config, self.blocks = config, blocks
        self.eviction, self.budget_blocks, self.scores = eviction, budget_blocks, scores
        self.max_chunk = config.max_num_batched_tokens
        if eviction is not None and budget_blocks is not None:
            sinks = -(-getattr(eviction, "sink_tokens", 0) // blocks.block_size)
            if budget_blocks < sinks + 3:
                bs = blocks.block_size
                raise EvictionError(
                    f"a KV token budget of {budget_blocks} blocks ({budget_blocks * bs} tokens) is too small: "
                    f"{eviction.name} eviction keeps {sinks} sink blocks and needs at least {sinks + 3} blocks "
                    f"({(sinks + 3) * bs} tokens)", setting="kv_budget_tokens")
            self.max_chunk = min(self.max_chunk, (budget_blocks - sinks - 2) * blocks.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.connector: KVConnector | None = None

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
        self.blocks.free(seq.block_table)
        seq.block_table = []
        seq.status = Status.FINISHED

    def _blocks_needed(self, seq: Sequence, num_new: int) -> int:
        held = seq.block_logical[-1] + 1 if seq.block_logical else 0
        return max(0, -(-(seq.num_computed + num_new) // self.blocks.block_size) - held)

    def _grow(self, seq: Sequence, need: int) -> None:
        """Append `need` fresh blocks after the sequence's last logical block."""
        held = seq.block_logical[-1] + 1 if seq.block_logical else 0
        fresh = self.blocks.allocate(need)
        seq.block_table += fresh
        seq.block_logical += range(held, held + need)
        if self.scores is not None and fresh:
            self.scores.reset(fresh)

    def _evict(self, seq: Sequence, need: int) -> None:
        """Drop blocks chosen by the eviction policy so the sequence stays within its budget after growing."""
        if self.eviction is None or self.budget_blocks is None or len(seq.block_table) + need <= self.budget_blocks:
            return
        bs = self.blocks.block_size
        scores = self.scores.score(seq.block_table) if self.scores is not None else None
        keep = self.eviction.select(len(seq.block_table), self.budget_blocks - need, bs, scores)
        kept = set(keep)
        dropped = [b for i, b in enumerate(seq.block_table) if i not in kept]
        self.blocks.free(dropped)
        seq.block_table = [seq.block_table[i] for i in keep]
        seq.block_logical = [seq.block_logical[i] for i in keep]
        seq.evicted = True
        seq.evicted_tokens += len(dropped) * bs

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        seq.block_table, seq.block_logical, seq.num_computed, seq.num_cached_blocks = [], [], 0, 0
        seq.evicted = False
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        decodes = [s for s in self.running if s.num_tokens - s.num_computed == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed > 1]
        preempted = False
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_tokens - seq.num_computed, budget, self.max_chunk)
            need = self._blocks_needed(seq, n)
            self._evict(seq, need)
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
            self._grow(seq, need)
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

    def _admit(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> bool:
        """Give a waiting sequence its cached prefix (pool, then tiers) and blocks for its first chunk, if they
        fit."""
        bs = self.blocks.block_size
        hit: list[int] = []
        hashes = seq.hashes(bs)
        use_cache = self.config.enable_prefix_caching and not seq.needs_prompt_logits  # its logits are needed
        if use_cache:
            hit = self.blocks.match_prefix(seq.token_ids, hashes, count=False)
        if self.budget_blocks is not None:
            hit = hit[: self.budget_blocks // 2]  # leave room to grow within the eviction budget
        external = 0
        limit = (seq.num_tokens - 1) // bs
        ext = None
        tiers_usable = self.connector is not None and self.budget_blocks is None
        if tiers_usable and use_cache and len(hit) < limit:
            ext = self.connector.lookup(hashes[len(hit) : limit])
            external = ext.num_blocks if ext.load else 0
        cached = len(hit) + external
        n = min(seq.num_tokens - cached * bs, budget, self.max_chunk)
        need = -(-(cached * bs + n) // bs) - len(hit)
        reclaimed = sum(1 for b in hit if self.blocks.blocks[b].ref_count == 0)
        if need > self.blocks.num_allocatable() - reclaimed:
            return False
        self.blocks.acquire(hit)
        seq.block_table, seq.block_logical = list(hit), list(range(len(hit)))
        self._grow(seq, need)
        fresh = seq.block_table[len(hit) :]
        if external:
            loaded = self.connector.load(hashes[len(hit) : cached], fresh[:external])  # type: ignore[union-attr]
            for i in range(loaded):
                b = len(hit) + i
                self.blocks.cache_block(fresh[i], hashes[b], seq.token_ids[b * bs : (b + 1) * bs])
            if seq.num_cached_tokens is None:
                seq.external_tokens = loaded * bs
                seq.external_sources = dict(ext.per_tier) if ext else {}
            cached = len(hit) + loaded
            n = min(seq.num_tokens - cached * bs, budget, len(seq.block_table) * bs - cached * bs)
        if ext is not None and seq.num_cached_tokens is None:
            seq.external_decision = ext.reason
        if self.config.enable_prefix_caching:
            self.blocks.prefix_cache_queries += seq.num_tokens
            self.blocks.prefix_cache_hits += cached * bs
        seq.num_computed = cached * bs
        seq.num_cached_blocks = cached
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = cached * bs
        seq.status = Status.RUNNING
        self.running.append(seq)
        batch.seqs.append(seq)
        batch.num_new.append(n)
        return True

    @staticmethod
    def _decodes_first(batch: ScheduledBatch) -> ScheduledBatch:
        order = sorted(range(len(batch)), key=lambda i: batch.num_new[i] != 1)
        return ScheduledBatch([batch.seqs[i] for i in order], [batch.num_new[i] for i in order])
