"""Eviction policies at block granularity and their attention scores (eviction in the engine and its attention
observer: tests/engine/test_eviction_served.py, tests/engine/test_h2o_scores.py)."""

from __future__ import annotations

import pytest
import torch

from hafiza.cache.eviction import AttentionScores, HeavyHitters, StreamingLLM, make_policy
from hafiza.errors import HafizaError


def test_streaming_keeps_sink_block_and_recent_blocks() -> None:
    assert StreamingLLM(sink_tokens=4).select(10, 4, 16) == [0, 7, 8, 9]
    assert StreamingLLM(sink_tokens=20).select(10, 4, 16) == [0, 1, 8, 9]
    assert StreamingLLM().select(3, 4, 16) == [0, 1, 2]
    with pytest.raises(HafizaError, match="at least 2 blocks"):
        StreamingLLM().select(10, 1, 16)


def test_heavy_hitters_keep_top_scored_middle_blocks() -> None:
    scores = torch.tensor([0.0, 0.1, 5.0, 0.2, 3.0, 0.3, 0.0, 0.0, 0.0, 0.0])
    assert HeavyHitters(recent_fraction=0.5).select(10, 6, 16, scores) == [0, 2, 4, 7, 8, 9]
    with pytest.raises(HafizaError, match="one score per block"):
        HeavyHitters().select(10, 6, 16, None)


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(HafizaError, match="unknown eviction policy 'lru'"):
        make_policy("lru")


def test_attention_scores_average_per_query() -> None:
    s = AttentionScores(4, torch.device("cpu"))
    s.add(torch.tensor([2, 0]), torch.tensor([1.0] * 16 + [3.0] * 16), num_queries=4)
    assert s.score([0, 2]).tolist() == [12.0, 4.0]
    s.reset([0])
    assert s.score([0, 1]).tolist() == [0.0, 0.0]
