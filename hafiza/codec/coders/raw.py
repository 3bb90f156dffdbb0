"""The `raw` coder: chunk bytes stored as they are (the reference point, and the fastest)."""

from __future__ import annotations

import numpy as np

from hafiza.codec.coders.base import BoundCoder, Coder
from hafiza.codec.formats import BitFormat
from hafiza.codec.layout import ChunkRef
from hafiza.codec.predictors.base import BoundPredictor


class _Raw(BoundCoder):
    def __init__(self, fmt: BitFormat, channels: int) -> None:
        self.fmt, self.channels = fmt, channels

    def encode(self, bits: np.ndarray, ref: ChunkRef) -> bytes:
        return np.ascontiguousarray(bits, self.fmt.uint.newbyteorder("<")).tobytes()

    def decode(self, payload: memoryview, ref: ChunkRef) -> np.ndarray:
        arr = np.frombuffer(payload, self.fmt.uint.newbyteorder("<"))
        return arr.reshape(ref.stop - ref.start, self.channels).astype(self.fmt.uint)


class RawCoder(Coder):
    """Stores the bit patterns unchanged."""

    name, id = "raw", 0

    def bind(self, model: bytes | memoryview, fmt: BitFormat, vshape: tuple[int, int, int],
             predictor: BoundPredictor | None) -> BoundCoder:
        return _Raw(fmt, vshape[2])
