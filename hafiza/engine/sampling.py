"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, min-p, seeded; penalties and logit bias
(OpenAI / vLLM semantics) applied to the logits first.

Sampling is numerically safe for every accepted value: a temperature above 0 but below MIN_TEMPERATURE samples at
MIN_TEMPERATURE (as vLLM does), since fp32 logits divided by 1e-45 overflow to inf and softmax then yields nan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hafiza.errors import RequestError

if TYPE_CHECKING:
    from hafiza.engine.grammar import GrammarSpec

MIN_TEMPERATURE = 0.01
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit, vLLM's default max_logprobs
MAX_N = 128  # OpenAI's limit on choices per request


@dataclass
class SamplingParams:
    """Per-request decoding settings. temperature 0 means greedy; top_k 0, top_p 1, min_p 0, the penalties 0 and
    repetition_penalty 1 mean off. logit_bias maps token id -> value added to its logit. logprobs k: return each
    sampled token's log-probability and the k most likely alternatives (None: off); prompt_logprobs likewise for
    the prompt tokens. n: choices sharing the prompt. grammar: the output must match it. As vLLM's: ignore_eos
    goes on past the model's EOS; min_tokens: no EOS, stop token or stop string ends the output before that many
    tokens; skip_special_tokens: the text leaves control tokens out; include_stop_str_in_output: the matched stop
    string (or the stop token's text) stays at the end of the text. speculative False: never
    draft tokens for this request, even on an engine that speculates."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    logit_bias: dict[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: GrammarSpec | None = None
    speculative: bool = True

    def validate(self) -> None:
        """Raise RequestError naming the first bad value."""
        if self.max_tokens < 0:
            raise RequestError(f"max_tokens must be >= 0, got {self.max_tokens}", param="max_tokens")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got "
                               f"{self.min_tokens}", param="min_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            raise RequestError(f"temperature must be between 0 and 100, got {self.temperature}", param="temperature")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}", param="top_k")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise RequestError(f"seed must be between {SEED_RANGE[0]} and {SEED_RANGE[1]}, got {self.seed}",
                               param="seed")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop sequences must be non-empty strings", param="stop")
        if not 1 <= self.n <= MAX_N:
            raise RequestError(f"n must be between 1 and {MAX_N}, got {self.n}", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise RequestError(f"{name} must be between -2 and 2, got {value}", param=name)
        if not (math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 100.0):
            raise RequestError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}",
                               param="repetition_penalty")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be between 0 and 1, got {self.min_p}", param="min_p")
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise RequestError(f"logit_bias keys must be token ids >= 0, got {token!r}", param="logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise RequestError(f"logit_bias for token {token} must be between -100 and 100, got {bias}",
                                   param="logit_bias")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise RequestError(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}", param=name)
        if self.grammar is not None:
            self.grammar.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def ends_on(self, token: int, eos_token_ids: list[int]) -> bool:
        """Whether emitting `token` ends the request: an EOS or stop token, unless ignore_eos."""
        return not self.ignore_eos and (token in eos_token_ids or token in self.stop_token_ids)

    @property
    def penalized(self) -> bool:
        """Whether penalties or a logit bias change this request's logits."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or bool(
            self.presence_penalty or self.frequency_penalty)


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]],
                    num_prompt: list[int]) -> torch.Tensor:
    """Penalised and biased copy of fp32 `logits` [N, V] (rows without either are unchanged), vLLM's semantics:
    repetition_penalty divides positive (multiplies negative) logits of tokens seen in the prompt or output;
    frequency_penalty subtracts penalty x count and presence_penalty subtracts penalty once, for tokens in the
    output only; logit_bias adds its value."""
    if not any(p.penalized for p in params):
        return logits
    out = logits.clone()
    vocab = logits.shape[-1]
    for i, p in enumerate(params):
        if not p.penalized:
            continue
        row = out[i]
        output = torch.tensor(token_ids[i][num_prompt[i]:], dtype=torch.long, device=row.device)
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
            seen[torch.tensor(token_ids[i], dtype=torch.long, device=row.device)] = True
            scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, scaled, row))
        if (p.frequency_penalty or p.presence_penalty) and output.numel():
            counts = torch.bincount(output, minlength=vocab)[:vocab].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=row.device)
            row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device))
    return out


def mask_early_stops(logits: torch.Tensor, params: list[SamplingParams], num_output: list[int],
                     eos_token_ids: list[int]) -> torch.Tensor:
    """`logits` [N, V] with every stop token (EOS unless ignore_eos, and stop_token_ids) at -inf in the rows that
    have produced fewer than their min_tokens: vLLM's min_tokens, so such a token is never sampled early."""
    rows = [i for i, p in enumerate(params) if num_output[i] < p.min_tokens]
    if not rows:
        return logits
    out = logits.clone()
    vocab = logits.shape[-1]
    for i in rows:
        p = params[i]
        ids = [t for t in {*p.stop_token_ids, *([] if p.ignore_eos else eos_token_ids)} if 0 <= t < vocab]
        if ids:
            out[i, torch.tensor(ids, dtype=torch.long, device=out.device)] = float("-inf")
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of fp32 `logits` [N, V]; greedy rows in one argmax, the others row by row."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / max(p.temperature, MIN_TEMPERATURE)
        if p.min_p > 0.0:  # drop tokens less likely than min_p x the most likely one, after temperature
            probs = row.softmax(-1)
            row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if p.top_k > 0 and p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            drop = cum - sorted_logits.softmax(-1) > p.top_p
            row = row.scatter(0, order[drop], float("-inf"))
        probs = row.softmax(-1)
        out[i] = int(torch.multinomial(probs.cpu(), 1, generator=generators[i]).item())
    return out
