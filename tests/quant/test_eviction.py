"""Eviction policies at block granularity, the attention-mass observer, and eviction inside a sequence."""

from __future__ import annotations

import pytest
import torch

from hafiza.cache.kv_cache import KVLayout
from hafiza.errors import HafizaError
from hafiza.models.llama import LlamaModel
from hafiza.quant import make_kv_cache
from hafiza.quant.eviction import AttentionScores, HeavyHitters, StreamingLLM, make_policy
from hafiza.quant.observe import observe_attention
from hafiza.quant.sequence import PagedSequence


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


def _layout(model: LlamaModel, blocks: int) -> KVLayout:
    c = model.config
    return KVLayout(c.num_layers, blocks, 16, c.num_kv_heads, c.head_dim, torch.float32)


def test_observer_reports_mass_and_leaves_outputs_unchanged(model: LlamaModel) -> None:
    ids = list(range(1, 41))
    plain = PagedSequence(model, make_kv_cache("fp32", _layout(model, 4), "cpu")).prefill(ids)
    seen = []
    seq = PagedSequence(model, make_kv_cache("fp32", _layout(model, 4), "cpu"))
    with observe_attention(lambda layer, table, mass, n: seen.append((layer, table.tolist(), mass, n))):
        observed = seq.prefill(ids)
    assert torch.equal(plain, observed)
    assert [s[0] for s in seen] == [0, 1] and seen[0][1] == [0, 1, 2] and seen[0][3] == 40
    assert torch.allclose(seen[0][2].sum(), torch.tensor(40.0 * model.config.num_heads))
    assert float(seen[0][2][40:].abs().sum()) == 0.0


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_sequence_beyond_budget_evicts_blocks_and_keeps_positions(model: LlamaModel, policy: str) -> None:
    seq = PagedSequence(model, make_kv_cache("bf16", _layout(model, 16), "cpu"), make_policy(policy), 96)
    ids = [(7 * i) % 97 for i in range(200)]
    for s in range(0, 200, 32):
        logits = seq.prefill(ids[s : s + 32])
        assert len(seq.blocks) <= 6 and bool(torch.isfinite(logits).all())
    assert seq.blocks[0] == 0 and seq.starts[0] == 0
    assert seq.starts[-1] == 192 and seq.length == 200
    assert seq.evicted_tokens == 16 * (13 - 6)
    assert len(seq.greedy(logits[-1], 20)) == 20 and len(seq.blocks) <= 6


def test_evicting_sequence_needs_a_budget(model: LlamaModel) -> None:
    with pytest.raises(HafizaError, match="budget"):
        PagedSequence(model, make_kv_cache("bf16", _layout(model, 4), "cpu"), make_policy("streaming"))
