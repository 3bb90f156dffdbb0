"""What the engine hands back: one step's output per request, a finished request, stats, and finish reasons."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from hafiza.cache.block_manager import BlockStats
from hafiza.engine.connector import TierOutcome
from hafiza.engine.output import TokenLogprob
from hafiza.engine.speculative import SpecCounters


class FinishReason(enum.StrEnum):
    """Why a request (one choice of it) stopped; the values are the strings the APIs map from."""

    STOP = "stop"  # an end-of-sequence or stop token, or a grammar that is done
    STOP_SEQUENCE = "stop_sequence"  # a stop string matched (`stop_sequence` names it)
    LENGTH = "length"  # max_tokens or the model's context
    ERROR = "error"  # this request alone failed (`error` says how)
    ABORT = "abort"  # the caller went away


@dataclass
class RequestOutput:
    """What one step produced for one request; `text` is the new text since the last output. `error` is set (with
    finish_reason "error") when this request alone failed: its forward or its sampling raised. `index` is the
    choice (0..n-1) of a request with n choices, each finishing on its own; `logprobs` cover `new_token_ids`;
    `prompt_logprobs` (one per prompt token, None for the first) come once, on choice 0's first output. `tiers` is
    how the request's admission found its prompt's K/V (pool, store tiers, computed; the `x-hafiza-tiers`
    header), on every output once it was admitted."""

    request_id: str
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None = None
    stop_sequence: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    pinned_tokens: int = 0
    tiers: TierOutcome | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    error: str | None = None
    index: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class GenerationResult:
    """A finished request, for the synchronous `generate` API."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None
    index: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, out: RequestOutput) -> bool:
        """Append one step's output; True once the request has finished."""
        self.token_ids += out.new_token_ids
        self.text += out.text
        self.logprobs += out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason, self.error = out.finish_reason, out.error
            self.num_prompt_tokens, self.num_cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
        return out.finished


@dataclass
class EngineStats:
    """Memory accounting and counters, read by the server's /metrics and the dashboard. `evicted_tokens`: KV tokens
    the eviction policy dropped from sequences since the engine started. `spec`: speculative-decoding counters (None
    when the engine does not speculate)."""

    blocks: BlockStats
    bytes_per_block: int
    kv_dtype: str
    num_running: int
    num_waiting: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    requests_finished: int
    stored_tokens: int
    waste_slots: int
    evicted_tokens: int = 0
    extra: dict[str, object] = field(default_factory=dict)
    spec: SpecCounters | None = None

    @property
    def kv_cache_usage_perc(self) -> float:
        return self.blocks.usage_perc
