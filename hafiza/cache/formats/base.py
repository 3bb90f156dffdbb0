"""The frame every storage format shares: block reads and writes in terms of three per-format steps, sizes,
and (for quantised formats) the inf/NaN check."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from hafiza.cache.errors import KVDtypeError, NonFiniteKVError
from hafiza.cache.formats.native import NativeBlocks, PartSpec, check_native
from hafiza.cache.layout import KVLayout


class PoolFormat(ABC):
    """A paged KV pool storing K/V as `layout.kv_dtype` and handing them back in `layout.compute_dtype`.

    A format implements `_write` (tokens into slots), `_blocks` (whole blocks out, in `block_dtype`),
    `_store_blocks` (whole blocks in), `_native` / `_store_native` / `native_spec` (whole blocks as stored,
    see NativeBlocks) and `payload_bytes_per_token` (its size). Quantised formats
    (`refuses_nonfinite`) refuse inf/NaN: they are noted per layer without a host sync and raised once per
    forward step, when the last layer writes (at once in `write_blocks`): one cheap reduction per write, one
    device sync per step.
    """

    kv_dtypes: ClassVar[tuple[str, ...]]
    refuses_nonfinite: ClassVar[bool] = True

    def __init__(self, layout: KVLayout, device: torch.device | str) -> None:
        if layout.kv_dtype not in self.kv_dtypes:
            raise KVDtypeError(f"{type(self).__name__} stores {' or '.join(self.kv_dtypes)}, the layout asks for "
                               f"{layout.kv_dtype}")
        self.layout, self.device = layout, torch.device(device)
        self._nonfinite = torch.zeros(layout.num_layers, dtype=torch.bool, device=self.device)

    @property
    def kv_dtype(self) -> str:
        return self.layout.kv_dtype

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def block_dtype(self) -> torch.dtype:
        """The dtype of `read_blocks`: the compute dtype (lossy formats dequantise), or the storage dtype."""
        return self.layout.compute_dtype

    @classmethod
    @abstractmethod
    def payload_bytes_per_token(cls, layout: KVLayout, **options: int) -> float:
        """Stored bytes per token over all layers, K and V, payload plus scales, of this format for `layout`."""

    @property
    def bytes_per_token(self) -> float:
        return self.payload_bytes_per_token(self.layout)

    @property
    def bytes_per_block(self) -> int:
        return int(self.bytes_per_token * self.block_size)

    @property
    def fixed_bytes(self) -> int:
        """Bytes held regardless of the number of blocks (int4's full-precision window); 0 for most formats."""
        return 0

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [T, Hkv, d] of T tokens at flat slots (block * block_size + offset)."""
        if self.refuses_nonfinite:
            self._nonfinite[layer] |= ~(torch.isfinite(k).all() & torch.isfinite(v).all())
        self._write(layer, slots, k, v)
        if self.refuses_nonfinite and layer == self.layout.num_layers - 1:
            self.check_finite()

    def check_finite(self) -> None:
        """Raise NonFiniteKVError if any write since the last check carried inf or NaN."""
        if not bool(self._nonfinite.any()):
            return
        layers = self._nonfinite.nonzero().flatten().tolist()
        self._nonfinite.zero_()
        raise NonFiniteKVError(
            f"{self.kv_dtype} KV cache: the model wrote inf or NaN keys/values at layer(s) {layers}; a quantised "
            "pool cannot scale them (the forward overflowed: compute in fp32 or store K/V at full precision)"
        )

    def _gathered(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks of `block_tables` [B, n] as K, V [B, n * block_size, Hkv, d] in `block_dtype`."""
        b, n = block_tables.shape
        k, v = self._blocks(layer, block_tables.reshape(-1).to(self.device))
        shape = (b, n * self.block_size, self.layout.num_kv_heads, self.layout.head_dim)
        return k.reshape(shape), v.reshape(shape)

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks of `block_tables` [B, n] as contiguous K, V [B, n * block_size, Hkv, d] in the compute dtype."""
        k, v = self._gathered(layer, block_tables)
        dt = self.layout.compute_dtype
        return k.to(dt), v.to(dt)

    def gather_into(self, layer: int, block_tables: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The values `gather` gives, written head-major into `keys` / `values` [B, Hkv, n * block_size, d] (any
        strides, the compute dtype): one copy of each block out of the pool and one into place, for the decode
        attention's padded operands."""
        k, v = self._gathered(layer, block_tables)
        if keys.dtype != self.layout.compute_dtype:  # gather's rounding first, as a cast of its result would
            k, v = k.to(self.layout.compute_dtype), v.to(self.layout.compute_dtype)
        keys.copy_(k.transpose(1, 2))
        values.copy_(v.transpose(1, 2))

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Whole blocks out (offload, codec): [layers, 2, n, block_size, Hkv, d] in `block_dtype` on the CPU."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        out = [torch.stack(self._blocks(i, idx)) for i in range(self.layout.num_layers)]
        return torch.stack(out).cpu()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of read_blocks: store whole blocks (swap-in, tier promotion)."""
        if self.refuses_nonfinite and not bool(torch.isfinite(data).all()):
            raise NonFiniteKVError(f"{self.kv_dtype} KV cache: write_blocks got inf or NaN values; not stored")
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        data = data.to(self.device)
        for i in range(self.layout.num_layers):
            self._store_blocks(i, idx, data[i, 0], data[i, 1])

    def read_native(self, block_ids: list[int]) -> NativeBlocks:
        """Whole blocks in their stored form (codes and scales), on the CPU: what tiers keep of a quantised
        pool. `write_native` of the result stores the same bytes, so `gather` gives the same values."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        per_layer = [self._native(i, idx) for i in range(self.layout.num_layers)]
        parts = {name: torch.stack([p[name] for p in per_layer]).cpu() for name in per_layer[0]}
        codes = parts.pop("codes")
        return NativeBlocks(self.kv_dtype, codes, parts)

    def write_native(self, block_ids: list[int], native: NativeBlocks) -> None:
        """Inverse of read_native: store the blocks' codes and scales as they are (no re-quantisation)."""
        check_native(native, self.kv_dtype, self.layout.num_layers, self.native_spec(), len(block_ids))
        if self.refuses_nonfinite:
            parts = [native.codes, *native.scales.values()] if native.codes.is_floating_point() \
                else list(native.scales.values())
            if not all(bool(torch.isfinite(t.float()).all()) for t in parts):
                raise NonFiniteKVError(f"{self.kv_dtype} KV cache: write_native got inf or NaN codes or scales; "
                                       "not stored")
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for i in range(self.layout.num_layers):
            layer = {"codes": native.codes[i].to(self.device)}
            layer |= {name: t[i].to(self.device) for name, t in native.scales.items()}
            self._store_native(i, idx, layer)

    @abstractmethod
    def native_spec(self) -> PartSpec:
        """Per layer and block, each native part's shape and dtype ("codes" without its K/V axis)."""

    @abstractmethod
    def _native(self, layer: int, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """Blocks `idx` of one layer as stored: "codes" [2, n, bs, Hkv, c] and each scale [n, ...]."""

    @abstractmethod
    def _store_native(self, layer: int, idx: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        """Store what `_native` returned for blocks `idx` of one layer."""

    @abstractmethod
    def _write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store T tokens' K/V at flat slots."""

    @abstractmethod
    def _blocks(self, layer: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of whole blocks `idx`: [n, block_size, Hkv, d] in `block_dtype`."""

    @abstractmethod
    def _store_blocks(self, layer: int, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store whole blocks `idx` from K, V [n, block_size, Hkv, d]."""

    def _zeros(self, *shape: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """One zero tensor per layer."""
        return [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.layout.num_layers)]


class ScaledCodesFormat(PoolFormat):
    """A pool whose layers hold codes `kq`/`vq` and scales `ks`/`vs` per layer (fp8, int8): its native block is
    the stacked codes plus both scales, as stored."""

    kq: list[torch.Tensor]
    vq: list[torch.Tensor]
    ks: list[torch.Tensor]
    vs: list[torch.Tensor]

    def _native(self, layer: int, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"codes": torch.stack([self.kq[layer][idx], self.vq[layer][idx]]),
                "k_scale": self.ks[layer][idx], "v_scale": self.vs[layer][idx]}

    def _store_native(self, layer: int, idx: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        self.kq[layer][idx], self.vq[layer][idx] = parts["codes"][0], parts["codes"][1]
        self.ks[layer][idx], self.vs[layer][idx] = parts["k_scale"], parts["v_scale"]
