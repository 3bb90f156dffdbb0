"""One request never harms another: every accepted sampling parameter samples safely, and a request whose
sampling or forward raises fails alone while its batch-mates finish with unchanged output."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.engine.async_engine import AsyncEngine, EngineDeadError
from hafiza.engine.sampling import SEED_RANGE
from hafiza.errors import RequestError
from hafiza.models import LoadedModel
from tests.support.examples import examples

CONFIG = EngineConfig(kv_memory="8MiB", kv_dtype="model")
VICTIMS = [list(range(300 + 7 * i, 330 + 9 * i)) for i in range(3)]
VICTIM_PARAMS = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                 SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
                 SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)]


def fresh_params(i: int) -> SamplingParams:
    """A new copy of victim i's params (a seeded generator is made per request from the seed)."""
    p = VICTIM_PARAMS[i]
    return SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, seed=p.seed,
                          ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama: LoadedModel) -> LLMEngine:
    return LLMEngine(tiny_llama, CONFIG)


@pytest.fixture(scope="module")
def alone(tiny_llama: LoadedModel) -> list[list[int]]:
    """Each victim's tokens when it runs by itself on a fresh engine."""
    return [LLMEngine(tiny_llama, CONFIG).generate([p], fresh_params(i))[0].token_ids for i, p in enumerate(VICTIMS)]


def run_with_victims(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[list, list]:
    results = engine.generate([*VICTIMS, prompt], [*(fresh_params(i) for i in range(len(VICTIMS))), params])
    return results[: len(VICTIMS)], results[-1:]


temperatures = st.one_of(st.just(0.0), st.sampled_from([5e-324, 1e-300, 1e-45, 1e-8, 0.0099, 0.01, 100.0]),
                         st.floats(min_value=0.0, max_value=100.0, allow_subnormal=True))
seeds = st.one_of(st.none(), st.sampled_from(list(SEED_RANGE)), st.integers(*SEED_RANGE))


@settings(max_examples=examples(0.25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(temperature=temperatures, top_p=st.floats(min_value=0.0, max_value=1.0, exclude_min=True),
       top_k=st.integers(0, 50_000), seed=seeds, max_tokens=st.integers(0, 4),
       prompt=st.lists(st.integers(0, 1000), min_size=1, max_size=40))
def test_every_accepted_parameter_samples_and_leaves_batch_mates_alone(
        engine: LLMEngine, alone: list[list[int]], temperature: float, top_p: float, top_k: int, seed: int | None,
        max_tokens: int, prompt: list[int]) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            ignore_eos=True)
    params.validate()
    victims, (mine,) = run_with_victims(engine, prompt, params)
    assert mine.error is None and mine.finish_reason == "length" and len(mine.token_ids) == max_tokens
    assert all(0 <= t < engine.loaded.config.vocab_size for t in mine.token_ids)
    assert [v.token_ids for v in victims] == alone
    engine.check_integrity()


@pytest.mark.parametrize("temperature", [1e-45, 1e-300, 5e-324])
def test_tiny_temperature_samples_like_the_floor(tiny_llama: LoadedModel, temperature: float) -> None:
    """A temperature below the floor draws exactly what the floor draws with the same seed."""
    prompt = list(range(40, 70))
    got = LLMEngine(tiny_llama, CONFIG).generate([prompt], SamplingParams(max_tokens=5, temperature=temperature,
                                                                          seed=3, ignore_eos=True))[0]
    floor = LLMEngine(tiny_llama, CONFIG).generate([prompt], SamplingParams(max_tokens=5, temperature=0.01,
                                                                            seed=3, ignore_eos=True))[0]
    assert got.error is None and got.token_ids == floor.token_ids


@pytest.mark.parametrize("seed", [SEED_RANGE[0] - 1, SEED_RANGE[1] + 1, 2**200])
def test_seed_outside_the_generator_range_is_refused(seed: int) -> None:
    with pytest.raises(RequestError, match="seed must be between"):
        SamplingParams(seed=seed).validate()


def test_request_whose_sampling_raises_fails_alone(tiny_llama: LoadedModel, alone: list[list[int]]) -> None:
    """A NaN temperature (set after validation, as a sampler bug would) makes multinomial raise for that row."""
    aengine = AsyncEngine(LLMEngine(tiny_llama, CONFIG)).start()
    try:
        async def collect(prompt: list[int], params: SamplingParams) -> list[int] | BaseException:
            try:
                return [t async for out in aengine.generate(prompt, params) for t in out.new_token_ids]
            except EngineDeadError as exc:
                return exc

        async def collect_bad() -> int | BaseException:
            params = SamplingParams(max_tokens=6, temperature=0.5, ignore_eos=True)
            got = 0
            try:
                async for out in aengine.generate(list(range(500, 540)), params):
                    got += len(out.new_token_ids)
                    params.temperature = float("nan")
            except EngineDeadError as exc:
                return exc
            return got

        async def main() -> list[list[int] | int | BaseException]:
            return await asyncio.gather(*(collect(p, fresh_params(i)) for i, p in enumerate(VICTIMS)), collect_bad())

        *victims, failed = asyncio.run(main())
        assert isinstance(failed, EngineDeadError) and "sampling failed" in str(failed)
        assert victims == alone

        async def in_use() -> int:
            return await aengine.call(lambda e: e.stats().blocks.in_use + len(e.seqs))

        assert asyncio.run(in_use()) == 0
    finally:
        aengine.shutdown()


def test_request_whose_forward_raises_fails_alone(tiny_llama: LoadedModel, alone: list[list[int]]) -> None:
    """A token id past the vocabulary (slipped in after validation) makes the embedding raise for that request:
    the batch is rerun one request at a time and only that request fails."""
    engine = LLMEngine(tiny_llama, CONFIG)
    ids = [engine.add_request(p, fresh_params(i)) for i, p in enumerate(VICTIMS)]
    bad = engine.add_request(list(range(600, 650)), SamplingParams(max_tokens=4, temperature=0))
    engine.seqs[bad].token_ids[10] = tiny_llama.config.vocab_size + 5
    tokens: dict[str, list[int]] = {i: [] for i in [*ids, bad]}
    errors: dict[str, str | None] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                errors[out.request_id] = out.error
    assert errors[bad] is not None and "forward failed" in errors[bad] and tokens[bad] == []
    assert [tokens[i] for i in ids] == alone and all(errors[i] is None for i in ids)
    engine.check_integrity()
    assert engine.stats().blocks.in_use == 0
