"""Quality of a KV format or eviction policy on one text: chunked perplexity and greedy continuations.

Every chunk's queries read all earlier tokens, and the chunk's own, back from the pool through `gather`, so the
loss of the stored format is what the perplexity sees (a single whole-text prefill would attend to fresh K/V).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hafiza.cache.errors import KVDtypeError
from hafiza.cache.eviction import make_policy
from hafiza.cache.layout import KVLayout
from hafiza.cache.pool import make_kv_pool
from hafiza.models.llama import LlamaModel
from hafiza.quant.sequence import PagedSequence


@dataclass
class TextRun:
    """Summed next-token NLL over `scored` tokens, and greedy continuations keyed by prefix length."""

    nll_sum: float = 0.0
    scored: int = 0
    continuations: dict[int, list[int]] = field(default_factory=dict)
    evicted_tokens: int = 0


def next_token_nll(logits: torch.Tensor, targets: list[int]) -> float:
    """Summed cross-entropy of `targets` under `logits` rows (row i predicts targets[i])."""
    t = torch.tensor(targets, dtype=torch.long, device=logits.device)
    return float(F.cross_entropy(logits[: len(targets)].float(), t, reduction="sum"))


def greedy_points(num_tokens: int, chunk: int, count: int) -> list[int]:
    """`count` prefix lengths spread evenly up to num_tokens, each a multiple of `chunk`, the last = the end."""
    if count < 1:
        return []
    ends = [round(num_tokens * (i + 1) / count / chunk) * chunk for i in range(count - 1)]
    return sorted({min(num_tokens, max(chunk, e)) for e in ends} | {num_tokens})


def run_hafiza(model: LlamaModel, ids: list[int], kind: str, policy: str | None = None,
               budget_tokens: int | None = None, chunk: int = 64, points: list[int] | None = None,
               gen_tokens: int = 64, block_size: int = 16) -> TextRun:
    """Chunked evaluation of `ids` through a `kind` pool (optionally evicting to `budget_tokens`)."""
    if len(ids) < 2:
        raise KVDtypeError("a quality text needs at least 2 tokens")
    c = model.config
    blocks = -(-(len(ids) + gen_tokens + chunk) // block_size) + 1
    layout = KVLayout(c.num_layers, blocks, block_size, c.num_kv_heads, c.head_dim, kind, model.dtype)
    seq = PagedSequence(model, make_kv_pool(layout, model.device),
                        make_policy(policy) if policy else None, budget_tokens)
    run = TextRun()
    wanted = set(points or [])
    for start in range(0, len(ids), chunk):
        end = min(len(ids), start + chunk)
        logits = seq.prefill(ids[start:end])
        targets = ids[start + 1 : end + 1]
        run.nll_sum += next_token_nll(logits, targets)
        run.scored += len(targets)
        if end in wanted:
            branch = seq.fork() if end < len(ids) else seq
            run.continuations[end] = branch.greedy(logits[-1], gen_tokens)
    run.evicted_tokens = seq.evicted_tokens
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
