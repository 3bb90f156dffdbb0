"""Fuzzing the container: truncated, bit-flipped, wrong-version and foreign input raise a codec error,
and decode never returns data other than what was encoded."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import zstandard

from hafiza.codec import (
    ChecksumError,
    CodecContext,
    CodecError,
    FormatError,
    VersionError,
    decode,
    encode,
)
from tests.codec.helpers import CODER_CASES, same_bits


@pytest.fixture(scope="module")
def sample() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return (torch.randn(3, 40, 2, 8, generator=g) * torch.logspace(-3, 1, 16).reshape(2, 8)).to(torch.bfloat16)


def _decodes_exactly_or_raises(data: bytes, ctx: CodecContext, original: torch.Tensor) -> None:
    try:
        out = decode(data, ctx)
    except CodecError:
        return
    assert same_bits(out, original)


@pytest.mark.parametrize(("coder", "predictor"), CODER_CASES)
def test_truncation_at_every_length_raises(sample: torch.Tensor, coder: str, predictor: str | None) -> None:
    ctx = CodecContext(coder=coder, predictor=predictor, chunk_tokens=16)
    data = encode(sample, ctx)
    for n in range(len(data)):
        with pytest.raises(FormatError):
            decode(data[:n], ctx)
    with pytest.raises(FormatError):
        decode(data + b"\0", ctx)


@pytest.mark.parametrize(("coder", "predictor"), CODER_CASES)
def test_bit_flips_never_return_wrong_data(sample: torch.Tensor, coder: str, predictor: str | None) -> None:
    ctx = CodecContext(coder=coder, predictor=predictor, chunk_tokens=16)
    data = encode(sample, ctx)
    rng = np.random.default_rng(11)
    positions = np.unique(np.concatenate([np.arange(min(len(data), 400)), rng.integers(0, len(data), 400)]))
    for pos in positions:
        flipped = bytearray(data)
        flipped[pos] ^= 1 << int(rng.integers(0, 8))
        _decodes_exactly_or_raises(bytes(flipped), ctx, sample)


def test_payload_corruption_is_a_checksum_error(sample: torch.Tensor) -> None:
    ctx = CodecContext(coder="raw", chunk_tokens=16)
    data = bytearray(encode(sample, ctx))
    data[-1] ^= 0x40
    with pytest.raises(ChecksumError):
        decode(bytes(data), ctx)


def test_wrong_version_and_foreign_input(sample: torch.Tensor) -> None:
    data = bytearray(encode(sample))
    struct.pack_into("<H", data, 4, 99)
    with pytest.raises(VersionError):
        decode(bytes(data))
    foreign = [b"", b"HKV", b"PK\x03\x04" + bytes(60), np.random.default_rng(0).bytes(5000),
               zstandard.ZstdCompressor().compress(bytes(1000)), sample.view(torch.int16).numpy().tobytes()]
    for blob in foreign:
        with pytest.raises(FormatError):
            decode(blob)


def test_unknown_coder_name_is_a_codec_error(sample: torch.Tensor) -> None:
    with pytest.raises(CodecError):
        encode(sample, CodecContext(coder="lzma"))
    with pytest.raises(CodecError):
        encode(sample, CodecContext(coder="predictive", predictor="oracle"))
