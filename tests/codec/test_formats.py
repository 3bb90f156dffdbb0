"""Bit formats: the ordered-integer map sorts like the values and inverts exactly; bit packing inverts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hafiza.codec.bitpack import pack, packed_size, unpack
from hafiza.codec.errors import UnsupportedDtypeError
from hafiza.codec.formats import FORMATS, bits_tensor, format_of, tensor_bits


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp8_e4m3", "int8"])
def test_ordered_map_is_monotone_and_invertible(name: str) -> None:
    fmt = FORMATS[name]
    bits = np.arange(1 << fmt.width, dtype=np.uint32).astype(fmt.uint)
    ordered = fmt.to_ordered(bits)
    assert np.array_equal(fmt.from_ordered(ordered), bits)
    assert np.unique(ordered).size == bits.size
    values = bits_tensor(bits, fmt).double().numpy()
    finite = np.isfinite(values)
    order = np.argsort(ordered[finite], kind="stable")
    assert np.all(np.diff(values[finite][order]) >= 0)


@pytest.mark.parametrize("name", list(FORMATS))
def test_split_join_inverts(name: str) -> None:
    fmt = FORMATS[name]
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 1 << fmt.width, 5000, dtype=np.uint64).astype(fmt.uint)
    assert np.array_equal(fmt.join(*fmt.split(bits)), bits)


def test_tensor_bits_roundtrip_and_unsupported_dtype() -> None:
    x = torch.randn(7, 3).to(torch.bfloat16)
    assert torch.equal(bits_tensor(tensor_bits(x), FORMATS["bf16"]).view(torch.int16), x.view(torch.int16))
    with pytest.raises(UnsupportedDtypeError):
        format_of(torch.float64)


@pytest.mark.parametrize("width", [0, 1, 3, 7, 8, 10, 16, 23, 32])
@pytest.mark.parametrize("count", [0, 1, 8, 13, 1000])
def test_bitpack_roundtrip(width: int, count: int) -> None:
    rng = np.random.default_rng(width * 1000 + count)
    values = rng.integers(0, 1 << width, count, dtype=np.uint64).astype(np.uint32) if width else np.zeros(count)
    data = pack(values, width)
    assert len(data) == packed_size(count, width)
    assert np.array_equal(unpack(data, count, width), values.astype(np.uint32))
