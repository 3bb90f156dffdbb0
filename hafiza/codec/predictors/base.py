"""The predictor interface: residuals against a prediction in the ordered-integer domain, and back."""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from hafiza.codec.container import DIGEST_BYTES
from hafiza.codec.formats import BitFormat
from hafiza.codec.layout import ChunkRef

if TYPE_CHECKING:
    from hafiza.codec.context import CodecContext


def wrap(values: np.ndarray, width: int) -> np.ndarray:
    """Reduce int64 values modulo 2**width into the signed range [-2**(width-1), 2**(width-1))."""
    half = 1 << (width - 1)
    return ((values + half) & ((1 << width) - 1)) - half


class BoundPredictor(ABC):
    """A predictor prepared for one tensor: maps a chunk's ordered integers to residuals and back."""

    fmt: BitFormat

    @abstractmethod
    def residuals(self, ordered: np.ndarray, ref: ChunkRef) -> np.ndarray:
        """int64 residuals in [-2**(w-1), 2**(w-1)) for a chunk [tokens, channels] of ordered integers."""

    @abstractmethod
    def reconstruct(self, residuals: np.ndarray, ref: ChunkRef) -> np.ndarray:
        """Inverse of residuals: the chunk's ordered integers (uint of the format's width)."""

    def predicted_bits(self, ref: ChunkRef) -> np.ndarray | None:
        """The prediction's bit patterns when they do not depend on the chunk's data, else None."""
        return None

    def digest(self, ref: ChunkRef) -> int:
        """CRC-32 of the chunk's prediction (0 when the prediction comes from the data itself)."""
        bits = self.predicted_bits(ref)
        return 0 if bits is None else zlib.crc32(np.ascontiguousarray(bits).tobytes())


class Predictor(ABC):
    """A named predictor; `fingerprint` identifies its parameters, `input_digest` what it was run on."""

    name: ClassVar[str]
    id: ClassVar[int]

    def fingerprint(self) -> bytes:
        return bytes(DIGEST_BYTES)

    def input_digest(self, context: CodecContext) -> bytes:
        return bytes(DIGEST_BYTES)

    @abstractmethod
    def bind(self, fmt: BitFormat, shape: tuple[int, ...], context: CodecContext) -> BoundPredictor: ...
