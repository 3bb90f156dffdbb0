"""The `planes` coder: fast lossless coding for the hot tiers, with zstd as the entropy stage.

Each float value is split into three fields, and each field goes where an order-0 coder can use it:
- the exponent field, minus its (layer, channel)'s median exponent (mod 2^bits): one byte plane whose few
  common symbols zstd's Huffman stage codes in ~2.5 bits;
- the mantissa shifted left one bit, with the sign XOR the previous token's sign of the same channel in the
  freed bit (K's signs persist from token to token; V's do not, and then that bit costs nothing extra):
  byte planes that are nearly uniform, which zstd stores raw or Huffman-codes where it pays.
Each plane is one zstd frame per chunk; the exponent plane's parameters keep zstd to (almost) only its
Huffman stage, since matches cost more than they save on these planes.
The model block holds the medians (zstd-compressed). Integer formats have no exponent: their byte planes
go through the same zstd stage. Decoding is two zstd decompressions and a few vectorised integer ops.
"""

from __future__ import annotations

import struct

import numpy as np
import zstandard

from hafiza.codec.coders.base import BoundCoder, Coder
from hafiza.codec.formats import BitFormat
from hafiza.codec.layout import ChunkRef
from hafiza.codec.predictors.base import BoundPredictor

_SIZE = struct.Struct("<I")


def _params() -> zstandard.ZstdCompressionParameters:
    """zstd's fast strategy with a 64-entry hash table and 7-byte minimum matches: almost only Huffman-coded
    literals in 128 KiB blocks. zstd's own fast levels spend bits on short matches in an exponent plane;
    level 19 is about as small but encodes far slower (see docs/CODEC.md)."""
    return zstandard.ZstdCompressionParameters(
        strategy=zstandard.STRATEGY_FAST, window_log=17, hash_log=6, min_match=7, target_length=0
    )


def _rest_bytes(fmt: BitFormat) -> int:
    """Bytes per value of the plane(s) below the exponent: mantissa + one sign bit (ints: the whole value)."""
    bits = fmt.mantissa + 1 if fmt.exponent else fmt.width
    return -(-bits // 8)


def _medians(exponents: np.ndarray) -> np.ndarray:
    """Median exponent of each (group, channel) over its tokens, as uint8 [groups, channels]."""
    return np.median(exponents, axis=1).astype(np.uint8)


def _prefix_xor(flips: np.ndarray) -> np.ndarray:
    """Running XOR down the token axis (row t = rows 0..t XORed), in place: log2(T) vectorised steps over 8
    channels per uint64 word, since numpy's accumulate along axis 0 goes one row at a time."""
    tokens, channels = flips.shape
    work = flips
    if channels % 8:
        work = np.zeros((tokens, channels + (-channels % 8)), np.uint8)
        work[:, :channels] = flips
    words = work.view(np.uint64)
    step = 1
    while step < tokens:
        words[step:] ^= words[:-step]  # numpy buffers overlapping operands, so this reads the old rows
        step *= 2
    return work[:, :channels]


class _Planes(BoundCoder):
    def __init__(self, fmt: BitFormat, vshape: tuple[int, int, int], medians: np.ndarray | None) -> None:
        self.fmt, self.channels = fmt, vshape[2]
        self.medians = medians
        self.rest_bytes = _rest_bytes(fmt)
        self.rest_dtype = np.dtype({1: np.uint8, 2: "<u2", 3: "<u4", 4: "<u4"}[self.rest_bytes])
        self.cctx = zstandard.ZstdCompressor(compression_params=_params())  # the exponent plane
        self.cctx_rest = zstandard.ZstdCompressor(level=1)  # near-uniform planes: few matches to parse
        self.dctx = zstandard.ZstdDecompressor()

    def _planes_of(self, rest: np.ndarray) -> list[bytes]:
        """Little-endian byte planes of `rest` (low byte first), `rest_bytes` of them."""
        if self.rest_bytes == 1:
            return [rest.astype(np.uint8, copy=False).tobytes()]
        b = rest.astype(self.rest_dtype).reshape(-1).view(np.uint8).reshape(-1, self.rest_dtype.itemsize)
        return [b[:, i].tobytes() for i in range(self.rest_bytes)]

    def encode(self, bits: np.ndarray, ref: ChunkRef) -> bytes:
        """Mode byte, plane sizes, planes. Mode 1 (sign changes in the low bit) only where it saves >= 1.5 %
        of the low planes (K); otherwise mode 0 keeps the sign itself there and decoding skips the scan."""
        fmt = self.fmt
        if not fmt.exponent:
            frames = [self.cctx_rest.compress(p) for p in self._planes_of(bits)]
            return self._pack(0, frames)
        assert self.medians is not None
        b = bits.astype(np.uint32)
        sign = (b >> (fmt.width - 1)).astype(np.uint8)
        exponent = ((b >> fmt.mantissa) & ((1 << fmt.exponent) - 1)).astype(np.uint8)
        exponent -= self.medians[ref.group]
        exponent &= (1 << fmt.exponent) - 1
        mantissa = (b & ((1 << fmt.mantissa) - 1)) << 1
        flips = sign.copy()
        flips[1:] ^= sign[:-1]
        changed = [self.cctx_rest.compress(p) for p in self._planes_of(mantissa | flips)]
        plain_size = sum(len(p) for p in self._planes_of(mantissa[:1]))  * bits.shape[0]
        if sum(len(f) for f in changed) < 0.985 * plain_size:
            mode, rest = 1, changed
        else:
            mode, rest = 0, [self._rest_frame(p) for p in self._planes_of(mantissa | sign)]
        return self._pack(mode, [self.cctx.compress(exponent.tobytes()), *rest])

    @staticmethod
    def _pack(mode: int, frames: list[bytes]) -> bytes:
        return bytes([mode]) + b"".join(_SIZE.pack(len(f)) for f in frames) + b"".join(frames)

    def _rest_frame(self, plane: bytes) -> bytes:
        """A zstd frame, or the plane itself (size = plane size: stored) when zstd saves under 1.5 %."""
        frame = self.cctx_rest.compress(plane)
        return frame if len(frame) < 0.985 * len(plane) else plane

    def _frames(self, payload: memoryview, count: int, plane_size: int) -> tuple[int, list[np.ndarray]]:
        """The mode byte and the `count` planes of a payload, each checked to hold `plane_size` bytes."""
        head = 1 + _SIZE.size * count
        sizes = [_SIZE.unpack_from(payload, 1 + _SIZE.size * i)[0] for i in range(count)]
        if head + sum(sizes) != len(payload) or payload[0] > 1:
            raise ValueError("planes payload header does not match its length")
        out, pos = [], head
        for i, size in enumerate(sizes):
            piece = payload[pos : pos + size]
            if i > 0 and size == plane_size:  # stored as it is
                out.append(np.frombuffer(piece, np.uint8))
            else:
                raw = self.dctx.decompress(piece, max_output_size=plane_size)
                if len(raw) != plane_size:
                    raise ValueError(f"a plane decompressed to {len(raw)} bytes, expected {plane_size}")
                out.append(np.frombuffer(raw, np.uint8))
            pos += size
        return payload[0], out

    def _rest(self, planes: list[np.ndarray], shape: tuple[int, int]) -> np.ndarray:
        if len(planes) == 1:
            return planes[0].reshape(shape)
        b = np.zeros((planes[0].size, self.rest_dtype.itemsize), np.uint8)
        for i, p in enumerate(planes):
            b[:, i] = p
        return b.view(self.rest_dtype).reshape(shape)

    def decode(self, payload: memoryview, ref: ChunkRef) -> np.ndarray:
        fmt = self.fmt
        shape = (ref.stop - ref.start, self.channels)
        n = shape[0] * shape[1]
        if not fmt.exponent:
            return self._rest(self._frames(payload, self.rest_bytes, n)[1], shape).astype(fmt.uint)
        assert self.medians is not None
        mode, planes = self._frames(payload, 1 + self.rest_bytes, n)
        work = np.uint16 if fmt.width <= 16 else np.uint32
        # r = exponent, mantissa, sign bit (or sign change) lowest: the value rotated left by one bit
        exponent = np.add(planes[0].reshape(shape), self.medians[ref.group], dtype=np.uint8)
        if fmt.exponent < 8:
            exponent &= (1 << fmt.exponent) - 1
        r = exponent.astype(work)
        r <<= fmt.mantissa + 1
        r |= self._rest(planes[1:], shape)
        low = _prefix_xor(np.bitwise_and(r, 1, dtype=np.uint8)).astype(work) if mode else r & 1
        out = r >> 1
        out |= low << (fmt.width - 1)
        return out.astype(fmt.uint, copy=False)


class PlanesCoder(Coder):
    """Exponent plane (minus the channel's median) + mantissa/sign-change planes, each zstd-coded."""

    name, id = "planes", 4

    def fit(self, bits: np.ndarray, fmt: BitFormat, predictor: BoundPredictor | None,
            refs: list[ChunkRef]) -> bytes:
        """The per-(group, channel) median exponents, zstd-compressed (nothing for integer formats)."""
        if not fmt.exponent or bits.size == 0:
            return b""
        exponents = ((bits.astype(np.uint32) >> fmt.mantissa) & ((1 << fmt.exponent) - 1)).astype(np.uint8)
        return zstandard.ZstdCompressor(level=19).compress(_medians(exponents).tobytes())

    def bind(self, model: bytes | memoryview, fmt: BitFormat, vshape: tuple[int, int, int],
             predictor: BoundPredictor | None) -> BoundCoder:
        return _Planes(fmt, vshape, read_medians(model, fmt, vshape))


def read_medians(model: bytes | memoryview, fmt: BitFormat, vshape: tuple[int, int, int],
                 dctx: zstandard.ZstdDecompressor | None = None) -> np.ndarray | None:
    """The median exponents [groups, channels] (uint8) a model block holds; None for integer formats and
    empty tensors, which have none."""
    if not fmt.exponent or not vshape[0] * vshape[1] * vshape[2]:
        return None
    size = vshape[0] * vshape[2]
    try:
        raw = (dctx or zstandard.ZstdDecompressor()).decompress(model, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise ValueError(f"planes model block is not a zstd frame ({exc})") from exc
    if len(raw) != size:
        raise ValueError(f"planes model holds {len(raw)} medians, expected {size}")
    return np.frombuffer(raw, np.uint8).reshape(vshape[0], vshape[2])
