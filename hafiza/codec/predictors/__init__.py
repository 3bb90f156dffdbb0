"""Predictors by name and by container id (0 means the coder uses none)."""

from __future__ import annotations

from hafiza.codec.errors import CodecError
from hafiza.codec.predictors.base import BoundPredictor, Predictor
from hafiza.codec.predictors.previous_token import PreviousTokenPredictor
from hafiza.codec.predictors.speculative import SpeculativePredictor

PREDICTORS: dict[str, type[Predictor]] = {p.name: p for p in (PreviousTokenPredictor, SpeculativePredictor)}
PREDICTOR_IDS: dict[int, type[Predictor]] = {p.id: p for p in PREDICTORS.values()}


def resolve_predictor(predictor: str | Predictor | None) -> Predictor:
    """A predictor instance from a name or an instance; None means previous-token."""
    if predictor is None:
        return PreviousTokenPredictor()
    if isinstance(predictor, Predictor):
        return predictor
    if predictor not in PREDICTORS:
        raise CodecError(f"unknown predictor {predictor!r}: choose one of {', '.join(PREDICTORS)}")
    return PREDICTORS[predictor]()


__all__ = ["PREDICTORS", "PREDICTOR_IDS", "BoundPredictor", "Predictor", "resolve_predictor"]
