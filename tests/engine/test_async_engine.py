"""AsyncEngine: concurrent coroutines stream their own outputs; a consumer that stops early frees its blocks."""

from __future__ import annotations

import asyncio

import pytest

from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.engine.async_engine import AsyncEngine
from hafiza.errors import RequestError
from hafiza.models import LoadedModel


@pytest.fixture
def aengine(tiny_llama: LoadedModel):
    engine = AsyncEngine(LLMEngine(tiny_llama, EngineConfig(kv_memory="8MiB", kv_dtype="model"))).start()
    yield engine
    engine.shutdown()


def test_concurrent_streams_match_sync_generation(aengine: AsyncEngine, tiny_llama: LoadedModel) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [list(range(100 + i, 120 + 3 * i)) for i in range(8)]
    expect = LLMEngine(tiny_llama, EngineConfig(kv_memory="8MiB", kv_dtype="model")).generate(prompts, params)

    async def one(p: list[int]) -> list[int]:
        return [t async for out in aengine.generate(p, params) for t in out.new_token_ids]

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(main()) == [r.token_ids for r in expect]


def test_consumer_leaving_early_aborts_and_frees(aengine: AsyncEngine) -> None:
    async def main() -> int:
        stream = aengine.generate(list(range(200, 260)), SamplingParams(max_tokens=200, temperature=0,
                                                                         ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(100):
            in_use = await aengine.call(lambda e: e.stats().blocks.in_use)
            if in_use == 0:
                return 0
            await asyncio.sleep(0.01)
        return in_use

    assert asyncio.run(main()) == 0


def test_bad_request_raises_before_streaming(aengine: AsyncEngine) -> None:
    async def main() -> None:
        async for _ in aengine.generate([], SamplingParams()):
            pass

    with pytest.raises(RequestError, match="empty"):
        asyncio.run(main())
