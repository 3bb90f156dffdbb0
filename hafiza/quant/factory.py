"""One entry point for the scheduler: a paged pool by kind name, and the capacity a memory budget buys."""

from __future__ import annotations

from dataclasses import replace

import torch

from hafiza.cache.kv_cache import KVLayout
from hafiza.quant.errors import KVKindError
from hafiza.quant.fp8 import Fp8KV
from hafiza.quant.full import FullPrecisionKV
from hafiza.quant.int4 import Int4KV
from hafiza.quant.int8 import Int8KV
from hafiza.quant.pool import QuantizedPool

FULL_KINDS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
KV_KINDS = ("bf16", "fp16", "fp32", "fp8", "int8", "int4")


def _check_kind(kind: str) -> None:
    if kind not in KV_KINDS:
        raise KVKindError(f"unknown KV cache kind {kind!r}: use one of {', '.join(KV_KINDS)}", setting="kv_dtype")


def make_kv_cache(kind: str, layout: KVLayout, device: torch.device | str, *, max_seqs: int = 1,
                  window_blocks: int = 2, fp8_headroom: float = 2.0,
                  value_group: int = 32) -> FullPrecisionKV | QuantizedPool:
    """A paged pool storing K/V as `kind`; `layout.dtype` is the compute dtype that `gather` returns.

    max_seqs / window_blocks size int4's full-precision window (see Int4KV); other kinds ignore them.
    """
    _check_kind(kind)
    if kind in FULL_KINDS:
        return FullPrecisionKV(layout, device, FULL_KINDS[kind])
    if kind == "fp8":
        return Fp8KV(layout, device, headroom=fp8_headroom)
    if kind == "int8":
        return Int8KV(layout, device)
    return Int4KV(layout, device, window_blocks=window_blocks, max_seqs=max_seqs, value_group=value_group)


def bytes_per_token(kind: str, layout: KVLayout, value_group: int = 32) -> float:
    """Stored bytes per token (all layers, K and V, payload and scales) of `kind` for this layout's shape."""
    _check_kind(kind)
    if kind in FULL_KINDS:
        return FullPrecisionKV.payload_bytes_per_token(layout, FULL_KINDS[kind])
    if kind == "int4":
        return Int4KV.payload_bytes_per_token(layout, value_group)
    return {"fp8": Fp8KV, "int8": Int8KV}[kind].payload_bytes_per_token(layout)


def fixed_bytes(kind: str, layout: KVLayout, max_seqs: int = 1, window_blocks: int = 2) -> int:
    """Bytes a pool of `kind` holds whatever its number of blocks (int4's staging window)."""
    _check_kind(kind)
    return Int4KV.staging_bytes(layout, window_blocks, max_seqs) if kind == "int4" else 0


def blocks_that_fit(kv_memory_bytes: int, kind: str, layout: KVLayout, max_seqs: int = 1,
                    window_blocks: int = 2) -> int:
    """Whole blocks of `kind` that fit in `kv_memory_bytes` (layout.num_blocks is ignored)."""
    room = kv_memory_bytes - fixed_bytes(kind, layout, max_seqs, window_blocks)
    per_block = bytes_per_token(kind, layout) * layout.block_size
    return max(0, int(room // per_block))


def tokens_that_fit(kv_memory_bytes: int, kind: str, layout: KVLayout, max_seqs: int = 1,
                    window_blocks: int = 2) -> int:
    """Token capacity of `kv_memory_bytes` of KV memory stored as `kind`, in whole blocks."""
    return blocks_that_fit(kv_memory_bytes, kind, layout, max_seqs, window_blocks) * layout.block_size


def layout_for(model_config: object, num_blocks: int, block_size: int, dtype: torch.dtype) -> KVLayout:
    """A KVLayout for a model config (num_layers, num_kv_heads, head_dim) at compute dtype `dtype`."""
    c = model_config
    return KVLayout(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, dtype)


def with_blocks(layout: KVLayout, num_blocks: int) -> KVLayout:
    """The same layout with another number of blocks."""
    return replace(layout, num_blocks=num_blocks)
