"""The coder interface: fit a model block on the whole tensor, then code each chunk independently."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from hafiza.codec.formats import BitFormat
from hafiza.codec.layout import ChunkRef
from hafiza.codec.predictors.base import BoundPredictor


class BoundCoder(ABC):
    """A coder with its model block parsed: codes one chunk [tokens, channels] of raw bit patterns."""

    @abstractmethod
    def encode(self, bits: np.ndarray, ref: ChunkRef) -> bytes: ...

    @abstractmethod
    def decode(self, payload: memoryview, ref: ChunkRef) -> np.ndarray: ...

    def decode_into(self, payload: memoryview, ref: ChunkRef, out: np.ndarray) -> None:
        """Decode straight into `out` (the chunk's [tokens, channels] slice of the result); coders that can
        write there themselves override this to save a copy."""
        chunk = self.decode(payload, ref)
        if chunk.shape != out.shape:
            raise ValueError(f"chunk decoded to shape {chunk.shape}, expected {out.shape}")
        np.copyto(out, chunk, casting="unsafe")


class Coder(ABC):
    """A lossless coder, named in the container by `id`."""

    name: ClassVar[str]
    id: ClassVar[int]
    needs_predictor: ClassVar[bool] = False

    def fit(self, bits: np.ndarray, fmt: BitFormat, predictor: BoundPredictor | None,
            refs: list[ChunkRef]) -> bytes:
        """The model block shared by all chunks, learned from `bits` [groups, tokens, channels]."""
        return b""

    @abstractmethod
    def bind(self, model: bytes | memoryview, fmt: BitFormat, vshape: tuple[int, int, int],
             predictor: BoundPredictor | None) -> BoundCoder: ...
