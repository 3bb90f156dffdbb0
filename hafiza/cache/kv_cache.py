"""The paged KV pool: per layer, K and V in blocks shaped [num_blocks, block_size, kv_heads, head_dim]."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hafiza.cache.memory import kv_bytes_per_token


@dataclass(frozen=True)
class KVLayout:
    """Shape facts of a paged pool; `bytes_per_token` counts K and V over all layers."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        bits = torch.finfo(self.dtype).bits
        return int(kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim * bits / 8))

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


class KVCache:
    """Full-precision paged storage. Writes scatter tokens into slots; reads gather whole blocks."""

    def __init__(self, layout: KVLayout, device: torch.device) -> None:
        self.layout, self.device = layout, device
        shape = (layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.k = [torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)]
        self.v = [torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)]

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [T, Hkv, d] of T tokens at flat slot indices (block * block_size + offset)."""
        h, d = self.layout.num_kv_heads, self.layout.head_dim
        self.k[layer].view(-1, h, d).index_copy_(0, slots, k.to(self.layout.dtype))
        self.v[layer].view(-1, h, d).index_copy_(0, slots, v.to(self.layout.dtype))

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks of `block_tables` [B, n] as contiguous K, V [B, n * block_size, Hkv, d]."""
        b, n = block_tables.shape
        flat = block_tables.reshape(-1)
        shape = (b, n * self.layout.block_size, self.layout.num_kv_heads, self.layout.head_dim)
        return self.k[layer].index_select(0, flat).view(shape), self.v[layer].index_select(0, flat).view(shape)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy whole blocks out (offload, codec): [layers, 2, n, block_size, Hkv, d] on the CPU."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return torch.stack([torch.stack([self.k[i][idx], self.v[i][idx]]) for i in range(self.layout.num_layers)]).cpu()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of read_blocks: load whole blocks (tier promotion, swap-in)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        data = data.to(device=self.device, dtype=self.layout.dtype)
        for i in range(self.layout.num_layers):
            self.k[i][idx] = data[i, 0]
            self.v[i][idx] = data[i, 1]
