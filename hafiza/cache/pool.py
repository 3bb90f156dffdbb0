"""The one interface of the working KV pool, the factory that builds a pool by storage dtype, and what a memory
budget buys in each format. Every size comes from the format itself (`payload_bytes_per_token`)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import torch

from hafiza.cache.formats.base import PoolFormat
from hafiza.cache.formats.fp8 import Fp8KV
from hafiza.cache.formats.full import FullPrecisionKV
from hafiza.cache.formats.int4 import Int4KV
from hafiza.cache.formats.int8 import Int8KV
from hafiza.cache.formats.native import NativeBlocks, PartSpec
from hafiza.cache.layout import KVLayout, check_kv_dtype

if TYPE_CHECKING:
    from hafiza.models.config import ModelConfig


class KVPool(Protocol):
    """A paged KV pool: `num_blocks` blocks of `block_size` token slots per layer, for K and for V.

    Contract, the same for every storage format:
    - `write(layer, slots, k, v)` stores K/V [T, Hkv, d] of T tokens at flat slots (block * block_size + offset).
      A write at offset 0 starts a new fill of that block. Lossy formats refuse inf/NaN (NonFiniteKVError), at
      the latest when the last layer of a step writes.
    - `gather(layer, block_tables)` returns the blocks of `block_tables` [B, n] as contiguous K, V
      [B, n * block_size, Hkv, d] in `layout.compute_dtype`: the values attention must use. `gather_into(layer,
      block_tables, keys, values)` writes the same values head-major into given [B, Hkv, n * block_size, d] views.
    - `read_blocks(ids)` copies whole blocks out to the CPU as [layers, 2, n, block_size, Hkv, d] in
      `block_dtype`; `write_blocks(ids, data)` is its inverse (swap-in). For a quantised format it
      re-quantises, so it is lossy: what a tier keeps goes through the native form instead.
    - `read_native(ids)` copies whole blocks out as stored (`NativeBlocks`: codes in the storage dtype, fp8
      e4m3 / int8 / int4 packed two per byte, plus their scales and zeros; full precision: the blocks
      themselves); `write_native(ids, native)` stores exactly those bytes. Round trip: after
      `write_native(ids, n)`, `read_native(ids)` equals `n` bit for bit and `gather` returns the values the
      source pool's `gather` returned for those blocks (int4: a block still staged in full precision is
      read out sealed, as aging out would seal it). `native_spec()` gives each part's shape and dtype.
    - `bytes_per_token` / `bytes_per_block` are the stored bytes (payload and scales, all layers, K and V);
      `fixed_bytes` is what the pool holds whatever its number of blocks.
    """

    layout: KVLayout

    @property
    def kv_dtype(self) -> str: ...

    @property
    def block_size(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_dtype(self) -> torch.dtype: ...

    @property
    def bytes_per_token(self) -> float: ...

    @property
    def bytes_per_block(self) -> int: ...

    @property
    def fixed_bytes(self) -> int: ...

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def gather_into(self, layer: int, block_tables: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None: ...

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor: ...

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None: ...

    def native_spec(self) -> PartSpec: ...

    def read_native(self, block_ids: list[int]) -> NativeBlocks: ...

    def write_native(self, block_ids: list[int], native: NativeBlocks) -> None: ...


FORMATS: dict[str, type[PoolFormat]] = {
    d: fmt for fmt in (FullPrecisionKV, Fp8KV, Int8KV, Int4KV) for d in fmt.kv_dtypes
}


def make_kv_pool(layout: KVLayout, device: torch.device | str, *, max_seqs: int = 1, window_blocks: int = 2,
                 fp8_headroom: float = 2.0, value_group: int = 32) -> KVPool:
    """A paged pool storing K/V as `layout.kv_dtype` and gathering them in `layout.compute_dtype`.

    max_seqs / window_blocks / value_group size int4's full-precision window and value groups (see Int4KV),
    fp8_headroom fp8's first scale (see Fp8KV); other formats take none of them.
    """
    kv_dtype = layout.kv_dtype
    if kv_dtype == "fp8":
        return Fp8KV(layout, device, headroom=fp8_headroom)
    if kv_dtype == "int4":
        return Int4KV(layout, device, window_blocks=window_blocks, max_seqs=max_seqs, value_group=value_group)
    return FORMATS[kv_dtype](layout, device)


def bytes_per_token(layout: KVLayout, value_group: int = 32) -> float:
    """Stored bytes per token (all layers, K and V, payload and scales) of `layout.kv_dtype` for this shape."""
    return FORMATS[layout.kv_dtype].payload_bytes_per_token(layout, value_group=value_group)


def bytes_per_block(layout: KVLayout) -> int:
    """Stored bytes of one block (what `make_kv_pool(layout, ...).bytes_per_block` reports)."""
    return int(bytes_per_token(layout) * layout.block_size)


def fixed_bytes(layout: KVLayout, max_seqs: int = 1, window_blocks: int = 2) -> int:
    """Bytes a pool of this layout holds whatever its number of blocks (int4's staging window)."""
    return Int4KV.staging_bytes(layout, window_blocks, max_seqs) if layout.kv_dtype == "int4" else 0


def blocks_that_fit(kv_memory_bytes: int, layout: KVLayout, max_seqs: int = 1, window_blocks: int = 2) -> int:
    """Whole blocks of this layout's format that fit in `kv_memory_bytes` (layout.num_blocks is ignored)."""
    room = kv_memory_bytes - fixed_bytes(layout, max_seqs, window_blocks)
    return max(0, int(room // (bytes_per_token(layout) * layout.block_size)))


def bytes_for_tokens(layout: KVLayout, tokens: int, max_seqs: int = 1, window_blocks: int = 2) -> int:
    """KV memory that holds `tokens` tokens in whole blocks of this layout's format (`blocks_that_fit` inverted)."""
    blocks = -(-tokens // layout.block_size)
    stored = math.ceil(bytes_per_token(layout) * layout.block_size * blocks)
    return fixed_bytes(layout, max_seqs, window_blocks) + stored


def tokens_that_fit(kv_memory_bytes: int, layout: KVLayout, max_seqs: int = 1, window_blocks: int = 2) -> int:
    """Token capacity of `kv_memory_bytes` of KV memory in this layout's format, in whole blocks."""
    return blocks_that_fit(kv_memory_bytes, layout, max_seqs, window_blocks) * layout.block_size


def layout_for(config: ModelConfig, num_blocks: int, block_size: int, kv_dtype: str,
               compute_dtype: torch.dtype) -> KVLayout:
    """A KVLayout for a model's shape (num_layers, num_kv_heads, head_dim)."""
    check_kv_dtype(kv_dtype)
    return KVLayout(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim, kv_dtype,
                    compute_dtype)


def with_blocks(layout: KVLayout, num_blocks: int) -> KVLayout:
    """The same layout with another number of blocks."""
    return replace(layout, num_blocks=num_blocks)
