"""Which lossless codec KV blocks are stored with (the store codec setting), through `hafiza.codec`'s public API.

The connector stores a pool's native form (store/native.py): a full-precision block goes through exactly the
layout below, a quantised block's codes take the same layout and its scales go beside them.
A stored block is one pool block [layers, 2, block_size, kv_heads, head_dim], handed to the codec as
[block_size, layers * 2 * kv_heads * head_dim]: one chunk of `block_size` tokens whose channels are every
(layer, K or V, head, dim). One chunk per block keeps the codec's per-chunk overhead low: against one group per
(layer, K or V), zstd decodes 1.5x faster and stores 6 % less, exponent decodes 3.6x faster. The codec name is
part of every block key, so instances using different codecs never read each other's entries; decoding needs
no option (the container names its coder), except `speculative`, which needs the block's prefix tokens and the
model's predictor (`hafiza.store.speculative.BlockPredictor`) again: the predictive coder's residuals against a
cheaper rerun of the target. Each tier has its own codec (e.g. zstd in RAM, speculative in Redis).

Default: `fast` (bf16 KV: 10.58 bits/value against zstd's 11.82 on real store blocks, decoding ~4.9x faster;
see docs/CODEC.md): smaller and faster than zstd, so it pays in every tier. exponent stores less but decodes
far slower, predictive is both larger and slower. Other KV dtypes fall back to the planes layout inside `fast`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from hafiza.codec import CodecContext, decode, encode
from hafiza.codec.errors import ContextError
from hafiza.errors import ConfigError
from hafiza.store.speculative import BlockPredictor

STORE_CODECS: tuple[str, ...] = ("raw", "zstd", "fast", "planes", "exponent", "predictive", "speculative")
TOKEN_CODECS: frozenset[str] = frozenset({"speculative"})  # codecs that rerun a predictor on the prefix tokens
DEFAULT_STORE_CODEC = "fast"


class StoreCodecError(ConfigError):
    """An unknown store codec name (setting "store_codec")."""


def check_codec(name: str) -> str:
    """The codec name if the store knows it; a clear error listing the choices otherwise."""
    if name not in STORE_CODECS:
        raise StoreCodecError(f"unknown codec {name!r}: choose one of {', '.join(STORE_CODECS)}",
                              setting="store_codec")
    return name


def _context(codec: str, token_ids: Sequence[int] | None, predictor: BlockPredictor | None) -> CodecContext:
    if codec not in TOKEN_CODECS:
        return CodecContext(coder=codec)
    if predictor is None or not token_ids:
        raise ContextError(f"the {codec} store codec needs the block's prefix tokens and the model's predictor")
    return CodecContext(coder="predictive", predictor=predictor, token_ids=list(token_ids))


def encode_block(block: torch.Tensor, codec: str, token_ids: Sequence[int] | None = None,
                 predictor: BlockPredictor | None = None) -> bytes:
    """One block [layers, 2, block_size, heads, dim] to the codec's framed container (tokens first).
    `token_ids` (the prefix up to the block's end) and `predictor` are needed by the speculative codec only."""
    tokens = block.shape[2]
    flat = block.permute(2, 0, 1, 3, 4).reshape(tokens, -1).contiguous()
    return encode(flat, _context(codec, token_ids, predictor))


def decode_block(data: bytes, shape: Iterable[int], dtype: torch.dtype, token_ids: Sequence[int] | None = None,
                 predictor: BlockPredictor | None = None) -> torch.Tensor:
    """The block `encode_block` was given; raises CodecError (bad checksum, damaged container,
    PredictionMismatchError when the predictor's rerun differs from the encoder's) or ValueError (a well-formed
    container of another shape or dtype)."""
    layers, two, tokens, heads, dim = tuple(shape)
    ctx = CodecContext(predictor=predictor, token_ids=list(token_ids)) if predictor is not None and token_ids \
        else CodecContext()
    t = decode(data, ctx)
    expected = (tokens, layers * two * heads * dim)
    if tuple(t.shape) != expected or t.dtype != dtype:
        raise ValueError(f"stored block is {tuple(t.shape)} {t.dtype}, expected {expected} {dtype}")
    return t.view(tokens, layers, two, heads, dim).permute(1, 2, 0, 3, 4).contiguous()
