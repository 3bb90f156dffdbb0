"""Continuous batching under memory pressure: preemption instead of failure, identical greedy output,
no leaked blocks; aborts; requests that can never fit; prefix reuse across turns."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hafiza.engine import CachePin, EngineConfig, LLMEngine, SamplingParams
from hafiza.errors import RequestError
from hafiza.models import LoadedModel
from tests.support.examples import examples

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def small_engine(lm: LoadedModel, kv_memory: str | int = "4MiB", **kw) -> LLMEngine:
    return LLMEngine(lm, EngineConfig(kv_memory=kv_memory, kv_dtype="model", block_size=4, **kw))


def test_64_concurrent_requests_on_a_small_pool_match_solo_runs(tiny_llama: LoadedModel) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(50, 40000) for _ in range(rng.randrange(2, 60))] for _ in range(64)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 24), temperature=0, ignore_eos=True) for _ in prompts]
    solo = []
    for p, sp in zip(prompts, params, strict=True):
        solo.append(small_engine(tiny_llama).generate([p], sp)[0].token_ids)
    per_block = small_engine(tiny_llama).bytes_per_block
    engine = small_engine(tiny_llama, kv_memory=40 * per_block, max_num_batched_tokens=64)
    assert engine.layout.num_blocks == 40  # far less than 64 requests need together
    for p, sp in zip(prompts, params, strict=True):
        engine.add_request(p, sp)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.check_integrity()
    assert engine.stats().num_preemptions > 0
    assert [outputs[f"req-{i}"] for i in range(64)] == solo
    s = engine.stats().blocks
    assert s.in_use == 0 and s.free + s.cached == s.total


def test_abort_frees_blocks(tiny_llama: LoadedModel) -> None:
    engine = small_engine(tiny_llama)
    rid = engine.add_request(list(range(100, 150)), GREEDY)
    engine.step()
    assert engine.stats().blocks.in_use > 0
    assert engine.abort(rid)
    engine.check_integrity()
    assert engine.stats().blocks.in_use == 0 and not engine.has_unfinished()
    assert not engine.abort(rid)


def test_never_fitting_requests_are_rejected_with_numbers(tiny_llama: LoadedModel) -> None:
    per_block = small_engine(tiny_llama).bytes_per_block
    engine = small_engine(tiny_llama, kv_memory=10 * per_block)
    with pytest.raises(RequestError, match=r"needs 13 KV blocks but the pool has 10 \(40 tokens\)"):
        engine.add_request(list(range(100, 140)), SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="exceeds the model's context of 1024"):
        small_engine(tiny_llama, kv_memory="64MiB").add_request([5] * 1000, SamplingParams(max_tokens=100))
    with pytest.raises(RequestError, match="prompt is empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(RequestError, match="top_p"):
        engine.add_request([5], SamplingParams(top_p=0))
    engine.check_integrity()


def test_second_turn_reuses_first_turns_blocks(default_model: LoadedModel) -> None:
    engine = LLMEngine(default_model, EngineConfig(kv_memory="64MiB"))
    tok = default_model.tokenizer
    turn1 = [{"role": "system", "content": "You are a terse assistant. " * 8},
             {"role": "user", "content": "Name three rivers in Europe."}]
    prompt1 = tok.encode(tok.apply_chat_template(turn1))
    first = engine.generate([prompt1], SamplingParams(max_tokens=24, temperature=0))[0]
    assert first.num_cached_tokens == 0
    turn2 = [*turn1, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And in Asia?"}]
    prompt2 = tok.encode(tok.apply_chat_template(turn2))
    second = engine.generate([prompt2], SamplingParams(max_tokens=8, temperature=0))[0]
    assert second.num_cached_tokens >= len(prompt1) // 16 * 16 > 0
    assert engine.blocks.prefix_cache_hits >= second.num_cached_tokens


def test_max_tokens_zero_fills_the_cache(tiny_llama: LoadedModel) -> None:
    engine = small_engine(tiny_llama)
    prompt = list(range(200, 241))
    res = engine.generate([prompt], SamplingParams(max_tokens=0))[0]
    assert res.token_ids == [] and res.finish_reason == "length"
    again = engine.generate([prompt], SamplingParams(max_tokens=0))[0]
    assert again.num_cached_tokens == 40


def test_pins_survive_memory_pressure(tiny_llama: LoadedModel) -> None:
    per_block = small_engine(tiny_llama).bytes_per_block
    engine = small_engine(tiny_llama, kv_memory=16 * per_block)
    pinned = list(range(300, 332))
    engine.add_request(pinned, SamplingParams(max_tokens=0), pins=[CachePin(32, 300.0)])
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().blocks.pinned == 8
    for i in range(6):  # churn through the rest of the pool
        engine.generate([list(range(1000 + 100 * i, 1030 + 100 * i))], SamplingParams(max_tokens=2))
    engine.check_integrity()
    res = engine.generate([[*pinned, 7]], SamplingParams(max_tokens=1))[0]
    assert res.num_cached_tokens == 32


def test_stop_strings_and_seeded_sampling(default_model: LoadedModel) -> None:
    engine = LLMEngine(default_model, EngineConfig(kv_memory="64MiB"))
    res = engine.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0, stop=["."]))[0]
    assert res.finish_reason == "stop_sequence" and res.text == " Paris"
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_k=40, top_p=0.9, seed=1234)
    a, b = engine.generate(["Once upon a time"] * 2, [sp, sp])
    assert a.token_ids == b.token_ids


@settings(max_examples=examples(0.12), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "step", "abort"]), st.integers(1, 40), st.integers(0, 3)),
                min_size=1, max_size=40))
def test_engine_invariants_under_random_request_streams(tiny_llama: LoadedModel, stream: list) -> None:
    per_block = small_engine(tiny_llama).bytes_per_block
    engine = small_engine(tiny_llama, kv_memory=24 * per_block, max_num_batched_tokens=24)
    shared = list(range(500, 540))
    ids: list[str] = []
    for op, n, k in stream:
        if op == "add":
            prompt = shared[: n] if k < 2 else [*shared[:n], *range(900, 900 + k * 5)]
            ids.append(engine.add_request(prompt, SamplingParams(max_tokens=k + 1, temperature=0)))
        elif op == "abort" and ids:
            engine.abort(ids[n % len(ids)])
        else:
            engine.step()
        engine.check_integrity()
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    assert engine.stats().blocks.in_use == 0


def test_admission_records_where_the_prompt_came_from(tiny_llama: LoadedModel) -> None:
    prompt = list(range(200, 241))
    engine = small_engine(tiny_llama)
    first = engine.generate([prompt], SamplingParams(max_tokens=0))[0]
    assert first.num_cached_tokens == 0
    engine.add_request(prompt, SamplingParams(max_tokens=0))
    (out,) = engine.step()
    assert out.tiers is not None and out.tiers.pool_tokens == out.num_cached_tokens == 40
    assert (out.tiers.decision, out.tiers.reason, out.tiers.loaded_tokens) == ("none", "no tiers are attached", 0)
    assert engine.blocks.prefix_cache_queries == 2 * len(prompt) and engine.blocks.prefix_cache_hits == 40

    off = small_engine(tiny_llama, enable_prefix_caching=False)
    off.generate([prompt], SamplingParams(max_tokens=0))
    off.add_request(prompt, SamplingParams(max_tokens=0))
    (out,) = off.step()
    assert out.tiers is not None and (out.tiers.reason, out.tiers.cached_tokens) == ("prefix caching is off", 0)
    assert off.blocks.prefix_cache_queries == off.blocks.prefix_cache_hits == 0
    off.check_integrity()
