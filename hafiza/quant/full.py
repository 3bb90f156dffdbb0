"""Full-precision pool whose storage dtype may differ from the compute dtype (bf16 under fp32 compute)."""

from __future__ import annotations

from dataclasses import replace

import torch

from hafiza.cache.kv_cache import KVCache, KVLayout


class FullPrecisionKV(KVCache):
    """The existing KVCache, storing at `storage_dtype` and gathering in `layout.dtype` (same when equal)."""

    kind = "full"

    def __init__(
        self, layout: KVLayout, device: torch.device | str, storage_dtype: torch.dtype | None = None
    ) -> None:
        self.storage_dtype = storage_dtype or layout.dtype
        super().__init__(replace(layout, dtype=self.storage_dtype), torch.device(device))
        self.storage_layout, self.layout = self.layout, layout

    @classmethod
    def payload_bytes_per_token(cls, layout: KVLayout, storage_dtype: torch.dtype | None = None) -> float:
        return float(replace(layout, dtype=storage_dtype or layout.dtype).bytes_per_token)

    @property
    def bytes_per_token(self) -> float:
        return float(self.storage_layout.bytes_per_token)

    @property
    def fixed_bytes(self) -> int:
        return 0

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        h, d = self.layout.num_kv_heads, self.layout.head_dim
        self.k[layer].view(-1, h, d).index_copy_(0, slots, k.to(self.storage_dtype))
        self.v[layer].view(-1, h, d).index_copy_(0, slots, v.to(self.storage_dtype))

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = super().gather(layer, block_tables)
        return k.to(self.layout.dtype), v.to(self.layout.dtype)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        data = data.to(device=self.device, dtype=self.storage_dtype)
        for i in range(self.layout.num_layers):
            self.k[i][idx] = data[i, 0]
            self.v[i][idx] = data[i, 1]
