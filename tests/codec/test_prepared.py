"""The speculative predictor's prepared weights: shared by every predictor of one target, dropped with it."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

from hafiza.codec.predictors.speculative import SpeculativePredictor, prepared
from hafiza.models import load_model


def test_prepared_weights_are_shared_per_target_and_go_with_it(tiny_dirs: dict[str, Path]) -> None:
    loaded = load_model(tiny_dirs["llama"], dtype="fp32", device="cpu")
    first = prepared(loaded.model, "bf16", 1)
    assert prepared(loaded.model, "bf16", 1) is first and prepared(loaded.model, "bf16", 0) is not first
    encoder, decoder = SpeculativePredictor(loaded, "bf16", 1), SpeculativePredictor(loaded, "bf16", 1)
    ids = list(range(5, 21))
    assert all(a.equal(b) for a, b in zip(encoder.predict(ids), decoder.predict(ids), strict=True))
    assert encoder._runner is decoder._runner is first
    gone = weakref.ref(loaded.model)
    del loaded, first, encoder, decoder
    gc.collect()
    assert gone() is None  # the cache held the target only weakly
