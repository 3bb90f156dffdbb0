"""Full-precision format (fp32, bf16, fp16): K/V stored as they are, or rounded to a narrower float dtype."""

from __future__ import annotations

import torch

from hafiza.cache.formats.base import PoolFormat
from hafiza.cache.formats.native import PartSpec
from hafiza.cache.layout import FULL_DTYPES, KVLayout
from hafiza.cache.memory import kv_bytes_per_token


class FullPrecisionKV(PoolFormat):
    """Per layer: K and V [blocks, bs, Hkv, d] in `storage_dtype` (layout.kv_dtype). Writes scatter tokens into
    slots; reads gather whole blocks and cast them to the compute dtype (a no-op when the two are equal).
    No value is refused: inf/NaN are stored as they are."""

    kv_dtypes = tuple(FULL_DTYPES)
    refuses_nonfinite = False

    def __init__(self, layout: KVLayout, device: torch.device | str) -> None:
        super().__init__(layout, device)
        self.storage_dtype = FULL_DTYPES[layout.kv_dtype]
        shape = (layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.k = self._zeros(*shape, dtype=self.storage_dtype)
        self.v = self._zeros(*shape, dtype=self.storage_dtype)

    @property
    def block_dtype(self) -> torch.dtype:
        """Blocks leave in the storage dtype, so offload and the codec see exactly the stored values."""
        return self.storage_dtype

    @classmethod
    def payload_bytes_per_token(cls, layout: KVLayout, **options: int) -> float:
        bits = torch.finfo(FULL_DTYPES[layout.kv_dtype]).bits
        return kv_bytes_per_token(layout.num_layers, layout.num_kv_heads, layout.head_dim * bits / 8)

    def _write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        h, d = self.layout.num_kv_heads, self.layout.head_dim
        self.k[layer].view(-1, h, d).index_copy_(0, slots, k.to(self.storage_dtype))
        self.v[layer].view(-1, h, d).index_copy_(0, slots, v.to(self.storage_dtype))

    def _blocks(self, layer: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer].index_select(0, idx), self.v[layer].index_select(0, idx)

    def _store_blocks(self, layer: int, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer][idx] = k.to(self.storage_dtype)
        self.v[layer][idx] = v.to(self.storage_dtype)

    def native_spec(self) -> PartSpec:
        lay = self.layout
        return {"codes": ((lay.block_size, lay.num_kv_heads, lay.head_dim), self.storage_dtype)}

    def _native(self, layer: int, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"codes": torch.stack(self._blocks(layer, idx))}

    def _store_native(self, layer: int, idx: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        self.k[layer][idx], self.v[layer][idx] = parts["codes"][0], parts["codes"][1]
