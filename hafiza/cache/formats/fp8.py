"""fp8 pool: e4m3 codes, one power-of-two scale per block per head, grown exactly when a block outgrows it."""

from __future__ import annotations

import torch

from hafiza.cache.codes import FP8, FP8_MAX, fp8_decode, fp8_encode, pow2_scale
from hafiza.cache.formats.base import ScaledCodesFormat
from hafiza.cache.formats.native import PartSpec
from hafiza.cache.layout import KVLayout
from hafiza.cache.memory import kv_bytes_per_token


class Fp8KV(ScaledCodesFormat):
    """Per layer: codes e4m3 [blocks, bs, Hkv, d] and scales fp32 [blocks, Hkv], for K and for V.

    A block's scale is set by its first write (amax x `headroom`, rounded up to a power of two). A later
    token that would clip grows the scale to the next fitting power of two and the block's earlier codes are
    divided by the (power-of-two) ratio, which only shifts their exponent: exact unless a code drops below
    e4m3's normal range (|x| < 2^-6 scale). So no token ever clips and earlier tokens are not re-rounded.
    A write at offset 0 starts a new fill of the block (blocks fill from offset 0), which resets its scale.
    """

    kv_dtypes = ("fp8",)

    def __init__(self, layout: KVLayout, device: torch.device | str, headroom: float = 2.0) -> None:
        super().__init__(layout, device)
        nb, bs, h, d = layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim
        self.headroom = headroom
        self.kq, self.vq = self._zeros(nb, bs, h, d, dtype=FP8), self._zeros(nb, bs, h, d, dtype=FP8)
        self.ks, self.vs = self._zeros(nb, h, dtype=torch.float32), self._zeros(nb, h, dtype=torch.float32)

    @classmethod
    def payload_bytes_per_token(cls, layout: KVLayout, **options: int) -> float:
        return kv_bytes_per_token(layout.num_layers, layout.num_kv_heads, layout.head_dim + 4 / layout.block_size)

    def _write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        blocks = torch.div(slots, self.block_size, rounding_mode="floor")
        ub, inv = torch.unique(blocks, return_inverse=True)
        fresh = torch.zeros(len(ub), dtype=torch.bool, device=self.device)
        fresh[inv[slots % self.block_size == 0]] = True
        for x, codes, scales in ((k, self.kq[layer], self.ks[layer]), (v, self.vq[layer], self.vs[layer])):
            self._write_one(x, codes, scales, slots, ub, inv, fresh)

    def _write_one(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor,
                   ub: torch.Tensor, inv: torch.Tensor, fresh: torch.Tensor) -> None:
        h, d = self.layout.num_kv_heads, self.layout.head_dim
        amax = torch.zeros(len(ub), h, dtype=torch.float32, device=self.device)
        amax.scatter_reduce_(0, inv[:, None].expand(-1, h), x.float().abs().amax(-1), "amax")
        cur = torch.where(fresh[:, None], torch.zeros_like(amax), scales[ub])
        grow = (amax > cur * FP8_MAX) | (cur == 0)
        new = torch.where(grow, pow2_scale(amax, self.headroom), cur)
        ratio = torch.where(cur > 0, cur / new, torch.zeros_like(cur))
        codes[ub] = (codes[ub].float() * ratio[:, None, :, None]).to(FP8)
        scales[ub] = new
        codes.view(-1, h, d)[slots] = fp8_encode(x, new[inv][..., None])

    def _blocks(self, layer: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dt = self.layout.compute_dtype
        return (fp8_decode(self.kq[layer][idx], self.ks[layer][idx][:, None, :, None], dt),
                fp8_decode(self.vq[layer][idx], self.vs[layer][idx][:, None, :, None], dt))

    def _store_blocks(self, layer: int, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for x, codes, scales in ((k, self.kq[layer], self.ks[layer]), (v, self.vq[layer], self.vs[layer])):
            s = pow2_scale(x.float().abs().amax(dim=(1, 3)), self.headroom)
            codes[idx], scales[idx] = fp8_encode(x, s[:, None, :, None]), s

    def native_spec(self) -> PartSpec:
        bs, h, d = self.layout.block_size, self.layout.num_kv_heads, self.layout.head_dim
        return {"codes": ((bs, h, d), FP8), "k_scale": ((h,), torch.float32), "v_scale": ((h,), torch.float32)}
