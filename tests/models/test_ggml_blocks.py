"""Unpacked GGUF blocks (integers + scale + zero) give exactly gguf's own dequantized values, for every type."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from hafiza.models.ggml_blocks import SUPPORTED, unpack_rows
from tests.support.gguf_models import random_blocks

TYPES = sorted(SUPPORTED, key=lambda t: t.name)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_blocks_match_gguf_dequantize(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(48, 512, qtype, rng)
    got = unpack_rows(raw, qtype, 512)
    expect = dequantize(raw, qtype).reshape(48, 512)
    assert got.q.shape == (48, 512) and got.q.max() < (1 << got.bits)
    assert np.array_equal(got.dequantize(), expect)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0], ids=lambda t: t.name)
def test_quantized_real_values_match(qtype: T) -> None:
    """Blocks gguf quantized itself from normal values (not random bytes) unpack to the same numbers."""
    w = np.random.default_rng(1).standard_normal((32, 256)).astype(np.float32)
    raw = quantize(w, qtype)
    assert np.array_equal(unpack_rows(raw, qtype, 256).dequantize(), dequantize(raw, qtype).reshape(32, 256))


def test_row_ranges_unpack_alone() -> None:
    """Unpacking any row range gives the rows of the whole tensor (the loader reads tensors in row chunks)."""
    raw = random_blocks(40, 256, T.Q4_K, np.random.default_rng(2))
    whole = unpack_rows(raw, T.Q4_K, 256).dequantize()
    assert np.array_equal(unpack_rows(raw[7:29], T.Q4_K, 256).dequantize(), whole[7:29])
