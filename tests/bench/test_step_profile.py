"""The decode-step profiler: timing a model's parts changes none of its tokens or logprobs, puts every part back,
and splits a step into parts that add up to it."""

from __future__ import annotations

import pytest

from hafiza.bench.step_profile import PARTS, step_parts_ms, timed_parts
from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.models import LoadedModel, llama


def decode(model: LoadedModel) -> tuple[list[int], list[float]]:
    eng = LLMEngine(model, EngineConfig(kv_memory="16MiB", enable_prefix_caching=False))
    ids = model.tokenizer.encode("The keys and values of every token are kept, so each new token")
    out = eng.generate([ids], SamplingParams(max_tokens=6, temperature=0, logprobs=1))[0]
    return out.token_ids, [lp.logprob for lp in out.logprobs]


def test_timed_parts_change_no_value_and_put_everything_back(served_model: LoadedModel) -> None:
    model = served_model.model
    before = (model.lm_head, [vars(lw).copy() for lw in model.layers], llama.paged_attention, llama.rms_norm)
    plain = decode(served_model)
    with timed_parts(model) as clock:
        timed = decode(served_model)
    assert timed == plain
    assert (model.lm_head, [vars(lw) for lw in model.layers], llama.paged_attention, llama.rms_norm) == before
    assert all(clock.seconds[p] > 0 for p in PARTS), clock.seconds
    step_s = sum(clock.seconds.values()) * 1.5
    parts = step_parts_ms(clock, step_s, 3)
    assert parts["step"] == pytest.approx(sum(parts[p] for p in (*PARTS, "other")))
    assert parts["other"] == pytest.approx(step_s * 1000 / 3 / 3)
