"""One sequence run over a paged pool: chunked prefill and decode that read every key back through `gather`,
with optional block eviction. The quality benchmark's harness (`quant/evaluate.py`); the engine serves through
its own scheduler and runner."""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext

import torch

from hafiza.cache.errors import KVDtypeError
from hafiza.cache.eviction import AttentionScores, EvictionPolicy
from hafiza.cache.pool import KVPool
from hafiza.models.attention import AttentionMetadata, PrefillSpan
from hafiza.models.llama import LlamaModel
from hafiza.quant.observe import observe_attention


class PagedSequence:
    """A block table plus each block's first position; tokens are written to the pool, then attended from it.

    With `policy` and `budget_tokens`, blocks are evicted before each write so that the sequence never holds
    more than `budget_tokens // block_size` blocks; kept tokens keep their positions.
    """

    def __init__(self, model: LlamaModel, pool: KVPool, policy: EvictionPolicy | None = None,
                 budget_tokens: int | None = None) -> None:
        self.model, self.pool, self.policy = model, pool, policy
        self.bs: int = pool.block_size
        self.budget_blocks = None if budget_tokens is None else budget_tokens // self.bs
        if policy is not None and self.budget_blocks is None:
            raise KVDtypeError("an eviction policy needs a token budget")
        self.free = list(range(pool.num_blocks))
        self.blocks: list[int] = []
        self.starts: list[int] = []
        self.length = 0
        self.evicted_tokens = 0
        needs = policy is not None and policy.needs_scores
        self.scores = AttentionScores(pool.num_blocks, model.device) if needs else None

    @property
    def fill(self) -> int:
        """Tokens in the last block."""
        return self.length - self.starts[-1] if self.blocks else 0

    def fork(self) -> PagedSequence:
        """An independent copy (pool included) sharing the model: for continuations at a point of a text."""
        new = copy.copy(self)
        new.pool = copy.deepcopy(self.pool)
        new.free, new.blocks, new.starts = list(self.free), list(self.blocks), list(self.starts)
        new.scores = copy.deepcopy(self.scores)
        return new

    def _new_blocks(self, n: int) -> int:
        room = (self.bs - self.fill) % self.bs if self.blocks else 0
        return math.ceil(max(0, n - room) / self.bs)

    def _evict_for(self, n: int) -> None:
        need = self._new_blocks(n)
        if self.policy is None or len(self.blocks) + need <= self.budget_blocks:
            return
        scores = self.scores.score(self.blocks) if self.scores is not None else None
        keep = self.policy.select(len(self.blocks), self.budget_blocks - need, self.bs, scores)
        if not keep or keep[-1] != len(self.blocks) - 1:
            raise KVDtypeError(f"{self.policy.name} dropped the sequence's last block")
        dropped = [b for i, b in enumerate(self.blocks) if i not in set(keep)]
        self.evicted_tokens += len(dropped) * self.bs
        if self.scores is not None and dropped:
            self.scores.reset(dropped)
        self.free = dropped + self.free
        self.blocks = [self.blocks[i] for i in keep]
        self.starts = [self.starts[i] for i in keep]

    def _place(self, n: int) -> torch.Tensor:
        """Slots for the next n tokens, allocating blocks as needed."""
        slots = []
        for pos in range(self.length, self.length + n):
            if not self.blocks or pos - self.starts[-1] >= self.bs:
                if not self.free:
                    raise KVDtypeError("the pool is out of blocks (give it more, or an eviction budget)")
                self.blocks.append(self.free.pop(0))
                self.starts.append(pos)
            slots.append(self.blocks[-1] * self.bs + pos - self.starts[-1])
        self.length += n
        return torch.tensor(slots, dtype=torch.long, device=self.model.device)

    def _table_mask(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block table [n] and mask [T, n * bs]: slot visible if written and not after the query."""
        dev = self.model.device
        table = torch.tensor(self.blocks, dtype=torch.long, device=dev)
        offs = torch.arange(self.bs, device=dev)
        slot_pos = (torch.tensor(self.starts, device=dev)[:, None] + offs).reshape(-1)
        valid = slot_pos < self.length
        return table, valid[None, :] & (slot_pos[None, :] <= positions[:, None])

    def _observing(self) -> object:
        if self.scores is None:
            return nullcontext()
        scores = self.scores
        return observe_attention(lambda layer, table, mass, nq: scores.add(table, mass, nq))

    def prefill(self, token_ids: list[int]) -> torch.Tensor:
        """Append tokens as one prefill span reading the whole context from the pool; logits [T, vocab]."""
        n = len(token_ids)
        self._evict_for(n)
        positions = torch.arange(self.length, self.length + n, device=self.model.device)
        slots = self._place(n)
        table, mask = self._table_mask(positions)
        span = PrefillSpan(0, n, mask.shape[1], block_table=table, mask=mask)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.model.device)
        meta = AttentionMetadata(slot_mapping=slots, prefills=[span])
        with self._observing():
            hidden = self.model.forward(ids, positions, meta, self.pool)
        return self.model.logits(hidden)

    def decode(self, token_id: int) -> torch.Tensor:
        """Append one token through the engine's batched-decode path; logits [vocab]."""
        self._evict_for(1)
        positions = torch.tensor([self.length], device=self.model.device)
        slots = self._place(1)
        table, mask = self._table_mask(positions)
        meta = AttentionMetadata(slot_mapping=slots, num_decode=1, decode_block_tables=table[None],
                                 decode_mask=mask[:, None, None, :])
        ids = torch.tensor([token_id], dtype=torch.long, device=self.model.device)
        with self._observing():
            hidden = self.model.forward(ids, positions, meta, self.pool)
        return self.model.logits(hidden)[0]

    def greedy(self, last_logits: torch.Tensor, n: int) -> list[int]:
        """n greedy tokens continuing from `last_logits` (the logits after the last appended token)."""
        out = [int(last_logits.argmax())]
        while len(out) < n:
            out.append(int(self.decode(out[-1]).argmax()))
        return out
