"""The `zstd` coder (the baseline): byte planes of each chunk shuffled together, then zstd."""

from __future__ import annotations

import numpy as np
import zstandard

from hafiza.codec.coders.base import BoundCoder, Coder
from hafiza.codec.formats import BitFormat
from hafiza.codec.layout import ChunkRef
from hafiza.codec.predictors.base import BoundPredictor


def shuffle(bits: np.ndarray, nbytes: int) -> bytes:
    """Byte-plane shuffle: all low bytes, then all next bytes, ... (little-endian planes)."""
    flat = np.ascontiguousarray(bits).reshape(-1).astype(bits.dtype.newbyteorder("<"), copy=False)
    return flat.view(np.uint8).reshape(-1, nbytes).T.tobytes()


def unshuffle(data: bytes, nbytes: int, dtype: np.dtype) -> np.ndarray:
    planes = np.frombuffer(data, np.uint8).reshape(nbytes, -1)
    return np.ascontiguousarray(planes.T).view(dtype.newbyteorder("<")).reshape(-1).astype(dtype)


class _Zstd(BoundCoder):
    def __init__(self, fmt: BitFormat, channels: int, level: int) -> None:
        self.fmt, self.channels = fmt, channels
        self.cctx = zstandard.ZstdCompressor(level=level)
        self.dctx = zstandard.ZstdDecompressor()

    def encode(self, bits: np.ndarray, ref: ChunkRef) -> bytes:
        return self.cctx.compress(shuffle(bits, self.fmt.nbytes))

    def decode(self, payload: memoryview, ref: ChunkRef) -> np.ndarray:
        size = (ref.stop - ref.start) * self.channels * self.fmt.nbytes
        raw = self.dctx.decompress(bytes(payload), max_output_size=size)
        if len(raw) != size:
            raise ValueError("zstd chunk decompressed to the wrong size")
        return unshuffle(raw, self.fmt.nbytes, self.fmt.uint).reshape(ref.stop - ref.start, self.channels)


class ZstdCoder(Coder):
    """Byte-plane shuffle + zstd at `level` (3 by default); the level is the encoder's choice only."""

    name, id = "zstd", 1

    def __init__(self, level: int = 3) -> None:
        self.level = level

    def bind(self, model: bytes | memoryview, fmt: BitFormat, vshape: tuple[int, int, int],
             predictor: BoundPredictor | None) -> BoundCoder:
        return _Zstd(fmt, vshape[2], self.level)
