"""The bytes a quantised KV pool stores, to code losslessly in the benchmark: the reference quantizers of
`hafiza.cache.codes` at the pools' granularity, on captured KV x [layers, tokens, heads, dim]."""

from __future__ import annotations

import torch

from hafiza.cache.codes import fp8_encode, int8_quantize, pow2_scale

FP8_HEADROOM = 2.0  # the fp8 pool's default: a block's scale covers twice its first write's amax
BLOCK_TOKENS = 16  # the engine's default block size: the fp8 pool keeps one scale per block and head


def to_fp8(x: torch.Tensor, block_tokens: int = BLOCK_TOKENS) -> torch.Tensor:
    """e4m3 codes with one power-of-two scale per (layer, block of `block_tokens` tokens, head), as the fp8
    pool writes a prefilled block (scale from the block's amax over its tokens and dims)."""
    layers, tokens, heads, dim = x.shape
    pad = -tokens % block_tokens
    xf = torch.nn.functional.pad(x.float(), (0, 0, 0, 0, 0, pad))
    blocks = xf.view(layers, -1, block_tokens, heads, dim)
    scale = pow2_scale(blocks.abs().amax(dim=(2, 4)), FP8_HEADROOM)
    codes = fp8_encode(blocks, scale[:, :, None, :, None])
    return codes.view(layers, -1, heads, dim)[:, :tokens].contiguous()


def to_int8(x: torch.Tensor) -> torch.Tensor:
    """int8 codes with one scale per (layer, token, head) over the head's dims, as the int8 pool stores them."""
    return int8_quantize(x)[0]
