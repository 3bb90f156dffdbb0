"""The `speculative` predictor: a cheaper copy of the target model, rerun by the decoder on the same tokens.

Its K/V, cast to the tensor's dtype and rounded to a grid of `grid` ordered steps, are the prediction. The
decoder reproduces it bit for bit when it runs the same code with the same parameters (variant, exact layers,
thread count, one prefill of the whole prompt); a per-chunk CRC of the prediction, recorded by the encoder,
tells when it does not, and decode raises PredictionMismatchError so the caller recomputes from tokens.
"""

from __future__ import annotations

import hashlib
import time
import weakref
from typing import Any

import numpy as np
import torch

from hafiza.codec.container import DIGEST_BYTES
from hafiza.codec.errors import ContextError
from hafiza.codec.formats import BitFormat, tensor_bits
from hafiza.codec.layout import ChunkRef, view_shape
from hafiza.codec.predictors.base import BoundPredictor, Predictor, wrap
from hafiza.codec.predictors.forward import PredictorModel

PREPARED_PER_TARGET = 4
_PREPARED: weakref.WeakKeyDictionary[Any, dict[tuple[str, int], PredictorModel]] = weakref.WeakKeyDictionary()


def prepared(target: Any, variant: str, exact_layers: int) -> PredictorModel:
    """The target's weights prepared for a variant, shared by every predictor of this process (encoders and
    decoders alike), so converting the weights is paid once. Kept while the target lives (the last
    PREPARED_PER_TARGET variants of each), and dropped with it."""
    by_variant = _PREPARED.setdefault(target, {})
    key = (variant, exact_layers)
    hit = by_variant.get(key)
    if hit is None:
        if len(by_variant) >= PREPARED_PER_TARGET:
            by_variant.pop(next(iter(by_variant)))
        hit = by_variant[key] = PredictorModel(target, variant, exact_layers)
    return hit


class PrecomputedPrediction(BoundPredictor):
    """A bound predictor whose whole prediction (ordered values, the view's shape) was computed up front: the
    speculative model's run here, the store's prefix run (hafiza/store)."""

    def __init__(self, fmt: BitFormat, prediction: np.ndarray) -> None:
        self.fmt, self.prediction = fmt, prediction

    def _chunk(self, ref: ChunkRef) -> np.ndarray:
        return self.prediction[ref.group, ref.start : ref.stop]

    def residuals(self, ordered: np.ndarray, ref: ChunkRef) -> np.ndarray:
        return wrap(ordered.astype(np.int64) - self._chunk(ref).astype(np.int64), self.fmt.width)

    def reconstruct(self, residuals: np.ndarray, ref: ChunkRef) -> np.ndarray:
        x = residuals.astype(np.int64) + self._chunk(ref).astype(np.int64)
        return (x & self.fmt.mask).astype(self.fmt.uint)

    def predicted_bits(self, ref: ChunkRef) -> np.ndarray:
        return self.fmt.from_ordered(self._chunk(ref))


class SpeculativePredictor(Predictor):
    """Predicts a KV tensor by rerunning `model` (the target's LoadedModel or LlamaModel) more cheaply.

    variant: precision of the non-exact layers (see forward.VARIANTS); exact_layers: how many leading layers
    run exactly as the target; threads: torch threads during the run (fixed, for reproducibility); grid:
    the prediction is rounded to multiples of `grid` ordered steps (1 = no rounding).
    """

    name, id = "speculative", 2

    def __init__(self, model: Any = None, variant: str = "bf16-mixed", exact_layers: int = 0,
                 threads: int = 1, grid: int = 1) -> None:
        self._model = model
        self.variant, self.exact_layers, self.threads, self.grid = variant, exact_layers, threads, grid
        self._runner: PredictorModel | None = None
        self._memo: tuple[bytes, torch.Tensor, torch.Tensor] | None = None
        self.last_seconds = 0.0  # CPU seconds of the last model run

    @property
    def loaded(self) -> Any:
        if self._model is None:
            from hafiza.models import load_model

            self._model = load_model(dtype="fp32", device="cpu", weights="fp32")
        return self._model

    @property
    def target(self) -> Any:
        m = self.loaded
        return getattr(m, "model", m)

    def fingerprint(self) -> bytes:
        m = self.loaded
        identity = getattr(m, "fingerprint", None)
        identity = identity or f"{self.target.config.fingerprint()}:{self.target.dtype}"
        text = f"speculative:{self.variant}:{self.exact_layers}:{self.threads}:{self.grid}:{identity}"
        return hashlib.sha256(text.encode()).digest()[:DIGEST_BYTES]

    def input_digest(self, context: Any) -> bytes:
        ids = getattr(context, "token_ids", None)
        if ids is None:
            raise ContextError("the speculative predictor needs the token ids (context.token_ids)")
        h = hashlib.sha256(str(context.role).encode())
        h.update(np.asarray(list(ids), dtype="<i8").tobytes())
        return h.digest()[:DIGEST_BYTES]

    def predict(self, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V predicted for `token_ids` (fp32), memoised for the last token sequence."""
        key = hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).digest()
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1], self._memo[2]
        if self._runner is None:
            self._runner = prepared(self.target, self.variant, self.exact_layers)
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            start = time.process_time()
            k, v = self._runner.kv(token_ids)
            self.last_seconds = time.process_time() - start
        finally:
            torch.set_num_threads(before)
        self._memo = (key, k, v)
        return k, v

    def bind(self, fmt: BitFormat, shape: tuple[int, ...], context: Any) -> BoundPredictor:
        self.input_digest(context)
        if context.role not in ("k", "v"):
            raise ContextError(f"context.role must be 'k' or 'v', not {context.role!r}")
        k, v = self.predict([int(i) for i in context.token_ids])
        pred = k if context.role == "k" else v
        if tuple(pred.shape) != tuple(shape):
            raise ContextError(f"prediction shape {tuple(pred.shape)} but tensor shape {shape}")
        ordered = fmt.to_ordered(tensor_bits(pred.to(fmt.torch_dtype))).astype(np.int64)
        if self.grid > 1:
            ordered = np.minimum((ordered + self.grid // 2) // self.grid * self.grid, fmt.mask)
        return PrecomputedPrediction(fmt, ordered.astype(fmt.uint).reshape(view_shape(shape)))
