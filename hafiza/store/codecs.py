"""Which lossless codec KV blocks are stored with (the store codec setting), through `hafiza.codec`'s public API.

A stored block is one pool block [layers, 2, block_size, kv_heads, head_dim], handed to the codec as
[block_size, layers * 2 * kv_heads * head_dim]: one chunk of `block_size` tokens whose channels are every
(layer, K or V, head, dim). One chunk per block keeps the codec's per-chunk overhead low: against one group per
(layer, K or V), zstd decodes 1.5x faster and stores 6 % less, exponent decodes 3.6x faster. The codec name is
part of every block key, so instances using different codecs never read each other's entries; decoding needs
no option (the container names its coder).

Default: `zstd`, the fastest coder that beats raw on size (measured in docs/STORE.md and by
`hafiza bench tiers`): exponent stores less but decodes ~9x slower, predictive is both larger and slower.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hafiza.codec import CodecContext, decode, encode
from hafiza.errors import ConfigError

STORE_CODECS: tuple[str, ...] = ("raw", "zstd", "planes", "exponent", "predictive")
DEFAULT_STORE_CODEC = "zstd"


class StoreCodecError(ConfigError):
    """An unknown store codec name (setting "store_codec")."""


def check_codec(name: str) -> str:
    """The codec name if the store knows it; a clear error listing the choices otherwise."""
    if name not in STORE_CODECS:
        raise StoreCodecError(f"unknown codec {name!r}: choose one of {', '.join(STORE_CODECS)}",
                              setting="store_codec")
    return name


def encode_block(block: torch.Tensor, codec: str) -> bytes:
    """One block [layers, 2, block_size, heads, dim] to the codec's framed container (tokens first)."""
    tokens = block.shape[2]
    return encode(block.permute(2, 0, 1, 3, 4).reshape(tokens, -1).contiguous(), CodecContext(coder=codec))


def decode_block(data: bytes, shape: Iterable[int], dtype: torch.dtype) -> torch.Tensor:
    """The block `encode_block` was given; raises CodecError (bad checksum, damaged container) or ValueError
    (a well-formed container of another shape or dtype)."""
    layers, two, tokens, heads, dim = tuple(shape)
    t = decode(data, CodecContext())
    expected = (tokens, layers * two * heads * dim)
    if tuple(t.shape) != expected or t.dtype != dtype:
        raise ValueError(f"stored block is {tuple(t.shape)} {t.dtype}, expected {expected} {dtype}")
    return t.view(tokens, layers, two, heads, dim).permute(1, 2, 0, 3, 4).contiguous()
