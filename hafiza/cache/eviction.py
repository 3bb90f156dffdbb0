"""Token eviction at block granularity: which blocks of a sequence to keep when its context exceeds a budget.

A policy sees the sequence's blocks in order (logical indices 0..n-1) and returns the indices to keep, in
order. Whole blocks are dropped, so memory goes straight back to the pool, every KV format works unchanged,
and kept tokens keep their original positions (their keys already carry RoPE); the attention mask of later
queries uses each kept block's start position. The last block (where new tokens go) is always kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hafiza.cache.errors import EvictionError


class EvictionPolicy(Protocol):
    """Chooses the blocks of one sequence to keep; `scores` (one per block) is read by score-based ones."""

    name: str
    needs_scores: bool

    def select(self, num_blocks: int, budget_blocks: int, block_size: int,
               scores: torch.Tensor | None = None) -> list[int]: ...


def _sink_blocks(sink_tokens: int, block_size: int) -> int:
    return math.ceil(sink_tokens / block_size) if sink_tokens > 0 else 0


def _check_budget(budget_blocks: int, floor: int, name: str) -> None:
    if budget_blocks < floor:
        raise EvictionError(f"{name} eviction needs a budget of at least {floor} blocks, got {budget_blocks}",
                            setting="kv_budget_tokens")


@dataclass
class StreamingLLM:
    """Attention sinks (the blocks holding the first `sink_tokens` tokens) plus the most recent blocks."""

    sink_tokens: int = 4
    name: str = "streaming"
    needs_scores: bool = False

    def select(self, num_blocks: int, budget_blocks: int, block_size: int,
               scores: torch.Tensor | None = None) -> list[int]:
        if num_blocks <= budget_blocks:
            return list(range(num_blocks))
        sinks = _sink_blocks(self.sink_tokens, block_size)
        _check_budget(budget_blocks, sinks + 1, self.name)
        recent = budget_blocks - sinks
        return list(range(sinks)) + list(range(num_blocks - recent, num_blocks))


@dataclass
class HeavyHitters:
    """H2O-like: sinks, a recent window (`recent_fraction` of the budget) and, in between, the blocks with
    the highest attention score (mean attention a block received per observing query, summed over heads
    and layers; see AttentionScores)."""

    sink_tokens: int = 4
    recent_fraction: float = 0.5
    name: str = "h2o"
    needs_scores: bool = True

    def select(self, num_blocks: int, budget_blocks: int, block_size: int,
               scores: torch.Tensor | None = None) -> list[int]:
        if num_blocks <= budget_blocks:
            return list(range(num_blocks))
        if scores is None or len(scores) != num_blocks:
            raise EvictionError(f"{self.name} eviction needs one score per block ({num_blocks}), "
                                f"got {None if scores is None else len(scores)}")
        sinks = _sink_blocks(self.sink_tokens, block_size)
        _check_budget(budget_blocks, sinks + 1, self.name)
        recent = max(1, min(budget_blocks - sinks, round(budget_blocks * self.recent_fraction)))
        heavy = budget_blocks - sinks - recent
        middle = torch.arange(sinks, num_blocks - recent)
        chosen = middle[torch.topk(scores[middle].float().cpu(), heavy).indices].tolist() if heavy else []
        return sorted(list(range(sinks)) + chosen + list(range(num_blocks - recent, num_blocks)))


@dataclass
class AttentionScores:
    """Attention mass each physical block received and how many queries looked at it (H2O-like scores)."""

    num_blocks: int
    device: torch.device
    mass: torch.Tensor = field(init=False)
    seen: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.mass = torch.zeros(self.num_blocks, dtype=torch.float32, device=self.device)
        self.seen = torch.zeros(self.num_blocks, dtype=torch.float32, device=self.device)

    def add(self, block_table: torch.Tensor, slot_mass: torch.Tensor, num_queries: int) -> None:
        """Add one layer's attention: `slot_mass` [n * block_size] summed over heads and queries."""
        table = block_table.to(self.device)
        per_block = slot_mass.float().to(self.device).view(len(table), -1).sum(1)
        self.mass.index_add_(0, table, per_block)
        self.seen.index_add_(0, table, torch.full_like(per_block, float(num_queries)))

    def score(self, block_ids: list[int]) -> torch.Tensor:
        """Mean attention per observing query of each block (0 where never seen)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return self.mass[idx] / self.seen[idx].clamp_min(1.0)

    def reset(self, block_ids: list[int]) -> None:
        """Forget freed blocks."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self.mass[idx] = 0.0
        self.seen[idx] = 0.0


POLICIES = {"streaming": StreamingLLM, "h2o": HeavyHitters}


def make_policy(name: str, sink_tokens: int = 4) -> EvictionPolicy:
    """An eviction policy by name: streaming | h2o."""
    if name not in POLICIES:
        raise EvictionError(f"unknown eviction policy {name!r}: use one of {', '.join(POLICIES)}", setting="eviction")
    return POLICIES[name](sink_tokens=sink_tokens)
