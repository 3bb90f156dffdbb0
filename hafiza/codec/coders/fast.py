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
Decoding is one zstd decompression and one compiled call (`fast_kernel`) that rebuilds the bit patterns. Other
dtypes use the `planes` layout, whose model block (the median exponents) is the same.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable

import numpy as np
import torch
import zstandard

from hafiza.codec.coders.base import BoundCoder, Coder
from hafiza.codec.coders.fast_modes import SIGN_AS_IS, SIGN_CHANGE, SIGN_MAJORITY
from hafiza.codec.coders.planes import PlanesCoder, _params, read_medians
from hafiza.codec.formats import BitFormat
from hafiza.codec.layout import ChunkRef
from hafiza.codec.predictors.base import BoundPredictor

_HEAD = struct.Struct("<BII")  # sign mode, escape count, Huffman frame length
OFFSET = 64  # a symbol's 7 low bits are exponent - median + OFFSET: exponents within [-64, 63] of the median
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


def _kernel() -> Callable[..., int]:
    """The compiled decode kernel (imports numba the first time)."""
    from hafiza.codec.coders.fast_kernel import decode_chunk

    return decode_chunk


def warm_up() -> None:
    """Load (or, on a fresh installation, compile) the decode kernel now, so that the first decode of a
    serving process does not wait for it: a tiny container through the same path real decodes take."""
    from hafiza.codec import CodecContext, decode, encode

    decode(encode(torch.zeros(1, 8, 8, dtype=torch.bfloat16), CodecContext(coder="fast")))


_local = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompression context, made once: one per container costs more than a small
    container's whole decode (a ZstdDecompressor is not safe to share between threads)."""
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


class _Fast(BoundCoder):
    def __init__(self, channels: int, medians: np.ndarray) -> None:
        self.channels = channels
        self.medians = medians.astype(np.int16)
        self.base = ((medians - np.uint8(OFFSET)) & 0xFF).astype(np.uint16)  # what the kernel adds to a symbol
        self.row_bytes = -(-channels // 8)
        self.dctx = _decompressor()
        self.kernel = _kernel()
        self._cctx: zstandard.ZstdCompressor | None = None

    @property
    def cctx(self) -> zstandard.ZstdCompressor:
        """The symbol plane's compressor, made on the first encode (decoding needs none)."""
        if self._cctx is None:
            self._cctx = zstandard.ZstdCompressor(compression_params=_params())
        return self._cctx

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
        """The header checked against the payload's length, one zstd decompression, one kernel call into
        `out`. Kept to a few Python operations: per chunk they cost as much as a tenth of the decode."""
        n = out.size
        if len(payload) < _HEAD.size:
            raise ValueError(f"fast payload of {len(payload)} bytes is shorter than its {_HEAD.size}-byte header")
        mode, escapes, frame_len = _HEAD.unpack_from(payload, 0)
        frame_end = _HEAD.size + frame_len
        mant_end = frame_end + 7 * (n // 8) + n % 8
        row_end = mant_end + (self.row_bytes if mode == SIGN_MAJORITY else 0)
        if mode > SIGN_MAJORITY or row_end + 6 * escapes != len(payload):
            raise ValueError(f"fast payload header (sign mode {mode}, {escapes} escapes, {frame_len}-byte frame) "
                             f"does not match its {len(payload)} bytes for {n} values")
        raw = self.dctx.decompress(payload[_HEAD.size : frame_end], max_output_size=n)
        if len(raw) != n:
            raise ValueError(f"the symbol plane decompressed to {len(raw)} bytes, expected {n}")
        bad = self.kernel(np.frombuffer(raw, np.uint8), np.frombuffer(payload, np.uint8), frame_end, mant_end,
                          row_end, escapes, self.base[ref.group], mode, out)
        if bad >= 0:
            raise ValueError(f"an escape points at value {bad} of {n}")


class FastCoder(Coder):
    """bf16: sign + exponent (minus the channel median) as one Huffman symbol, packed raw mantissas."""

    name, id = "fast", 5

    def fit(self, bits: np.ndarray, fmt: BitFormat, predictor: BoundPredictor | None,
            refs: list[ChunkRef]) -> bytes:
        """The per-(group, channel) median exponents, as the planes coder stores them."""
        return PlanesCoder().fit(bits, fmt, predictor, refs)

    def bind(self, model: bytes | memoryview, fmt: BitFormat, vshape: tuple[int, int, int],
             predictor: BoundPredictor | None) -> BoundCoder:
        if fmt.name != "bf16" or not vshape[0] * vshape[1] * vshape[2]:
            return PlanesCoder().bind(model, fmt, vshape, predictor)
        medians = read_medians(model, fmt, vshape, _decompressor())
        assert medians is not None
        return _Fast(vshape[2], medians)
