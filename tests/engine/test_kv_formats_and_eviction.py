"""Lossy KV pools and token eviction run through the same scheduler and paged pool as bf16."""

from __future__ import annotations

import pytest

from hafiza.cache.formats.full import FullPrecisionKV
from hafiza.cache.hashing import chain_hashes
from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.errors import ConfigError
from hafiza.models import LoadedModel


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "int8", "int4"])
def test_each_format_generates_through_the_engine(default_model: LoadedModel, kv_dtype: str) -> None:
    engine = LLMEngine(default_model, EngineConfig(kv_memory="32MiB", kv_dtype=kv_dtype, max_num_seqs=4))
    assert isinstance(engine.kv, FullPrecisionKV) == (kv_dtype == "bf16")
    assert engine.stats().kv_dtype == engine.kv.kv_dtype == kv_dtype
    prompts = ["The capital of France is", "The capital of Germany is the city of"]
    out = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
    assert "Paris" in out[0].text and "Berlin" in out[1].text
    engine.check_integrity()


def test_quantised_pools_hold_more_tokens_in_the_same_memory(default_model: LoadedModel) -> None:
    cap = {k: LLMEngine(default_model, EngineConfig(kv_memory="16MiB", kv_dtype=k, max_num_seqs=2)).capacity_tokens
           for k in ("fp32", "bf16", "fp8", "int8", "int4")}
    assert cap["fp32"] < cap["bf16"] < cap["int8"] <= cap["fp8"] < cap["int4"]


def engine_with_eviction(lm: LoadedModel, policy: str) -> LLMEngine:
    cfg = EngineConfig(kv_memory="8MiB", kv_dtype="model", block_size=4, eviction=policy, kv_budget_tokens=32)
    return LLMEngine(lm, cfg)


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_eviction_keeps_each_sequence_within_its_budget(tiny_llama: LoadedModel, policy: str) -> None:
    engine = engine_with_eviction(tiny_llama, policy)
    prompts = [list(range(100 + i, 200 + i)) for i in range(3)]
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    outputs: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = outputs.get(out.request_id, 0) + len(out.new_token_ids)
        for seq in engine.scheduler.running:
            assert len(engine.cache.blocks(seq.request_id).block_ids) <= 8
        engine.check_integrity()
    assert outputs == {"req-0": 30, "req-1": 30, "req-2": 30}
    assert engine.stats().blocks.in_use == 0


def test_evicted_sequences_are_not_offered_as_prefixes(tiny_llama: LoadedModel) -> None:
    engine = engine_with_eviction(tiny_llama, "streaming")
    prompt = list(range(300, 400))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    engine.generate([prompt], params)
    first_chunk = engine.scheduler.max_chunk  # 20 tokens: computed before the first eviction
    # only the blocks computed with the full context are cached; nothing after the first eviction
    expected = chain_hashes(prompt, 4, (*engine.extra_keys, None))[: first_chunk // 4]
    assert set(engine.blocks.hash_to_block) == set(expected)
    second = engine.generate([prompt], params)[0]
    assert 0 < second.num_cached_tokens <= first_chunk
    engine.check_integrity()


def test_eviction_needs_a_budget(tiny_llama: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="needs a KV token budget") as e:
        LLMEngine(tiny_llama, EngineConfig(kv_memory="8MiB", eviction="streaming"))
    assert e.value.setting == "kv_budget_tokens" and "--" not in str(e.value)


def test_a_too_small_budget_is_a_config_error_with_its_numbers(tiny_llama: LoadedModel) -> None:
    with pytest.raises(ConfigError, match=r"budget of 1 blocks \(4 tokens\) is too small") as e:
        LLMEngine(tiny_llama, EngineConfig(kv_memory="8MiB", block_size=4, eviction="streaming", kv_budget_tokens=4))
    assert e.value.setting == "kv_budget_tokens" and "--" not in str(e.value)


def test_a_pool_with_no_block_is_a_config_error(tiny_llama: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="KV memory 16 \\(16 bytes\\) holds no KV block") as e:
        LLMEngine(tiny_llama, EngineConfig(kv_memory=16))
    assert e.value.setting == "kv_memory" and "--" not in str(e.value)
