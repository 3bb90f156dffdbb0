"""Request checks: reject at once, with the numbers, what this engine can never serve."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hafiza.engine.sampling import SamplingParams
from hafiza.errors import RequestError

if TYPE_CHECKING:
    from hafiza.engine.grammar import GrammarSpec


@dataclass(frozen=True)
class RequestLimits:
    """What is fixed at the engine's construction and bounds every request (safe to read from any thread)."""

    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


def check_request(prompt_ids: Seq[int], params: SamplingParams, limits: RequestLimits,
                  compile_grammar: Callable[[GrammarSpec], object]) -> None:
    """Raise RequestError naming the parameter and the numbers if the request can never be served: an empty or
    out-of-vocabulary prompt, a bad logit_bias id, a grammar that does not compile, or a prompt + max_tokens (times
    n choices) beyond the context or the pool."""
    params.validate()
    n, vocab = len(prompt_ids), limits.vocab_size
    if n == 0:
        raise RequestError("the prompt is empty", param="prompt")
    if any(t < 0 or t >= vocab for t in prompt_ids):
        raise RequestError(f"prompt contains token ids outside the vocabulary [0, {vocab})", param="prompt")
    bad = [t for t in params.logit_bias if t >= vocab]
    if bad:
        raise RequestError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})",
                           param="logit_bias")
    if params.grammar is not None:
        compile_grammar(params.grammar)
    total = n + params.max_tokens
    if total > limits.max_model_len:
        raise RequestError(f"prompt of {n} tokens + max_tokens {params.max_tokens} = {total} exceeds the model's "
                           f"context of {limits.max_model_len} tokens", param="max_tokens")
    bs = limits.block_size
    if total > limits.capacity_tokens:
        raise RequestError(f"prompt of {n} tokens + max_tokens {params.max_tokens} needs {-(-total // bs)} KV "
                           f"blocks but the pool has {limits.num_blocks} ({limits.capacity_tokens} tokens)",
                           param="max_tokens")
    shared_blocks = n // bs
    group_blocks = shared_blocks + params.n * (-(-total // bs) - shared_blocks)
    if params.n > 1 and group_blocks > limits.num_blocks:
        raise RequestError(f"n={params.n} choices of a {n}-token prompt with max_tokens {params.max_tokens} need "
                           f"{group_blocks} KV blocks but the pool has {limits.num_blocks}; lower n or max_tokens",
                           param="n")
