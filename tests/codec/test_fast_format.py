"""The fast coder's byte layout (coder id 5) stays readable: a container written by an earlier build decodes
to the same bits, and damaged or mislabelled ones fail with a CodecError, never with wrong output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hafiza.codec import CodecError, decode
from hafiza.codec.coders.fast import _HEAD
from hafiza.codec.container import read
from tests.codec.helpers import same_bits

GOLDEN = Path(__file__).parent / "data" / "fast_coder5.bin"
CHUNK = 100


def golden_tensor() -> torch.Tensor:
    """[2, 300, 13] bf16: group 0's three chunks need each sign mode (mostly positive, long runs, a noisy fixed sign per
    channel),
    group 1 holds zeros, infinities, NaN and tiny values (escapes); 100 x 13 values leave a mantissa tail."""
    rng = np.random.default_rng(5)
    mag = rng.uniform(0.5, 4.0, (2, 300, 13))
    signs = np.zeros((2, 300, 13))
    signs[0, :100] = rng.random((100, 13)) < 0.1
    signs[0, 100:200] = np.cumsum(rng.random((100, 13)) < 0.02, axis=0) % 2
    signs[0, 200:] = np.abs(rng.integers(0, 2, (1, 13)) - (rng.random((100, 13)) < 0.1))
    signs[1] = rng.integers(0, 2, (300, 13))
    x = torch.from_numpy(mag * (1.0 - 2.0 * signs)).bfloat16()
    specials = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-30, 1e30, 1e-38]
    x[1, 7, : len(specials)] = torch.tensor(specials).bfloat16()
    return x


def test_a_container_of_an_earlier_build_decodes_to_the_same_bits() -> None:
    data = GOLDEN.read_bytes()
    payloads = read(data)[2]
    assert sorted({p[0] for p in payloads}) == [0, 1, 2]  # every sign mode is in the file
    assert sum(_HEAD.unpack_from(p, 0)[1] for p in payloads) == 8  # and the specials' escapes
    assert same_bits(decode(data), golden_tensor())


@pytest.mark.parametrize("where", ["header", "frame", "mantissas", "last"])
def test_a_damaged_golden_container_fails_with_a_codec_error(where: str) -> None:
    data = bytearray(GOLDEN.read_bytes())
    payload = read(bytes(data))[2][0]
    start = len(data) - sum(len(p) for p in read(bytes(data))[2])
    at = {"header": start + 2, "frame": start + 12, "mantissas": start + len(payload) - 3,
          "last": len(data) - 1}[where]
    data[at] ^= 0x10
    with pytest.raises(CodecError):
        decode(bytes(data))
