"""Attention probabilities for score-based eviction, observed around the model's paged attention.

The engine's kernel (SDPA) does not return attention weights, so while `observe_attention` is active the
attention function the model calls is wrapped: after each call, the same queries are scored against the keys
gathered back from the pool and the per-slot mass is reported. The quality benchmark's harness uses the
wrapper; the engine's runner calls `slot_mass` itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from hafiza.cache.pool import KVPool
from hafiza.models import llama
from hafiza.models.attention import AttentionMetadata

MassCallback = Callable[[int, torch.Tensor, torch.Tensor, int], None]


def slot_mass(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [n, H, d], keys [S, Hkv, d], mask [n, S] or None -> attention mass per key slot [S]."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).float()
    logits = torch.einsum("nhd,shd->hns", q.float(), k) / math.sqrt(q.shape[-1])
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=(0, 1))


def attention_mass(layer: int, q: torch.Tensor, kv: KVPool,
                   meta: AttentionMetadata) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(block_table [n], mass per gathered slot, number of queries) for each pool-reading part of a step."""
    out = []
    for i in range(meta.num_decode):
        table = meta.decode_block_tables[i]
        keys, _ = kv.gather(layer, table[None])
        mask = None if meta.decode_mask is None else meta.decode_mask[i].reshape(1, -1)
        out.append((table, slot_mass(q[i : i + 1], keys[0], mask), 1))
    for span in meta.prefills:
        if span.block_table is None:
            continue
        keys, _ = kv.gather(layer, span.block_table[None])
        ctx = span.context_len
        mass = torch.zeros(keys.shape[1], device=q.device)
        mass[:ctx] = slot_mass(q[span.start : span.start + span.length], keys[0, :ctx], span.mask)
        out.append((span.block_table, mass, span.length))
    return out


@contextmanager
def observe_attention(callback: MassCallback) -> Iterator[None]:
    """While active, report (layer, block_table, slot mass, queries) after every paged attention call."""
    original = llama.paged_attention

    def observed(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVPool,
                 meta: AttentionMetadata) -> torch.Tensor:
        result = original(layer, q, k, v, kv, meta)
        for table, mass, n in attention_mass(layer, q, kv, meta):
            callback(layer, table, mass, n)
        return result

    llama.paged_attention = observed
    try:
        yield
    finally:
        llama.paged_attention = original
