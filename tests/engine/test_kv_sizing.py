"""A pool sized to one request (`hafiza generate`) holds exactly that request's tokens, in whole blocks, in every KV
format, and serves it."""

from __future__ import annotations

import pytest

from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.engine.engine import kv_memory_for_tokens
from hafiza.models import LoadedModel


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp8", "int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 16, 17, 100])
def test_the_pool_holds_the_request_in_whole_blocks(tiny_llama: LoadedModel, kv_dtype: str, tokens: int) -> None:
    config = EngineConfig(kv_dtype=kv_dtype, max_num_seqs=1)
    config.kv_memory = kv_memory_for_tokens(tiny_llama, config, tokens)
    engine = LLMEngine(tiny_llama, config)
    assert engine.capacity_tokens == -(-tokens // 16) * 16


@pytest.mark.parametrize("kv_dtype", ["bf16", "int4"])
def test_a_request_fills_its_own_pool(tiny_llama: LoadedModel, kv_dtype: str) -> None:
    prompt, params = list(range(40, 77)), SamplingParams(max_tokens=27, temperature=0, ignore_eos=True)
    config = EngineConfig(kv_dtype=kv_dtype, max_num_seqs=1)
    config.kv_memory = kv_memory_for_tokens(tiny_llama, config, len(prompt) + params.max_tokens)
    engine = LLMEngine(tiny_llama, config)
    [result] = engine.generate([prompt], params)
    assert len(result.token_ids) == 27 and result.finish_reason == "length"
    engine.check_integrity()
