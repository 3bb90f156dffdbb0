"""n > 1: the choices share the prompt's KV blocks, draw from distinct reproducible seeds, finish and abort
together."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.engine.async_engine import AsyncEngine
from hafiza.engine.engine import choice_seed
from hafiza.models import LoadedModel

PROMPT = list(range(500, 564))  # 64 tokens: four full 16-token blocks


@pytest.fixture
def engine(tiny_llama: LoadedModel) -> LLMEngine:
    return LLMEngine(tiny_llama, EngineConfig(kv_memory="8MiB", kv_dtype="model"))


def sampled(n: int, seed: int | None = 11) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=1.0, seed=seed, n=n, ignore_eos=True)


def test_choices_share_the_prompt_blocks(engine: LLMEngine) -> None:
    results = engine.generate([PROMPT], sampled(4))
    assert [r.index for r in results] == [0, 1, 2, 3]
    assert [r.num_cached_tokens for r in results] == [0, 48, 48, 48]  # the last prompt token is always computed
    assert engine.blocks.prefix_cache_hits == 3 * 48
    engine.check_integrity()
    assert engine.blocks.stats().in_use == 0 and not engine.output.groups and not engine.seqs


def test_seeded_choices_are_distinct_and_reproducible(engine: LLMEngine) -> None:
    first = [r.token_ids for r in engine.generate([PROMPT], sampled(4))]
    again = [r.token_ids for r in engine.generate([PROMPT], sampled(4))]
    assert first == again
    assert len({tuple(t) for t in first}) == 4
    [alone] = engine.generate([PROMPT], sampled(1))
    assert alone.token_ids == first[0], "choice 0 draws from the request's own seed"
    assert len({choice_seed(11, i) for i in range(128)}) == 128


def test_unseeded_choices_differ(engine: LLMEngine) -> None:
    """Unseeded choices draw one after another from torch's global generator; it is seeded here so that what
    earlier tests drew from it cannot make two choices collide by chance."""
    torch.manual_seed(1234)
    results = engine.generate([PROMPT], sampled(3, seed=None))
    assert len({tuple(r.token_ids) for r in results}) == 3


def test_choices_with_other_prompts_in_flight(engine: LLMEngine) -> None:
    other = list(range(700, 730))
    out = engine.generate([PROMPT, other], [sampled(3), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)])
    assert [(r.request_id == out[0].request_id, r.index) for r in out] == [(True, 0), (True, 1), (True, 2),
                                                                            (False, 0)]
    assert all(len(r.token_ids) == 8 for r in out[:3]) and len(out[3].token_ids) == 5


def test_abort_stops_every_choice(engine: LLMEngine) -> None:
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=200, temperature=1.0, n=3, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert len(engine.seqs) == 3
    assert engine.abort(rid)
    assert not engine.seqs and not engine.output.groups and not engine.has_unfinished()
    engine.check_integrity()
    assert engine.blocks.stats().in_use == 0


def test_async_stream_ends_after_all_choices(tiny_llama: LoadedModel) -> None:
    aengine = AsyncEngine(LLMEngine(tiny_llama, EngineConfig(kv_memory="8MiB", kv_dtype="model"))).start()
    try:
        async def main() -> dict[int, list[int]]:
            got: dict[int, list[int]] = {}
            async for out in aengine.generate(PROMPT, sampled(2)):
                got.setdefault(out.index, []).extend(out.new_token_ids)
            return got

        got = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert sorted(got) == [0, 1] and all(len(t) == 8 for t in got.values())
