"""Speculative decoding: drafts guessed ahead of the model (by prompt lookup or a small draft model), verified by
the target in one batched step."""

from hafiza.engine.speculative.backoff import DraftBudget
from hafiza.engine.speculative.config import SpeculativeConfig
from hafiza.engine.speculative.counters import SpecCounters
from hafiza.engine.speculative.ngram import NgramProposer

__all__ = ["DraftBudget", "NgramProposer", "SpecCounters", "SpeculativeConfig"]
