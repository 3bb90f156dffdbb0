"""The speculative tier codec on a tiny model and a real redis-server: bit-identical KV across instances, every
decode failure recomputed with a correct answer, and the cost model's plan following its measured inputs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from hafiza.cache.hashing import chain_hashes
from hafiza.codec import container
from hafiza.engine import LLMEngine
from hafiza.models import LoadedModel, load_model
from hafiza.store.connector import StoreConnector
from hafiza.store.cost import CostModel
from hafiza.store.memory import MemoryStore
from hafiza.store.redis_store import RedisStore
from hafiza.store.tiered import TieredStore
from tests.support.redis_server import RedisServer

from .conftest import unique_prefix
from .engine_support import cold, engine_with, frozen, prompt_ids, serve

N = 72  # tokens: 4 full blocks of 16 can come from the store (the last token is always computed)
BS = 16


def redis_engine(model: LoadedModel, server: RedisServer, prefix: str) -> tuple[LLMEngine, StoreConnector]:
    """An engine whose only tier is Redis (under `prefix`) with the speculative codec."""
    engine, conn = engine_with(model, TieredStore([RedisStore(server.url, prefix=prefix, name="redis")]),
                               codec="speculative")
    assert conn is not None
    return engine, conn


def pool_blocks(engine: LLMEngine, hashes: list[str]) -> torch.Tensor:
    return engine.kv.read_blocks([engine.blocks.hash_to_block[h] for h in hashes])


def test_block_written_by_one_instance_decodes_bit_identically_in_another(tiny_llama: LoadedModel,
                                                                          redis_server: RedisServer) -> None:
    ids = prompt_ids(tiny_llama, N)
    prefix = unique_prefix()
    a_engine, a = redis_engine(tiny_llama, redis_server, prefix)
    frozen(a, prefill_tps=1.0, predict_tps=1e9)  # worth predicting, and worth loading, whatever the machine's load
    reference = serve(a_engine, ids).tokens
    assert a.flush() and a.stats.encoded_blocks >= 4 and a.stats.encode_errors == 0
    hashes = chain_hashes(ids, BS, (*a_engine.extra_keys, None))[:4]
    stored = a.store.tiers[0].get(a.key(hashes[2]))
    assert stored is not None
    header, _, _ = container.read(stored)
    assert (header.coder_id, header.predictor_id) == (3, 2)  # the predictive coder over the speculative predictor

    b_engine, b = redis_engine(tiny_llama, redis_server, prefix)
    frozen(b, prefill_tps=1.0, predict_tps=1e9)
    got = serve(b_engine, ids)
    assert got.tokens == reference == cold(tiny_llama, ids)
    assert got.external == 4 * BS and got.sources == {"redis": 4 * BS}
    assert got.decision.startswith("load: predict+decode:")
    assert b.stats.decisions["predict"] == 1 and b.stats.decode_fallbacks == 0 and b.stats.predictor_seconds > 0
    assert torch.equal(pool_blocks(b_engine, hashes), pool_blocks(a_engine, hashes))
    a.close()
    b.close()


def test_mismatched_prediction_and_corrupt_entry_are_recomputed(tiny_dirs: dict[str, Path], tiny_llama: LoadedModel,
                                                                redis_server: RedisServer) -> None:
    ids = prompt_ids(tiny_llama, N)
    prefix = unique_prefix()
    a_engine, a = redis_engine(tiny_llama, redis_server, prefix)
    frozen(a, prefill_tps=1.0, predict_tps=1e9)  # worth predicting, and worth loading, whatever the machine's load
    serve(a_engine, ids)
    assert a.flush()

    # Same files, so the same fingerprint and keys, but weights changed in memory: this instance's K/V and its
    # predictor's rerun both differ from the encoder's; its answer must be its own cold run.
    other = load_model(tiny_dirs["llama"], dtype="fp32", device="cpu")
    other.model.layers[0].input_norm.mul_(1.5)
    b_engine, b = redis_engine(other, redis_server, prefix)
    frozen(b, prefill_tps=1.0, predict_tps=1e9)
    got = serve(b_engine, ids)
    assert got.tokens == cold(other, ids)
    assert got.external == 0 and "predictor's rerun differs" in got.decision
    assert b.stats.prediction_mismatches == 1 and b.stats.decode_fallbacks == 1 and b.stats.blocks_corrupt == 0
    b.close()

    # A damaged RAM entry (RAM has no frame: the codec's checksum catches it) is dropped and recomputed.
    ram = MemoryStore(64 << 20, name="ram")
    c_engine, c = engine_with(tiny_llama, TieredStore([ram]), codec="speculative")
    assert c is not None
    frozen(c, prefill_tps=1.0, predict_tps=1e9)  # every block worth predicting, whatever the machine's load
    reference = serve(c_engine, ids).tokens
    assert c.flush()
    hashes = chain_hashes(ids, BS, (*c_engine.extra_keys, None))
    bad = c.key(hashes[1])
    value = bytearray(ram.get(bad) or b"")
    value[len(value) // 2] ^= 0x40
    ram.put(bad, bytes(value))
    d_engine, d = engine_with(tiny_llama, TieredStore([ram]), codec="speculative")
    assert d is not None
    frozen(d, prefill_tps=1.0, predict_tps=1e9)  # loading beats recomputing: the damaged entry is read
    got = serve(d_engine, ids)
    assert got.tokens == reference and got.external == BS
    assert "only 1 of 4 blocks arrived intact" in got.decision and "ChecksumError" in got.decision
    assert d.stats.blocks_corrupt == 1 and d.stats.decode_fallbacks == 1
    assert d.flush()  # dropped, recomputed and written again intact (in the fallback codec if not worth predicting)
    rewritten = ram.get(bad) or ram.get(d._fallback_key(0, hashes[1]) or "")
    assert rewritten not in (None, bytes(value))
    a.close()
    d.close()


def test_plan_follows_tier_speed_prefill_speed_and_predictor_speed(tiny_llama: LoadedModel,
                                                                   redis_server: RedisServer) -> None:
    ids = prompt_ids(tiny_llama, N)
    prefix = unique_prefix()
    a_engine, a = redis_engine(tiny_llama, redis_server, prefix)
    reference = serve(a_engine, ids).tokens
    assert a.flush()

    def admit(set_up: Callable[[CostModel], None]) -> tuple[str, int, list[int]]:
        """A fresh instance over A's blocks, its cost model given `set_up`'s measurements, serving the prompt."""
        engine, conn = redis_engine(tiny_llama, redis_server, prefix)
        set_up(conn.store.cost)
        got = serve(engine, ids)
        conn.close()
        return got.decision, got.external, got.tokens

    def fast_prefill(cost: CostModel) -> None:
        cost.set_prefill_rate(1e12)

    def slow_tier(cost: CostModel) -> None:
        cost.set_prefill_rate(1000.0)
        cost.observe_predict(1_000_000, 1.0)
        cost.observe_load("redis", 1_000, 10.0)  # 100 bytes/s

    def slow_predictor(cost: CostModel) -> None:
        cost.set_prefill_rate(1000.0)
        cost.observe_predict(10, 100.0)  # 0.1 tokens/s

    def fast_everything(cost: CostModel) -> None:
        cost.set_prefill_rate(1.0)  # 1 token/s: loading wins
        cost.observe_predict(1_000_000, 1.0)

    for set_up in (fast_prefill, slow_tier, slow_predictor):
        decision, external, tokens = admit(set_up)
        assert decision.startswith("recompute:") and external == 0 and tokens == reference, set_up.__name__
    loaded = admit(fast_everything)
    assert loaded[0].startswith("load: predict+decode:") and loaded[1] == 4 * BS and loaded[2] == reference
    a.close()


def test_each_tier_its_own_codec_and_promotion_reencodes(tiny_llama: LoadedModel, redis_server: RedisServer) -> None:
    """zstd in RAM, speculative in Redis: each tier holds its own coding; a Redis hit is promoted into RAM as zstd."""
    ids = prompt_ids(tiny_llama, N)
    prefix = unique_prefix()

    def stack() -> TieredStore:
        return TieredStore([MemoryStore(64 << 20, name="ram"), RedisStore(redis_server.url, prefix=prefix,
                                                                          name="redis")])

    a_engine, a = engine_with(tiny_llama, stack(), codec="zstd", tier_codecs={"redis": "speculative"})
    assert a is not None and a.codecs == ["zstd", "speculative"]
    reference = serve(a_engine, ids).tokens
    assert a.flush()
    h = chain_hashes(ids, BS, (*a_engine.extra_keys, None))[0]
    ram, rds = a.store.tiers
    assert ":zstd:" in a.key(h, 0) and ":speculative:" in a.key(h, 1)
    assert ram.contains(a.key(h, 0)) and rds.contains(a.key(h, 1)) and not rds.contains(a.key(h, 0))

    b_engine, b = engine_with(tiny_llama, stack(), codec="zstd", tier_codecs={"redis": "speculative"})
    assert b is not None
    got = serve(b_engine, ids)
    assert got.tokens == reference and got.sources == {"redis": 4 * BS}
    assert got.decision.startswith("load: predict+decode:")
    assert b.flush() and b.store.tiers[0].contains(b.key(h, 0))  # promoted into RAM, re-encoded with zstd
    header, _, _ = container.read(b.store.tiers[0].get(b.key(h, 0)) or b"")
    assert header.predictor_id == 0
    a.close()
    b.close()
