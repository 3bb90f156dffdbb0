"""A request's state inside the engine: tokens, progress, pins and timings (its KV blocks belong to the cache
manager, hafiza/cache/kv_cache_manager.py)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hafiza.cache.hashing import BlockHash, chain_hashes
from hafiza.engine.connector import TierOutcome
from hafiza.engine.output import TokenLogprob
from hafiza.engine.results import FinishReason
from hafiza.engine.sampling import SamplingParams
from hafiza.engine.speculative.backoff import DraftBudget

if TYPE_CHECKING:
    from hafiza.engine.grammar import GrammarState


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class CachePin:
    """Keep the KV of the first `num_tokens` prompt tokens cached for `ttl_s` seconds (an API breakpoint)."""

    num_tokens: int
    ttl_s: float


@dataclass
class Sequence:
    """One request. `num_computed` tokens have K/V in the pool; `token_ids` holds prompt then output.

    `num_cached_tokens` is what the request reports, the prompt tokens its first admission did not compute (from
    `tiers`). `pinned_tokens` is how much of the prompt its cache breakpoints (`pins`) have pinned so far.

    A request with n > 1 choices is n sequences: `parent_id` is the request's id and `index` the choice.

    `draft` holds the tokens guessed past `token_ids` that this step verifies (scheduled rows past the known
    tokens); `draft_budget` (None: the sequence does not speculate) adapts how many it may guess."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    extra_keys: tuple = ()
    pins: tuple[CachePin, ...] = ()
    status: Status = Status.WAITING
    num_computed: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    pinned_tokens: int = 0
    tiers: TierOutcome | None = None
    finish_reason: FinishReason | None = None
    stop_sequence: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    generator: torch.Generator | None = None
    parent_id: str | None = None
    index: int = 0
    grammar: GrammarState | None = None
    pending_logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    draft: list[int] = field(default_factory=list)
    draft_budget: DraftBudget | None = None

    @property
    def partition(self) -> str | None:
        """The cache partition (an API key's and/or a cache_salt's; None: shared): the engine's last extra key."""
        return self.extra_keys[-1] if self.extra_keys else None

    @property
    def group_id(self) -> str:
        """The id the caller knows: the request's, shared by its n choices."""
        return self.parent_id or self.request_id

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs were asked for and not all prompt positions have them yet (such a sequence computes its
        prompt instead of reading it from the prefix cache)."""
        return (self.params.prompt_logprobs is not None and self.index == 0
                and len(self.prompt_logprobs) < self.num_prompt_tokens)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens whose K/V the first admission took from the pool or the tiers (0 before it)."""
        return self.tiers.cached_tokens if self.tiers is not None else 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def hashes(self, block_size: int) -> list[BlockHash]:
        """Chained hashes of every full block of `token_ids`, extended incrementally."""
        full = len(self.token_ids) // block_size
        if len(self.block_hashes) < full:
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes += chain_hashes(
                self.token_ids[: full * block_size], block_size, self.extra_keys, len(self.block_hashes), parent
            )
        return self.block_hashes
