"""The fast coder's own cases: each sign mode, escapes (exponents far from the channel median), mantissa
packing of every length, odd shapes, and a damaged payload."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from hafiza.codec import ChecksumError, CodecContext, decode, encode
from hafiza.codec.coders.fast import _HEAD, SIGN_AS_IS, SIGN_CHANGE, SIGN_MAJORITY, pack_mantissas, packed_size, warm_up
from hafiza.codec.coders.fast_kernel import decode_chunk
from hafiza.codec.container import read
from hafiza.codec.formats import FORMATS, bits_tensor, tensor_bits
from tests.codec.helpers import same_bits

CTX = CodecContext(coder="fast")


def _modes(data: bytes) -> list[int]:
    return [payload[0] for payload in read(data)[2]]


def _escapes(data: bytes) -> int:
    return sum(_HEAD.unpack_from(payload, 0)[1] for payload in read(data)[2])


def _values(signs: np.ndarray, seed: int = 0) -> torch.Tensor:
    """bf16 values of magnitude ~1 with the given signs (0/1) [groups, tokens, channels]."""
    mag = torch.from_numpy(np.random.default_rng(seed).uniform(0.5, 4.0, signs.shape)).float()
    return (mag * torch.from_numpy(1.0 - 2.0 * signs)).bfloat16()


def test_each_sign_mode_is_chosen_where_it_pays_and_roundtrips() -> None:
    rng = np.random.default_rng(1)
    shape = (2, 512, 64)
    random = rng.integers(0, 2, shape).astype(np.float64)
    persistent = np.repeat(rng.integers(0, 2, (2, 1, 64)), 512, axis=1).astype(np.float64)
    runs = np.cumsum(rng.random(shape) < 0.01, axis=1) % 2  # long runs: changes are rare
    noisy = np.abs(persistent - (rng.random(shape) < 0.1))  # a fixed sign, flipped on 10 % of tokens
    for signs, mode in ((random, SIGN_AS_IS), (runs, SIGN_CHANGE), (noisy, SIGN_MAJORITY)):
        x = _values(signs)
        data = encode(x, CTX)
        assert set(_modes(data)) == {mode}
        assert same_bits(decode(data), x)


def test_exponents_far_from_the_median_are_escapes() -> None:
    x = _values(np.zeros((1, 256, 32)))
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-30, 1e30, 2.0**-130])
    x[0, 7, : specials.numel()] = specials.bfloat16()
    x[0, 100, 3] = torch.tensor(1e-38).bfloat16()  # a subnormal-range exponent
    data = encode(x, CTX)
    assert _escapes(data) == specials.numel() + 1
    assert same_bits(decode(data), x)


def test_channels_of_tiny_values_roundtrip() -> None:
    """Medians below the symbol offset (values near 2^-120) take the same path as ordinary ones."""
    x = (_values(np.zeros((3, 40, 12))).float() * 2.0**-120).bfloat16()
    assert same_bits(decode(encode(x, CTX)), x)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 1000, 4096])
def test_mantissa_packing_roundtrips_through_the_kernel(n: int) -> None:
    """Every length: 7 bytes per 8 values plus the remainder, rebuilt by the decode kernel."""
    rng = np.random.default_rng(n)
    m = rng.integers(0, 128, n).astype(np.uint8)
    packed = pack_mantissas(m)
    assert len(packed) == packed_size(n)
    base = np.full(1, 127 - 64, np.uint16)  # median exponent 127
    out = np.empty((n, 1), np.uint16)
    symbols = np.frombuffer(bytes([64]) * n, np.uint8)  # exponent = median, sign 0; read-only like a decode's
    payload = np.frombuffer(bytes(3) + packed, np.uint8)
    decode_chunk(symbols, payload, 3, 3 + len(packed), 3 + len(packed), 0, base, SIGN_AS_IS, out)
    assert np.array_equal(out[:, 0], (127 << 7) | m.astype(np.uint16))


@pytest.mark.parametrize("shape", [(1,), (3, 5), (2, 7, 3), (5, 3, 1, 3)])
@pytest.mark.parametrize("chunk_tokens", [1, 2, 256])
def test_odd_shapes_roundtrip(shape: tuple[int, ...], chunk_tokens: int) -> None:
    bits = np.random.default_rng(sum(shape)).integers(0, 1 << 16, shape, dtype=np.uint64).astype(np.uint16)
    x = bits_tensor(bits, FORMATS["bf16"])
    ctx = CodecContext(coder="fast", chunk_tokens=chunk_tokens)
    assert same_bits(decode(encode(x, ctx)), x)


def test_a_damaged_mantissa_byte_fails_the_checksum() -> None:
    x = _values(np.zeros((1, 64, 16)))
    data = bytearray(encode(x, CTX))
    data[-5] ^= 0x01  # in the packed mantissas (no escapes, no majority row)
    with pytest.raises(ChecksumError):
        decode(bytes(data))


def test_an_escape_pointing_past_the_chunk_is_refused() -> None:
    x = _values(np.zeros((1, 64, 16)))
    x[0, 3, 5] = 0.0  # the one escape
    data = bytearray(encode(x, CTX))
    data[-6:-2] = (64 * 16).to_bytes(4, "little")  # its position (the payload ends with position, pattern)
    with pytest.raises(ChecksumError, match="escape points at value 1024 of 1024"):
        decode(bytes(data))


def test_threads_decoding_at_once_each_get_the_exact_tensor() -> None:
    """Each thread has its own zstd decompressor (one is not safe to share)."""
    xs = [_values(np.random.default_rng(s).integers(0, 2, (2, 300, 24)).astype(np.float64), s) for s in range(4)]
    blobs = [encode(x, CTX) for x in xs]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda i: [decode(blobs[i]) for _ in range(20)], range(4)))
    assert all(same_bits(y, xs[i]) for i, ys in enumerate(outs) for y in ys)


def test_warm_up_loads_the_kernel() -> None:
    warm_up()
    assert decode_chunk.signatures  # compiled (or loaded from the cache) for the decode path's argument types


def test_other_dtypes_use_the_planes_layout() -> None:
    x = torch.randn(2, 64, 8)
    for t in (x, x.half(), x.clamp(-400, 400).to(torch.float8_e4m3fn)):
        assert np.array_equal(tensor_bits(decode(encode(t, CTX))), tensor_bits(t))
