"""int8 pool: symmetric, one fp16 scale per token per head (amax / 127), written token by token."""

from __future__ import annotations

import torch

from hafiza.cache.codes import int8_dequantize, int8_quantize
from hafiza.cache.formats.base import ScaledCodesFormat
from hafiza.cache.formats.native import PartSpec
from hafiza.cache.layout import KVLayout
from hafiza.cache.memory import kv_bytes_per_token


class Int8KV(ScaledCodesFormat):
    """Per layer: codes int8 [blocks, bs, Hkv, d] and scales fp16 [blocks, bs, Hkv], for K and for V."""

    kv_dtypes = ("int8",)

    def __init__(self, layout: KVLayout, device: torch.device | str) -> None:
        super().__init__(layout, device)
        nb, bs, h, d = layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim
        self.kq, self.vq = (self._zeros(nb, bs, h, d, dtype=torch.int8) for _ in "kv")
        self.ks, self.vs = (self._zeros(nb, bs, h, dtype=torch.float16) for _ in "kv")

    @classmethod
    def payload_bytes_per_token(cls, layout: KVLayout, **options: int) -> float:
        return kv_bytes_per_token(layout.num_layers, layout.num_kv_heads, layout.head_dim + 2)

    def _write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        h, d = self.layout.num_kv_heads, self.layout.head_dim
        for x, codes, scales in ((k, self.kq[layer], self.ks[layer]), (v, self.vq[layer], self.vs[layer])):
            q, s = int8_quantize(x)
            codes.view(-1, h, d).index_copy_(0, slots, q)
            scales.view(-1, h).index_copy_(0, slots, s)

    def _blocks(self, layer: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dt = self.layout.compute_dtype
        return (int8_dequantize(self.kq[layer][idx], self.ks[layer][idx], dt),
                int8_dequantize(self.vq[layer][idx], self.vs[layer][idx], dt))

    def _store_blocks(self, layer: int, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for x, codes, scales in ((k, self.kq[layer], self.ks[layer]), (v, self.vq[layer], self.vs[layer])):
            q, s = int8_quantize(x)
            codes[idx], scales[idx] = q, s

    def native_spec(self) -> PartSpec:
        bs, h, d = self.layout.block_size, self.layout.num_kv_heads, self.layout.head_dim
        return {"codes": ((bs, h, d), torch.int8), "k_scale": ((bs, h), torch.float16),
                "v_scale": ((bs, h), torch.float16)}
