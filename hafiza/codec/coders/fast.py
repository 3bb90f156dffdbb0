"""The `fast` coder: bf16 KV at memory-tier decode speed, with zstd's Huffman stage (huff0) as entropy coder.

Each bf16 value (sign s, exponent e, 7 mantissa bits m) is split into two planes:
- one Huffman-coded byte per value: `e` minus its (layer, channel)'s median exponent, offset into 7 bits, with
  a sign bit in the top bit. That bit is the sign itself, the sign XOR the previous token's sign of the same
  channel (K: RoPE keeps a channel's sign from token to token), or the sign XOR the chunk's majority sign of the
  channel, whichever is most skewed. Coding sign and exponent as one symbol lets the Huffman stage use the sign's
  skew; a raw sign bit would cost a full bit.
- the 7 mantissa bits, packed 8 values into 7 bytes and stored as they are (they are close to uniform).
An exponent 64 or more steps from its median (zeros, subnormals, inf/NaN: none in real KV) is an escape: its
full pattern is stored after the planes and patched in at decode.
Decoding is one zstd decompression and one compiled pass (`fast_kernel`) that rebuilds the bit patterns. Other
dtypes use the `planes` layout, whose model block (the median exponents) is the same.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from hafiza.codec.coders.base import BoundCoder, Coder
from hafiza.codec.coders.planes import PlanesCoder, _params
from hafiza.codec.formats import BitFormat
from hafiza.codec.layout import ChunkRef
from hafiza.codec.predictors.base import BoundPredictor

_HEAD = struct.Struct("<BII")  # sign mode, escape count, Huffman frame length
OFFSET = 64  # a symbol's 7 low bits are exponent - median + OFFSET: exponents within [-64, 63] of the median
SIGN_AS_IS, SIGN_CHANGE, SIGN_MAJORITY = 0, 1, 2  # what a symbol's top bit holds: the sign XOR nothing / the
# previous token's sign / the chunk's majority sign of the channel
_CARRIER_SHIFTS = np.arange(7, dtype=np.uint8)[:, None]


def pack_mantissas(m: np.ndarray) -> bytes:
    """7-bit values (uint8, flat) into 7 bytes per 8. With q = n // 8, byte i < 7q holds value i in its low 7
    bits and, in its top bit, bit i // q of value 7q + i % q; the n % 8 last values follow as whole bytes."""
    q = m.size // 8
    tail = m[7 * q : 8 * q]
    carried = ((tail[None, :] >> _CARRIER_SHIFTS) & 1) << 7
    return (m[: 7 * q] | carried.reshape(-1)).tobytes() + m[8 * q :].tobytes()


def packed_size(n: int) -> int:
    """Bytes pack_mantissas writes for n values."""
    return 7 * (n // 8) + n % 8


def _flag_bits(flags: np.ndarray) -> float:
    """Bits an order-0 coder needs for a 0/1 array: its size times the binary entropy of its mean."""
    p = float(flags.mean()) if flags.size else 0.0
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -flags.size * (p * np.log2(p) + (1 - p) * np.log2(1 - p))


def _kernel() -> Callable[..., None]:
    """The compiled decode pass (imports numba the first time)."""
    from hafiza.codec.coders.fast_kernel import join_bf16

    return join_bf16


def warm_up() -> None:
    """Load (or, on a fresh installation, compile) the decode kernel now, so that the first decode of a
    serving process does not wait for it: a tiny container through the same path real decodes take."""
    from hafiza.codec import CodecContext, decode, encode

    decode(encode(torch.zeros(1, 8, 8, dtype=torch.bfloat16), CodecContext(coder="fast")))


@dataclass
class _Chunk:
    """One payload's header and where its parts end."""

    mode: int
    escapes: int
    tokens: int
    n: int
    frame_end: int
    mant_end: int
    row_end: int


class _Fast(BoundCoder):
    def __init__(self, channels: int, medians: np.ndarray) -> None:
        self.channels = channels
        self.medians = medians.astype(np.int16)
        self.cctx = zstandard.ZstdCompressor(compression_params=_params())
        self.dctx = zstandard.ZstdDecompressor()
        self._no_majority = np.zeros(channels, np.uint8)

    def encode(self, bits: np.ndarray, ref: ChunkRef) -> bytes:
        """Sign mode, escape count, Huffman frame length; frame, packed mantissas, majority row, escapes."""
        b = bits.astype(np.uint16, copy=False)
        sign = (b >> 15).astype(np.uint8)
        d = ((b >> 7) & 0xFF).astype(np.int16) - self.medians[ref.group]
        escape = (d < -OFFSET) | (d >= OFFSET)
        d += OFFSET
        d[escape] = OFFSET
        changes = sign.copy()
        changes[1:] ^= sign[:-1]
        majority = (2 * sign.sum(axis=0, dtype=np.int64) > sign.shape[0]).astype(np.uint8)
        against = sign ^ majority
        costs = [_flag_bits(sign), _flag_bits(changes), _flag_bits(against) + sign.shape[1]]
        mode = (SIGN_AS_IS, SIGN_CHANGE, SIGN_MAJORITY)[int(np.argmin(costs))]
        flag = (sign, changes, against)[mode]
        symbols = d.astype(np.uint8) | (flag << 7)
        frame = self.cctx.compress(symbols.tobytes())
        where = np.flatnonzero(escape).astype("<u4")
        row = np.packbits(majority, bitorder="little").tobytes() if mode == SIGN_MAJORITY else b""
        return b"".join([_HEAD.pack(mode, where.size, len(frame)), frame,
                         pack_mantissas((b & 0x7F).astype(np.uint8).reshape(-1)), row, where.tobytes(),
                         b.reshape(-1)[where].astype("<u2").tobytes()])

    def decode(self, payload: memoryview, ref: ChunkRef) -> np.ndarray:
        out = np.empty((ref.stop - ref.start, self.channels), np.uint16)
        self.decode_into(payload, ref, out)
        return out

    def decode_into(self, payload: memoryview, ref: ChunkRef, out: np.ndarray) -> None:
        """One zstd decompression, one compiled pass into `out`, then the escapes patched in."""
        c = self._parse(payload, ref)
        raw = self.dctx.decompress(payload[_HEAD.size : c.frame_end], max_output_size=c.n)
        if len(raw) != c.n:
            raise ValueError(f"the symbol plane decompressed to {len(raw)} bytes, expected {c.n}")
        majority = self._no_majority
        if c.mode == SIGN_MAJORITY:
            majority = np.unpackbits(np.frombuffer(payload[c.mant_end : c.row_end], np.uint8),
                                     count=self.channels, bitorder="little")
        out16 = out.reshape(c.tokens, self.channels)
        _kernel()(np.frombuffer(raw, np.uint8), np.frombuffer(payload[c.frame_end : c.mant_end], np.uint8),
                  self.medians[ref.group], c.mode, majority, out16)
        if c.escapes:
            where = np.frombuffer(payload[c.row_end : c.row_end + 4 * c.escapes], "<u4")
            if int(where.max()) >= c.n:
                raise ValueError(f"an escape points at value {int(where.max())} of {c.n}")
            out16.reshape(-1)[where] = np.frombuffer(payload[c.row_end + 4 * c.escapes :], "<u2")

    def _parse(self, payload: memoryview, ref: ChunkRef) -> _Chunk:
        """A payload's header, checked against its length."""
        tokens = ref.stop - ref.start
        n = tokens * self.channels
        if len(payload) < _HEAD.size:
            raise ValueError("fast payload is shorter than its header")
        mode, escapes, frame_len = _HEAD.unpack_from(payload, 0)
        frame_end = _HEAD.size + frame_len
        mant_end = frame_end + packed_size(n)
        row_end = mant_end + (-(-self.channels // 8) if mode == SIGN_MAJORITY else 0)
        if mode > SIGN_MAJORITY or row_end + 6 * escapes != len(payload):
            raise ValueError("fast payload header does not match its length")
        return _Chunk(mode, escapes, tokens, n, frame_end, mant_end, row_end)


class FastCoder(Coder):
    """bf16: sign + exponent (minus the channel median) as one Huffman symbol, packed raw mantissas."""

    name, id = "fast", 5

    def fit(self, bits: np.ndarray, fmt: BitFormat, predictor: BoundPredictor | None,
            refs: list[ChunkRef]) -> bytes:
        """The per-(group, channel) median exponents, as the planes coder stores them."""
        return PlanesCoder().fit(bits, fmt, predictor, refs)

    def bind(self, model: bytes | memoryview, fmt: BitFormat, vshape: tuple[int, int, int],
             predictor: BoundPredictor | None) -> BoundCoder:
        planes = PlanesCoder().bind(model, fmt, vshape, predictor)
        if fmt.name != "bf16" or planes.medians is None:
            return planes
        return _Fast(vshape[2], planes.medians)
