"""Logprobs of generated and prompt tokens equal log_softmax of transformers' own logits for the same sequence,
whatever sampling transform is applied; prompt logprobs survive chunked prefill and a warm prefix cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.engine.output import TokenLogprob
from hafiza.models import LoadedModel
from tests.support.models import hf_reference

ATOL = 2e-4
PROMPT = list(range(400, 437))  # 37 tokens: two full 16-token blocks and a partial one


@pytest.fixture(scope="module")
def reference_logp(tiny_dirs: dict[str, Path]):
    model = hf_reference(tiny_dirs["llama"])

    def logp(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)

    return logp


def assert_matches(got: TokenLogprob, row: torch.Tensor, k: int) -> None:
    assert abs(got.logprob - float(row[got.token_id])) < ATOL, (got.logprob, float(row[got.token_id]))
    values, ids = torch.topk(row, k)
    assert len(got.top) == k
    for (tid, lp), want_id, want in zip(got.top, ids.tolist(), values.tolist(), strict=True):
        assert abs(lp - want) < ATOL
        assert tid == want_id or abs(float(row[tid]) - want) < ATOL  # ties may order either way


@pytest.mark.parametrize("kwargs", [
    {"temperature": 0},
    {"temperature": 0.7, "seed": 1, "top_k": 5, "logit_bias": {500: 8.0}, "repetition_penalty": 1.5},
])
def test_generated_and_prompt_logprobs_match_transformers(tiny_llama: LoadedModel, reference_logp,
                                                          kwargs: dict) -> None:
    engine = LLMEngine(tiny_llama, EngineConfig(kv_memory="8MiB", kv_dtype="model"))
    [r] = engine.generate([PROMPT], SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=2,
                                                   **kwargs))
    ref = reference_logp(PROMPT + r.token_ids)
    assert [lp.token_id for lp in r.logprobs] == r.token_ids
    for i, lp in enumerate(r.logprobs):
        assert_matches(lp, ref[len(PROMPT) - 1 + i], 3)
    assert r.prompt_logprobs is not None and len(r.prompt_logprobs) == len(PROMPT)
    assert r.prompt_logprobs[0] is None
    for pos, lp in enumerate(r.prompt_logprobs[1:], start=1):
        assert lp is not None and lp.token_id == PROMPT[pos]
        assert_matches(lp, ref[pos - 1], 2)


def test_prompt_logprobs_with_chunked_prefill_and_warm_cache(tiny_llama: LoadedModel, reference_logp) -> None:
    engine = LLMEngine(tiny_llama, EngineConfig(kv_memory="8MiB", kv_dtype="model", max_num_batched_tokens=8))
    ref = reference_logp(PROMPT)
    [warm] = engine.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0))
    assert warm.num_cached_tokens == 0
    [plain] = engine.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0))
    assert plain.num_cached_tokens == 32, "a request without prompt logprobs reads the cached blocks"
    [echo] = engine.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert echo.num_cached_tokens == 0, "prompt logprobs need the prompt's logits, so it is computed"
    assert echo.finish_reason == "length" and echo.token_ids == []
    assert echo.prompt_logprobs is not None
    for pos, lp in enumerate(echo.prompt_logprobs[1:], start=1):
        assert lp is not None and lp.top == [] and abs(lp.logprob - float(ref[pos - 1, PROMPT[pos]])) < ATOL
    engine.check_integrity()


def test_no_logprobs_unless_asked(tiny_llama: LoadedModel) -> None:
    engine = LLMEngine(tiny_llama, EngineConfig(kv_memory="8MiB", kv_dtype="model"))
    [r] = engine.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert r.logprobs == [] and r.prompt_logprobs is None
    [z] = engine.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=0))
    assert [lp.top for lp in z.logprobs] == [[], [], []] and z.token_ids == r.token_ids
