"""Every bf16, fp16, fp8 and int8 bit pattern (NaN payloads, +-0, +-inf, subnormals) through every coder."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hafiza.codec.formats import FORMATS, bits_tensor
from tests.codec.helpers import CODER_CASES, roundtrip, same_bits


def _all_patterns(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    fmt = FORMATS[name]
    bits = np.random.default_rng(0).permutation(1 << fmt.width).astype(fmt.uint)
    return bits_tensor(bits.reshape(shape), fmt)


@pytest.mark.parametrize(("coder", "predictor"), CODER_CASES)
@pytest.mark.parametrize(("name", "shape"), [
    ("bf16", (4, 256, 2, 32)), ("fp16", (2, 512, 64)), ("fp8_e4m3", (256,)), ("int8", (16, 16)),
])
def test_every_pattern_roundtrips(coder: str, predictor: str | None, name: str, shape: tuple[int, ...]) -> None:
    x = _all_patterns(name, shape)
    assert same_bits(roundtrip(x, coder, predictor), x)


@pytest.mark.parametrize(("coder", "predictor"), CODER_CASES)
def test_sorted_patterns_and_special_fp32_values(coder: str, predictor: str | None) -> None:
    sorted_bf16 = bits_tensor(np.arange(1 << 16, dtype=np.uint16).reshape(256, 256), FORMATS["bf16"])
    assert same_bits(roundtrip(sorted_bf16, coder, predictor), sorted_bf16)
    rng = np.random.default_rng(3)
    specials = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFFFFFFFF, 1, 0x807FFFFF],
                        np.uint32)
    bits = np.concatenate([specials, rng.integers(0, 1 << 32, 4000, dtype=np.uint64).astype(np.uint32)])
    x = bits_tensor(bits.reshape(2, -1, 4), FORMATS["fp32"])
    assert same_bits(roundtrip(x, coder, predictor, chunk_tokens=100), x)
