"""The codec bench codes the bytes the quantised pools store: its fp8 and int8 codes equal the pools' own."""

from __future__ import annotations

import torch

from hafiza.bench.codec.quantize import BLOCK_TOKENS, to_fp8, to_int8
from hafiza.cache.formats.fp8 import Fp8KV
from hafiza.cache.formats.int8 import Int8KV
from hafiza.cache.layout import KVLayout


def _pool_codes(cls: type, kv_dtype: str, x: torch.Tensor) -> torch.Tensor:
    """Write x [layers, tokens, heads, dim] (a multiple of the block size) into a pool, one layer at a time, as
    a prefill does; return the K codes it holds, laid out like x."""
    layers, tokens, heads, dim = x.shape
    layout = KVLayout(layers, tokens // BLOCK_TOKENS, BLOCK_TOKENS, heads, dim, kv_dtype, torch.float32)
    pool = cls(layout, "cpu")
    slots = torch.arange(tokens)
    for layer in range(layers):
        pool.write(layer, slots, x[layer], x[layer])
    return torch.stack([pool.kq[layer].reshape(tokens, heads, dim) for layer in range(layers)])


def test_fp8_codes_are_the_fp8_pools() -> None:
    x = torch.randn(2, 3 * BLOCK_TOKENS, 2, 8) * torch.tensor([0.01, 30.0]).view(1, 1, 2, 1)
    assert torch.equal(to_fp8(x).view(torch.uint8), _pool_codes(Fp8KV, "fp8", x).view(torch.uint8))


def test_int8_codes_are_the_int8_pools() -> None:
    x = torch.randn(2, 2 * BLOCK_TOKENS, 2, 8) * 5
    assert torch.equal(to_int8(x), _pool_codes(Int8KV, "int8", x))


def test_fp8_pads_a_partial_last_block() -> None:
    x = torch.randn(1, BLOCK_TOKENS + 3, 1, 4)
    assert to_fp8(x).shape == x.shape
