"""Generation with each KV format through LLMEngine's scheduler and runner: chunked prefill and decode read every key
back from the pool, as `hafiza serve` does."""

from __future__ import annotations

import pytest
import torch

from hafiza.cache.pool import layout_for, make_kv_pool
from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.engine.results import GenerationResult
from hafiza.engine.scheduler import ScheduledBatch
from hafiza.models import LoadedModel
from hafiza.models.attention import AttentionMetadata, PrefillSpan
from hafiza.models.llama import LlamaModel

IDS = [(13 * i + 5) % 97 for i in range(150)]
RunnerOutput = tuple[torch.Tensor | None, list[int], list[torch.Tensor | None]]


@pytest.fixture(scope="module")
def tiny(model: LlamaModel, default_model: LoadedModel) -> LoadedModel:
    """The 97-token random model behind the engine (the default tokenizer decodes its ids)."""
    return LoadedModel(model.config, model, default_model.tokenizer, default_model.path, "tiny-97", "tiny-97")


def _reference(lm: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Logits of one whole-sequence prefill on fresh fp32 K/V (no engine)."""
    c = lm.config
    kv = make_kv_pool(layout_for(c, -(-len(ids) // 16), 16, "fp32", torch.float32), "cpu")
    pos = torch.arange(len(ids))
    meta = AttentionMetadata(slot_mapping=pos, prefills=[PrefillSpan(0, len(ids), len(ids))])
    return lm.model.logits(lm.model.forward(torch.tensor(ids), pos, meta, kv))


def _served(lm: LoadedModel, kv_dtype: str, max_tokens: int, chunk: int = 32) -> tuple[torch.Tensor, GenerationResult]:
    """Every prompt position's logits as the engine's runner computed them (prefill chunks of `chunk` tokens, for
    the request's prompt logprobs), and the request's greedy result."""
    engine = LLMEngine(lm, EngineConfig(kv_memory="8MiB", kv_dtype=kv_dtype, max_num_seqs=1,
                                        max_num_batched_tokens=chunk))
    rows: list[torch.Tensor] = []
    execute_all = engine.runner.execute_all

    def recording(batch: ScheduledBatch, every_position: list[bool]) -> RunnerOutput:
        out = execute_all(batch, every_position)
        rows.extend(s for s in out[2] if s is not None)
        return out

    engine.runner.execute_all = recording  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, prompt_logprobs=0)
    result = engine.generate([IDS], params)[0]
    engine.check_integrity()
    return torch.cat(rows), result


def test_fp32_chunked_through_pool_equals_one_prefill(tiny: LoadedModel) -> None:
    logits, result = _served(tiny, "fp32", 1)
    ref = _reference(tiny, IDS)
    assert logits.shape == ref.shape and torch.allclose(logits, ref, atol=1e-4)
    logp = torch.log_softmax(ref, -1)
    served = [lp.logprob for lp in result.prompt_logprobs[1:]]
    assert torch.allclose(torch.tensor(served), logp[torch.arange(149), torch.tensor(IDS[1:])], atol=1e-4)


def test_decode_path_matches_prefill_path(tiny: LoadedModel) -> None:
    _, result = _served(tiny, "fp32", 6)
    tokens = result.token_ids
    ref = _reference(tiny, IDS + tokens[:-1])
    assert [int(x) for x in ref[len(IDS) - 1 :].argmax(-1)] == tokens


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16", "fp8", "int8", "int4"])
def test_lossy_formats_generate_close_to_fp32(tiny: LoadedModel, kv_dtype: str) -> None:
    ref = torch.log_softmax(_reference(tiny, IDS), -1)
    logits, result = _served(tiny, kv_dtype, 10)
    got = torch.log_softmax(logits, -1)
    kl = float((ref.exp() * (ref - got)).sum(-1).mean())
    assert kl < {"bf16": 1e-4, "fp16": 1e-5, "fp8": 3e-2, "int8": 1e-3, "int4": 5e-2}[kv_dtype]
    vocab = tiny.config.vocab_size
    assert len(result.token_ids) == 10 and all(0 <= t < vocab for t in result.token_ids)


def test_int4_same_prompt_twice_gives_the_same_tokens(tiny: LoadedModel) -> None:
    engine = LLMEngine(tiny, EngineConfig(kv_memory="8MiB", kv_dtype="int4", max_num_seqs=1,
                                                max_num_batched_tokens=32))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    a, b = (engine.generate([IDS], params)[0] for _ in range(2))
    assert a.token_ids == b.token_ids and b.num_cached_tokens > 0
    engine.check_integrity()
