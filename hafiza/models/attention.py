"""Attention over a paged KV cache: the batch layout (decodes first, then prefill spans) and a batch-invariant kernel.

Every query row goes through the same arithmetic whatever shares its step: how many other queries or sequences,
how the prompt was chunked, whether its prefix came from the pool. Keys are padded to whole KEY_TILE tiles (masked),
query rows to a multiple of ROW_TILE, scores are one matmul over head_dim, and P·V runs per key tile in matmuls of one
fixed shape whose partial sums are added tile by tile in order; tiles past a query's last visible key add exact
zeros. So a token's output depends only on its own query and the K/V values it may see (docs/ENGINE.md,
tests/models/test_attention_invariance.py). The values are the pool's: with a lossy pool, fresh K/V are never used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hafiza.cache.pool import KVPool

AttentionObserver = Callable[[int, torch.Tensor, "KVPool"], None]


@dataclass
class PrefillSpan:
    """`length` query tokens at flat offset `start`, whose sequence then holds `context_len` tokens.

    With `block_table`, keys are read back from the pool (a cached prefix, an earlier chunk, or a pool whose
    dtype is not the compute dtype) under `mask` ([length, context_len], True = may attend; None = causal).
    Without it, the fresh K/V are used, causally: only when the pool stores them exactly, so the values attended
    to are the ones a warm run reads back.
    """

    start: int
    length: int
    context_len: int
    block_table: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """One forward step: `slot_mapping[i]` is where token i's K/V go; the first `num_decode` tokens are query
    rows that each attend as a decode at their own position (a decoding sequence's one row, or each row of a
    short verification), batched against `decode_block_tables` under `decode_mask`.
    `observer(layer, q, kv)`, if set, runs after each layer's attention (score-based eviction reads it)."""

    slot_mapping: torch.Tensor
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)
    observer: AttentionObserver | None = None
    decode_buffers: DecodeBuffers | None = None


@dataclass
class DecodeBuffers:
    """The decode attention's padded operands for one step, made by its first layer and refilled by every other:
    the shapes, the zero padding, the ones column and the mask are the same in each layer, so a layer only
    copies its keys, values and queries in. `keys` [D, Hkv, W, d], `values` [D, Hkv, W, d + 1], `queries`
    [D * Hkv, R, d] (R = group rounded up to ROW_TILE), `hidden` [D * Hkv, 1, W] (True = masked); `seen` keys
    are gathered per sequence (W is `seen` rounded up to KEY_TILE)."""

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    hidden: torch.Tensor
    seen: int


def causal_mask(q_pos: torch.Tensor, num_keys: int, window: int | None = None) -> torch.Tensor:
    """[len(q_pos), num_keys] True where a query at that position may see the key position (causal, and within
    the sliding `window` when there is one)."""
    keys = torch.arange(num_keys, device=q_pos.device)
    mask = keys.unsqueeze(0) <= q_pos.unsqueeze(1)
    if window:
        mask &= keys.unsqueeze(0) > q_pos.unsqueeze(1) - window
    return mask


KEY_TILE = 64  # keys per P·V matmul; a multiple of every vector width, so exp never takes a scalar tail
ROW_TILE = 4  # MKL computes a remainder of 1-3 rows with other kernels (other rounding) than whole tiles of 4
QUERY_CHUNK = 256  # query tokens per kernel call in a prefill span (bounds the score matrix)


def _tiled(q: torch.Tensor, k: torch.Tensor, v1: torch.Tensor, hidden: torch.Tensor, rows: int) -> torch.Tensor:
    """The kernel on padded operands: q [B, R, d] already scaled by 1/√d (R a multiple of ROW_TILE, padding rows
    zero), k [B, W, d] and v1 [B, W, d + 1] (last column ones: the softmax sum) with W a multiple of KEY_TILE,
    `hidden` bool broadcastable to [B, R, W] (True = masked) -> [B, rows, d]."""
    b, r, dim = q.shape
    width = k.shape[1]
    scores = torch.bmm(q, k.transpose(1, 2)).masked_fill_(hidden, float("-inf"))
    probs = scores.sub_(scores.amax(-1, keepdim=True)).exp_()
    tiles = width // KEY_TILE
    if tiles > 1:
        probs = probs.view(b, r, tiles, KEY_TILE).transpose(1, 2).reshape(b * tiles, r, KEY_TILE)
    parts = torch.bmm(probs, v1.reshape(b * tiles, KEY_TILE, dim + 1)).view(b, tiles, r, dim + 1)
    acc = parts[:, 0].clone() if tiles > 1 else parts[:, 0]
    for t in range(1, tiles):
        acc += parts[:, t]
    return acc[:, :rows, :dim] / acc[:, :rows, dim:]


def decode_buffers(meta: AttentionMetadata, kv_heads: int, group: int, dim: int, dtype: torch.dtype,
                   device: torch.device, block_size: int) -> DecodeBuffers:
    """Zeroed padded operands for the step's `meta.num_decode` decodes (see DecodeBuffers)."""
    assert meta.decode_block_tables is not None and meta.decode_mask is not None
    d, seen = meta.num_decode, meta.decode_block_tables.shape[1] * block_size
    width = -(-seen // KEY_TILE) * KEY_TILE
    values = torch.zeros(d, kv_heads, width, dim + 1, dtype=dtype, device=device)
    values[..., dim] = 1
    rows = -(-group // ROW_TILE) * ROW_TILE
    mask = meta.decode_mask.reshape(d, 1, seen)
    hidden = _hidden(mask, d, 1, 1, width).unsqueeze(1).expand(d, kv_heads, 1, width).reshape(d * kv_heads, 1, width)
    return DecodeBuffers(torch.zeros(d, kv_heads, width, dim, dtype=dtype, device=device), values,
                         torch.zeros(d * kv_heads, rows, dim, dtype=dtype, device=device), hidden, seen)


def _padded_keys(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k/v [..., S, d] (any strides) -> k [B, W, d] and v1 [B, W, d + 1] (B the leading dims' product, W = S
    rounded up to KEY_TILE): zero keys and values past S and a column of ones after v, one copy of each."""
    *lead, s, dim = k.shape
    width = -(-s // KEY_TILE) * KEY_TILE
    kp = k.new_empty(*lead, width, dim)
    kp[..., :s, :] = k
    v1 = v.new_empty(*lead, width, dim + 1)
    v1[..., :s, :dim] = v
    if width != s:
        kp[..., s:, :] = 0
        v1[..., s:, :dim] = 0
    v1[..., dim] = 1
    return kp.view(-1, width, dim), v1.view(-1, width, dim + 1)


def _padded_queries(q: torch.Tensor) -> torch.Tensor:
    """q [B, R, d] -> q / √d with zero rows up to a multiple of ROW_TILE."""
    b, rows, dim = q.shape
    padded = -(-rows // ROW_TILE) * ROW_TILE
    if padded == rows:
        return q * dim**-0.5
    qp = q.new_zeros(b, padded, dim)
    qp[:, :rows] = q
    return qp.mul_(dim**-0.5)


def _hidden(visible: torch.Tensor, b: int, rows: int, padded: int, width: int) -> torch.Tensor:
    """~visible widened to [B, padded, width]: keys past the given ones hidden, padding rows as row 0."""
    visible = visible.expand(b, rows, visible.shape[-1])
    hidden = visible.new_ones(b, padded, width)
    hidden[:, :rows, : visible.shape[-1]] = ~visible
    if padded != rows:
        hidden[:, rows:] = hidden[:, :1]
    return hidden


def _last_visible(mask: torch.Tensor) -> int:
    """One past the last key any row of `mask` [rows, keys] may see."""
    cols = mask.any(0).nonzero()
    return int(cols[-1]) + 1 if cols.numel() else 0


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ/√d, where visible) v for q [B, R, d], k/v [B, S, d] (q's dtype), visible bool broadcastable
    to [B, R, S] -> [B, R, d]. Row r's values depend only on q[b, r] and the keys it sees, never on B, R or S."""
    b, rows, _ = q.shape
    kp, v1 = _padded_keys(k, v)
    qp = _padded_queries(q)
    return _tiled(qp, kp, v1, _hidden(visible, b, rows, qp.shape[1], kp.shape[1]), rows).contiguous()


def paged_attention(
    layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVPool, meta: AttentionMetadata
) -> torch.Tensor:
    """q [T, H, d], k/v [T, Hkv, d] (already written to the pool) -> [T, H, d]. The `group` query heads of one KV
    head act as query rows against that head's keys (GQA without copying keys per query head)."""
    out = torch.empty_like(q)
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    group = heads // kv_heads
    d = meta.num_decode
    if d:
        if meta.decode_buffers is None:
            meta.decode_buffers = decode_buffers(meta, kv_heads, group, dim, q.dtype, q.device, kv.block_size)
        buf, seen = meta.decode_buffers, meta.decode_buffers.seen
        kv.gather_into(layer, meta.decode_block_tables, buf.keys[:, :, :seen], buf.values[:, :, :seen, :dim])
        queries = buf.queries.view(d, kv_heads, -1, dim)[:, :, :group]  # q's heads may be strided (a q|k slice)
        torch.mul(q[:d].view(d, kv_heads, group, dim), dim**-0.5, out=queries)
        width = buf.keys.shape[2]
        out[:d] = _tiled(buf.queries, buf.keys.view(-1, width, dim), buf.values.view(-1, width, dim + 1), buf.hidden,
                         group).view(d, heads, dim)
    for span in meta.prefills:
        s, n, ctx = span.start, span.length, span.context_len
        if span.block_table is None:
            ks, vs = k[s : s + n], v[s : s + n]
        else:
            kc, vc = kv.gather(layer, span.block_table.unsqueeze(0))
            ks, vs = kc[0, :ctx].to(q.dtype), vc[0, :ctx].to(q.dtype)
        kp, v1 = _padded_keys(ks.transpose(0, 1), vs.transpose(0, 1))  # [Hkv, W, d], once for every chunk
        if span.mask is not None:
            mask = span.mask[:, : ks.shape[0]]
        else:
            keys = torch.arange(ks.shape[0], device=q.device)
            mask = keys[None, :] <= torch.arange(ctx - n, ctx, device=q.device)[:, None]
        for c in range(0, n, QUERY_CHUNK):
            m = min(n, c + QUERY_CHUNK) - c
            qs = q[s + c : s + c + m].view(m, kv_heads, group, dim).permute(1, 0, 2, 3)
            qs = _padded_queries(qs.reshape(kv_heads, m * group, dim))
            rows_mask = mask[c : c + m]
            seen = ctx - n + c + m if span.mask is None else _last_visible(rows_mask)
            keys_used = min(kp.shape[1], max(1, -(-seen // KEY_TILE)) * KEY_TILE)  # later tiles add exact zeros
            hidden = _hidden(rows_mask[:, :keys_used].repeat_interleave(group, 0)[None], 1, m * group, qs.shape[1],
                             keys_used)
            o = _tiled(qs, kp[:, :keys_used], v1[:, :keys_used], hidden, m * group)
            out[s + c : s + c + m] = o.view(kv_heads, m, group, dim).permute(1, 0, 2, 3).reshape(m, heads, dim)
    if meta.observer is not None:
        meta.observer(layer, q, kv)
    return out
