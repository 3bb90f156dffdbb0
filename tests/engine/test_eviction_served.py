"""Eviction through LLMEngine's scheduler: a sequence beyond its KV budget keeps its sink block and positions, and
its prompt logprobs are still computed (the quality benchmark scores texts this way)."""

from __future__ import annotations

import pytest
import torch

from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.models import LoadedModel


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_sequence_beyond_budget_evicts_blocks_and_keeps_positions(tiny_llama: LoadedModel, policy: str) -> None:
    engine = LLMEngine(tiny_llama, EngineConfig(kv_memory="8MiB", kv_dtype="bf16", max_num_batched_tokens=32,
                                                eviction=policy, kv_budget_tokens=96))
    ids = [(7 * i) % 97 for i in range(200)]
    engine.add_request(ids, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, prompt_logprobs=0))
    seen: list[list[int]] = []
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
        for seq in engine.scheduler.running:
            kv = engine.cache.blocks(seq.request_id)
            assert len(kv.block_ids) <= 6
            assert kv.logical[0] == 0  # the sink block stays, at its position
            seen.append(list(kv.logical))
        engine.check_integrity()
    assert seen[-1][-1] * 16 == 208  # 200 prompt + 19 fed-back tokens: the last block starts at 208
    assert engine.stats().evicted_tokens == 16 * (14 - 6)
    assert sum(len(o.new_token_ids) for o in outs) == 20
    logprobs = next(o.prompt_logprobs for o in outs if o.prompt_logprobs is not None)
    assert len(logprobs) == 200 and all(lp is None or torch.isfinite(torch.tensor(lp.logprob)) for lp in logprobs)
