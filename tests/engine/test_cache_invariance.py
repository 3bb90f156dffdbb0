"""Greedy output does not depend on cache state (the default model as `hafiza serve` loads it, bf16 KV pool): the
same prompt gives the same tokens cold, warm from the pool, chunk-prefilled, batched with 15 others, preempted and
resumed, and loaded from a RAM tier. The fp32 reference weights (16-row tiles on the CPU) are checked batched with 15
others too; their row invariance is proven op by op in tests/models/test_linear_invariance.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.models import LoadedModel
from hafiza.store.connector import StoreConnector
from hafiza.store.memory import MemoryStore
from hafiza.store.tiered import TieredStore

pytestmark = pytest.mark.slow  # long generations with the real model
TEXTS = Path(__file__).resolve().parents[2] / "bench" / "texts"
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
NUM_PROMPTS, MIN_LEN, MAX_LEN = 52, 36, 80


def held_in_prompts(model: LoadedModel) -> list[list[int]]:
    """NUM_PROMPTS prompts of MIN_LEN..MAX_LEN tokens cut from every held-in text, plus the chat prompt whose warm
    answer once differed from its cold one."""
    files = sorted(TEXTS.glob("*.txt"))
    streams = [model.tokenizer.encode(f.read_text(), add_special=False) for f in files]
    prompts = [model.tokenizer.encode(model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List three colors of the rainbow."}]), add_special=False)]
    i = 0
    while len(prompts) < NUM_PROMPTS:
        ids = streams[i % len(streams)]
        n = MIN_LEN + (i * 7) % (MAX_LEN - MIN_LEN)
        start = (i // len(streams)) * 97 % max(1, len(ids) - n)
        prompts.append(ids[start : start + n])
        i += 1
    return prompts


def engine(model: LoadedModel, **opts: object) -> LLMEngine:
    return LLMEngine(model, EngineConfig(**{"kv_memory": "64MiB", "max_num_seqs": 16, **opts}))  # bf16 KV


def batched(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    """Prompts submitted 16 at a time (continuous batching over each group): results in prompt order."""
    return [r for i in range(0, len(prompts), 16) for r in eng.generate(prompts[i : i + 16], params)]


def tokens(results: list) -> list[list[int]]:
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def prompts(served_model: LoadedModel) -> list[list[int]]:
    return held_in_prompts(served_model)


@pytest.fixture(scope="module")
def cold(served_model: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt alone on an engine that caches nothing: the reference every other mode must reproduce."""
    eng = engine(served_model, enable_prefix_caching=False)
    return [eng.generate([p], GREEDY)[0].token_ids for p in prompts]


def test_default_pool_is_bf16(served_model: LoadedModel) -> None:
    assert engine(served_model).kv_dtype == "bf16"


def test_fp32_weights_batched_with_fifteen_others(default_model: LoadedModel, prompts: list[list[int]]) -> None:
    """The fp32 reference weights: 16 prompts, each alone on an engine that caches nothing, then all 16 at once."""
    group = prompts[:16]
    alone = [engine(default_model, enable_prefix_caching=False).generate([p], GREEDY)[0].token_ids for p in group]
    assert tokens(batched(engine(default_model, enable_prefix_caching=False), group)) == alone


def test_batched_with_fifteen_others(served_model: LoadedModel, prompts: list[list[int]],
                                     cold: list[list[int]], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="hafiza"):
        assert tokens(batched(engine(served_model, enable_prefix_caching=False), prompts)) == cold
    assert not caplog.records  # every step ran as one batch: no forward failed and was retried request by request


def test_warm_from_the_pool(served_model: LoadedModel, prompts: list[list[int]], cold: list[list[int]]) -> None:
    """First the prompt's first 32 tokens come from an earlier, different request (the rest is one new span), then
    every full block of the prompt comes from the pool (a pool that holds all of them)."""
    eng = engine(served_model, kv_memory="256MiB")
    batched(eng, [p[:32] + [p[-1]] * 3 for p in prompts], SamplingParams(max_tokens=1, temperature=0))
    prefix = batched(eng, prompts)
    assert all(r.num_cached_tokens == 32 for r in prefix) and tokens(prefix) == cold
    warm = batched(eng, prompts)
    assert all(r.num_cached_tokens == (len(p) - 1) // 16 * 16 for r, p in zip(warm, prompts, strict=True))
    assert tokens(warm) == cold


def test_chunked_prefill(served_model: LoadedModel, prompts: list[list[int]], cold: list[list[int]]) -> None:
    """21 tokens per step: prompts are prefilled in odd-sized chunks beside other requests' decodes."""
    eng = engine(served_model, max_num_batched_tokens=21, enable_prefix_caching=False)
    assert tokens(batched(eng, prompts)) == cold


def test_preempted_and_resumed(served_model: LoadedModel, prompts: list[list[int]], cold: list[list[int]]) -> None:
    """A pool of 40 blocks for 16 concurrent requests: sequences are preempted and recomputed (mostly from the
    prefix cache) mid-generation."""
    probe = engine(served_model)
    eng = engine(served_model, kv_memory=40 * probe.bytes_per_block)
    got = tokens(batched(eng, prompts))
    assert eng.scheduler.num_preemptions > 0
    assert got == cold


def test_loaded_from_a_ram_tier(served_model: LoadedModel, prompts: list[list[int]], cold: list[list[int]]) -> None:
    """One engine writes the prompts' blocks to a RAM tier; a second engine, with an empty pool, loads them."""
    store = TieredStore([MemoryStore(256 << 20)])
    writer = engine(served_model)
    conn = StoreConnector.for_engine(writer, store)
    writer.attach_connector(conn)
    batched(writer, prompts)
    assert conn.flush()
    reader = engine(served_model)
    reader_conn = StoreConnector.for_engine(reader, store)
    reader.attach_connector(reader_conn)
    assert tokens(batched(reader, prompts)) == cold
    assert reader_conn.stats.blocks_loaded >= 2 * len(prompts)
