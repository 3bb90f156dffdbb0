"""Generation through the paged pool with each KV format: chunked prefill and decode read every key back."""

from __future__ import annotations

import pytest
import torch

from hafiza.cache.kv_cache import KVLayout
from hafiza.models.attention import AttentionMetadata, PrefillSpan
from hafiza.models.llama import LlamaModel
from hafiza.quant import make_kv_cache
from hafiza.quant.sequence import PagedSequence

IDS = [(13 * i + 5) % 97 for i in range(150)]


def _pool(model: LlamaModel, kind: str) -> object:
    c = model.config
    layout = KVLayout(c.num_layers, 16, 16, c.num_kv_heads, c.head_dim, torch.float32)
    return make_kv_cache(kind, layout, "cpu")


def _reference(model: LlamaModel) -> torch.Tensor:
    kv = _pool(model, "fp32")
    pos = torch.arange(len(IDS))
    meta = AttentionMetadata(slot_mapping=pos, prefills=[PrefillSpan(0, len(IDS), len(IDS))])
    return model.logits(model.forward(torch.tensor(IDS), pos, meta, kv))


def _chunked(model: LlamaModel, kind: str, chunk: int = 32) -> tuple[PagedSequence, torch.Tensor]:
    seq = PagedSequence(model, _pool(model, kind))
    return seq, torch.cat([seq.prefill(IDS[s : s + chunk]) for s in range(0, len(IDS), chunk)])


def test_fp32_chunked_through_pool_equals_one_prefill(model: LlamaModel) -> None:
    _, logits = _chunked(model, "fp32")
    assert torch.allclose(logits, _reference(model), atol=1e-4)


def test_decode_path_matches_prefill_path(model: LlamaModel) -> None:
    seq, logits = _chunked(model, "fp32")
    tokens = seq.fork().greedy(logits[-1], 6)
    again = PagedSequence(model, _pool(model, "fp32"))
    ref = again.prefill(IDS + tokens[:-1])
    assert [int(x) for x in ref[len(IDS) - 1 :].argmax(-1)] == tokens


@pytest.mark.parametrize("kind", ["bf16", "fp16", "fp8", "int8", "int4"])
def test_lossy_formats_generate_close_to_fp32(model: LlamaModel, kind: str) -> None:
    ref = torch.log_softmax(_reference(model), -1)
    seq, logits = _chunked(model, kind)
    got = torch.log_softmax(logits, -1)
    kl = float((ref.exp() * (ref - got)).sum(-1).mean())
    assert kl < {"bf16": 1e-4, "fp16": 1e-5, "fp8": 3e-2, "int8": 1e-3, "int4": 5e-2}[kind]
    tokens = seq.greedy(logits[-1], 10)
    assert len(tokens) == 10 and all(0 <= t < 97 for t in tokens)


def test_fork_is_independent(model: LlamaModel) -> None:
    seq, logits = _chunked(model, "int4")
    a = seq.fork().greedy(logits[-1], 8)
    b = seq.fork().greedy(logits[-1], 8)
    assert a == b and seq.length == len(IDS)
