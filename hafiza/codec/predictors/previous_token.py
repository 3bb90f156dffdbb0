"""The `previous-token` predictor: each value predicted by the same channel's value one token earlier."""

from __future__ import annotations

import numpy as np

from hafiza.codec.formats import BitFormat
from hafiza.codec.layout import ChunkRef
from hafiza.codec.predictors.base import BoundPredictor, Predictor, wrap


class _Bound(BoundPredictor):
    def __init__(self, fmt: BitFormat) -> None:
        self.fmt = fmt
        self.start = 1 << (fmt.width - 1)  # ordered integer of +0 (floats) or 0 (ints)

    def residuals(self, ordered: np.ndarray, ref: ChunkRef) -> np.ndarray:
        x = ordered.astype(np.int64)
        prev = np.empty_like(x)
        prev[0] = self.start
        prev[1:] = x[:-1]
        return wrap(x - prev, self.fmt.width)

    def reconstruct(self, residuals: np.ndarray, ref: ChunkRef) -> np.ndarray:
        x = self.start + np.cumsum(residuals.astype(np.int64), axis=0)
        return (x & self.fmt.mask).astype(self.fmt.uint)


class PreviousTokenPredictor(Predictor):
    """Within a chunk, token t is predicted by token t-1 of the same layer and channel; the first by zero."""

    name, id = "previous-token", 1

    def bind(self, fmt: BitFormat, shape: tuple[int, ...], context: object) -> BoundPredictor:
        return _Bound(fmt)
