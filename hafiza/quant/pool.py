"""Shared frame of the quantised paged pools: the PagedKV interface, block reads, the non-finite check."""

from __future__ import annotations

import torch

from hafiza.cache.kv_cache import KVLayout
from hafiza.quant.errors import NonFiniteKVError


class QuantizedPool:
    """A paged KV pool that stores K/V in a lossy format and hands them back in `layout.dtype`.

    Subclasses implement `_write` (tokens into slots), `_blocks` (dequantise whole blocks) and
    `_store_blocks` (quantise whole blocks). Inf/NaN are noted per layer without a host sync and raised once
    per forward step, when the last layer writes (at once in `write_blocks`): one cheap reduction per write,
    one device sync per step.
    """

    kind = ""

    def __init__(self, layout: KVLayout, device: torch.device | str) -> None:
        self.layout, self.device = layout, torch.device(device)
        self._nonfinite = torch.zeros(layout.num_layers, dtype=torch.bool, device=self.device)

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def bytes_per_token(self) -> float:
        """Stored bytes per token over all layers, K and V, payload plus scales."""
        return self.payload_bytes_per_token(self.layout)

    @classmethod
    def payload_bytes_per_token(cls, layout: KVLayout, **options: object) -> float:
        raise NotImplementedError

    @property
    def fixed_bytes(self) -> int:
        """Bytes held regardless of the number of blocks (int4's full-precision window); 0 for most kinds."""
        return 0

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantise and store K/V [T, Hkv, d] of T tokens at flat slots (block * block_size + offset)."""
        self._nonfinite[layer] |= ~(torch.isfinite(k).all() & torch.isfinite(v).all())
        self._write(layer, slots, k, v)
        if layer == self.layout.num_layers - 1:
            self.check_finite()

    def check_finite(self) -> None:
        """Raise NonFiniteKVError if any write since the last check carried inf or NaN."""
        if not bool(self._nonfinite.any()):
            return
        layers = self._nonfinite.nonzero().flatten().tolist()
        self._nonfinite.zero_()
        raise NonFiniteKVError(
            f"{self.kind} KV cache: the model wrote inf or NaN keys/values at layer(s) {layers}; a quantised "
            "pool cannot scale them (the forward overflowed: try --dtype fp32 or a full-precision --kv-dtype)"
        )

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks of `block_tables` [B, n] dequantised to contiguous K, V [B, n * block_size, Hkv, d]."""
        b, n = block_tables.shape
        k, v = self._blocks(layer, block_tables.reshape(-1).to(self.device))
        shape = (b, n * self.block_size, self.layout.num_kv_heads, self.layout.head_dim)
        return k.reshape(shape), v.reshape(shape)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Whole blocks dequantised: [layers, 2, n, block_size, Hkv, d] in layout.dtype on the CPU."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        out = [torch.stack(self._blocks(i, idx)) for i in range(self.layout.num_layers)]
        return torch.stack(out).cpu()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of read_blocks: quantise and store whole blocks (swap-in, tier promotion)."""
        if not bool(torch.isfinite(data).all()):
            raise NonFiniteKVError(f"{self.kind} KV cache: write_blocks got inf or NaN values; not stored")
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        data = data.to(self.device)
        for i in range(self.layout.num_layers):
            self._store_blocks(i, idx, data[i, 0], data[i, 1])

    def _write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        raise NotImplementedError

    def _blocks(self, layer: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _store_blocks(self, layer: int, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        raise NotImplementedError

    def _zeros(self, *shape: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """One zero tensor per layer."""
        return [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.layout.num_layers)]
