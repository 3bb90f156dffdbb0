"""Whole blocks as a pool stores them (`read_native` / `write_native`): codes in their storage dtype plus the
scales and zeros that give them meaning. Moving these bytes, rather than dequantised values, keeps a quantised
block bit-exact across tiers and instances and costs 1 byte (fp8, int8) or half a byte (int4) per value."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hafiza.cache.errors import KVDtypeError

PartSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class NativeBlocks:
    """n blocks in a pool's own storage form, on the CPU.

    - `codes` [layers, 2 (K, V), n, block_size, Hkv, c]: the stored K/V codes (c = head_dim; head_dim / 2 for
      int4, two 4-bit codes per byte, even channel in the low nibble). dtype: the storage dtype
      (fp32/bf16/fp16 for full precision, float8_e4m3fn for fp8, int8, uint8 for int4).
    - `scales` name -> [layers, n, ...]: what dequantises the codes (fp8: `k_scale`/`v_scale` fp32 per head;
      int8: fp16 per token per head; int4: key `k_scale`/`k_zero` per channel, value `v_scale`/`v_zero` per
      token and channel group). Empty for full precision, whose codes are the values.
    """

    kv_dtype: str
    codes: torch.Tensor
    scales: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return int(self.codes.shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales together (what a tier stores before its codec)."""
        return sum(t.numel() * t.element_size() for t in (self.codes, *self.scales.values()))

    def block(self, i: int) -> NativeBlocks:
        """Block i alone (n = 1), contiguous."""
        return NativeBlocks(self.kv_dtype, self.codes[:, :, i : i + 1].contiguous(),
                            {name: t[:, i : i + 1].contiguous() for name, t in self.scales.items()})

    def equal(self, other: NativeBlocks) -> bool:
        """Bit-identical codes and scales (NaN patterns included)."""
        if self.kv_dtype != other.kv_dtype or set(self.scales) != set(other.scales):
            return False
        pairs = [(self.codes, other.codes)] + [(t, other.scales[n]) for n, t in self.scales.items()]
        return all(_same_bits(a, b) for a, b in pairs)


def stack(blocks: list[NativeBlocks]) -> NativeBlocks:
    """Several NativeBlocks of one kv_dtype as one, blocks in order."""
    if not blocks:
        raise KVDtypeError("no blocks to stack")
    first = blocks[0]
    if any(b.kv_dtype != first.kv_dtype or set(b.scales) != set(first.scales) for b in blocks):
        raise KVDtypeError("native blocks of different kv_dtypes or parts cannot be stacked")
    return NativeBlocks(first.kv_dtype, torch.cat([b.codes for b in blocks], dim=2),
                        {n: torch.cat([b.scales[n] for b in blocks], dim=1) for n in first.scales})


def block_nbytes(spec: PartSpec, num_layers: int) -> int:
    """Bytes of one block's native parts (codes for K and V, every scale) over `num_layers` layers."""
    total = 0
    for name, (shape, dtype) in spec.items():
        total += (2 if name == "codes" else 1) * num_layers * math.prod(shape) * dtype.itemsize
    return total


def check_native(native: NativeBlocks, kv_dtype: str, num_layers: int, spec: PartSpec, n: int) -> None:
    """Refuse native blocks that are not `n` blocks of this pool's form (kv_dtype, part names, shapes, dtypes).
    `spec` gives each part's per-layer, per-block shape and dtype ("codes" without its K/V axis)."""
    if native.kv_dtype != kv_dtype:
        raise KVDtypeError(f"native blocks are {native.kv_dtype}, the pool stores {kv_dtype}")
    names = {"codes", *native.scales}
    if names != set(spec):
        raise KVDtypeError(f"native {kv_dtype} blocks need parts {sorted(spec)}, got {sorted(names)}")
    for name, (shape, dtype) in spec.items():
        t = native.codes if name == "codes" else native.scales[name]
        want = (num_layers, 2, n, *shape) if name == "codes" else (num_layers, n, *shape)
        if tuple(t.shape) != want or t.dtype != dtype:
            raise KVDtypeError(f"native {kv_dtype} part {name!r} is {tuple(t.shape)} {t.dtype}, "
                               f"expected {want} {dtype}")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.contiguous().view(width).cpu(), b.contiguous().view(width).cpu()))
