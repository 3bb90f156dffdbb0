"""Attention over a paged KV cache: the batch layout (decodes first, then prefill spans) and the kernel."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F


class PagedKV(Protocol):
    """What attention needs from the KV store: write new tokens into slots, gather blocks back as tensors."""

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


AttentionObserver = Callable[[int, torch.Tensor, "PagedKV"], None]


@dataclass
class PrefillSpan:
    """`length` query tokens at flat offset `start`, whose sequence then holds `context_len` tokens.

    With `block_table`, keys are read back from the pool (a cached prefix, an earlier chunk, or a pool whose
    dtype is not the compute dtype, so that cold and warm runs see the same stored values) under `mask`
    ([length, context_len], True = may attend; None = causal). Without it, the fresh K/V are used, causally.
    """

    start: int
    length: int
    context_len: int
    block_table: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """One forward step: `slot_mapping[i]` is where token i's K/V go; the first `num_decode` tokens are
    single-token decodes of distinct sequences, batched against `decode_block_tables` under `decode_mask`.
    `observer(layer, q, kv)`, if set, runs after each layer's attention (score-based eviction reads it)."""

    slot_mapping: torch.Tensor
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)
    observer: AttentionObserver | None = None


def paged_attention(
    layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKV, meta: AttentionMetadata
) -> torch.Tensor:
    """q [T, H, d], k/v [T, Hkv, d] (already written to the pool) -> [T, H, d]."""
    out = torch.empty_like(q)
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    group = heads // kv_heads
    d = meta.num_decode
    if d:
        kc, vc = kv.gather(layer, meta.decode_block_tables)  # [D, S, Hkv, d]
        # GQA decode without copying keys: the `group` query heads of one KV head act as `group` query rows.
        qd = q[:d].view(d, kv_heads, group, dim)
        kc, vc = kc.to(q.dtype).transpose(1, 2), vc.to(q.dtype).transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=meta.decode_mask)
        out[:d] = o.reshape(d, heads, dim)
    for span in meta.prefills:
        s, n = span.start, span.length
        qs = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        if span.block_table is None:
            ks, vs = k[s : s + n], v[s : s + n]
            mask, causal = span.mask, span.mask is None
        else:
            kc, vc = kv.gather(layer, span.block_table.unsqueeze(0))
            ks, vs = kc[0, : span.context_len].to(q.dtype), vc[0, : span.context_len].to(q.dtype)
            mask, causal = span.mask, span.mask is None
        ks = ks.transpose(0, 1).unsqueeze(0)
        vs = vs.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal, enable_gqa=group > 1)
        out[s : s + n] = o[0].transpose(0, 1)
    if meta.observer is not None:
        meta.observer(layer, q, kv)
    return out
