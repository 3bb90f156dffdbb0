"""One text through `LLMEngine`, the scheduler and runner `hafiza serve` runs: teacher-forced perplexity from the
prompt's logprobs, and greedy continuations at points of the text.

The text is one request whose prompt is prefilled in chunks of `max_num_batched_tokens` tokens (one sequence
at a time, `max_num_seqs` 1). Each chunk's K/V is written to the pool before attention reads it back, so every
query sees the stored format (and, under eviction, only the blocks the policy kept): the same steps as
`hafiza serve --kv-dtype F --max-num-batched-tokens C --max-num-seqs 1 [--eviction P --kv-budget-tokens B]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hafiza.cache.pool import bytes_per_block, layout_for
from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.errors import HafizaError
from hafiza.models import LoadedModel


@dataclass
class TextRun:
    """Summed next-token NLL over `scored` tokens, and greedy continuations keyed by prefix length."""

    nll_sum: float = 0.0
    scored: int = 0
    continuations: dict[int, list[int]] = field(default_factory=dict)


def engine_config(loaded: LoadedModel, kv_dtype: str, eviction: str | None, budget_tokens: int | None,
                  chunk: int, max_tokens: int, block_size: int = 16) -> EngineConfig:
    """The served configuration for one row: a pool that holds `max_tokens` of context (at fp32 size, so every
    format fits, int4's staging window included), prefill chunks of `chunk` tokens, one sequence at a time."""
    c = loaded.config
    blocks = -(-max_tokens // block_size) + 4
    memory = bytes_per_block(layout_for(c, 1, block_size, "fp32", torch.float32)) * blocks
    return EngineConfig(kv_memory=memory, kv_dtype=kv_dtype, block_size=block_size, max_num_seqs=1,
                        max_num_batched_tokens=chunk, eviction=eviction,
                        kv_budget_tokens=budget_tokens if eviction else None)


def greedy_points(num_tokens: int, chunk: int, count: int) -> list[int]:
    """`count` prefix lengths spread evenly up to num_tokens, each a multiple of `chunk`, the last = the end."""
    if count < 1:
        return []
    ends = [round(num_tokens * (i + 1) / count / chunk) * chunk for i in range(count - 1)]
    return sorted({min(num_tokens, max(chunk, e)) for e in ends} | {num_tokens})


def run_text(engine: LLMEngine, ids: list[int], points: list[int], gen_tokens: int) -> TextRun:
    """Perplexity of `ids` from its prompt logprobs, and `gen_tokens` greedy tokens after each prefix in `points`
    (the one at the end continues the scored request; the others are requests of their own, which may reuse the
    first request's blocks through the prefix cache, as served)."""
    if len(ids) < 2:
        raise HafizaError(f"a quality text needs at least 2 tokens, got {len(ids)}")
    greedy = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    at_end = gen_tokens if len(ids) in points else 0
    scored = SamplingParams(max_tokens=at_end, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    result = engine.generate([ids], scored)[0]
    if result.error is not None or result.prompt_logprobs is None:
        raise HafizaError(f"the quality request failed: {result.error or 'no prompt logprobs'}")
    logprobs = [lp.logprob for lp in result.prompt_logprobs[1:] if lp is not None]
    if len(logprobs) != len(ids) - 1:
        raise HafizaError(f"expected {len(ids) - 1} prompt logprobs, got {len(logprobs)}")
    run = TextRun(nll_sum=-sum(logprobs), scored=len(logprobs))
    if at_end:
        run.continuations[len(ids)] = result.token_ids
    for p in points:
        if p < len(ids) and gen_tokens:
            run.continuations[p] = engine.generate([ids[:p]], greedy)[0].token_ids
    return run


def agreement(reference: list[int], candidate: list[int]) -> float:
    """Share of the continuation generated before the first token that differs from the reference."""
    same = 0
    for a, b in zip(reference, candidate, strict=False):
        if a != b:
            break
        same += 1
    return same / max(1, len(reference))


def token_match(reference: list[int], candidate: list[int]) -> float:
    """Share of positions whose tokens are equal (continues counting after a divergence)."""
    return sum(a == b for a, b in zip(reference, candidate, strict=False)) / max(1, len(reference))
