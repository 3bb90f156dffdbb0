"""StoreConnector on a tiny model: write-through, lookup, verified load, codecs, skips, TTLs, cost decisions."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from hafiza.cache.hashing import chain_hashes
from hafiza.engine import CachePin
from hafiza.models import LoadedModel
from hafiza.store.codecs import STORE_CODECS, StoreCodecError, check_codec
from hafiza.store.disk import DiskStore
from hafiza.store.memory import MemoryStore
from hafiza.store.redis_store import RedisStore
from hafiza.store.tiered import TieredStore
from tests.support.redis_server import RedisServer

from .conftest import unique_prefix
from .engine_support import cold, engine_with, prompt_ids, serve

N = 200  # tokens: 12 full blocks of 16 can come from the store (the last token is always computed)
BS = 16


@pytest.mark.parametrize("codec", STORE_CODECS)
def test_blocks_written_by_one_engine_are_loaded_by_the_next(tiny_llama: LoadedModel, tmp_path: Path,
                                                             codec: str) -> None:
    ids = prompt_ids(tiny_llama, N)
    first, conn = engine_with(tiny_llama, TieredStore([MemoryStore(64 << 20), DiskStore(tmp_path, 64 << 20)]),
                              codec=codec)
    a = serve(first, ids)
    assert (a.cached, a.external, a.sources) == (0, 0, {}) and a.decision.startswith("miss")
    assert conn is not None
    conn.close()
    assert conn.stats.encoded_blocks == N // BS and conn.stats.encode_errors == 0

    second, conn2 = engine_with(tiny_llama, TieredStore([DiskStore(tmp_path, 64 << 20)]), codec=codec)
    b = serve(second, ids)
    assert b.tokens == a.tokens == cold(tiny_llama, ids)
    assert b.external == b.cached == (N - 1) // BS * BS
    if codec == "speculative":  # blocks the cost model would not load predicted are stored in the fallback codec
        assert set(b.sources) <= {"disk", "disk.fast"} and sum(b.sources.values()) == b.external
        assert sum(conn.stats.encodes.values()) == N // BS
    else:
        assert b.sources == {"disk": b.external}
    assert b.decision.startswith("load")
    assert conn2 is not None and conn2.stats.blocks_loaded == (N - 1) // BS
    conn2.close()


def test_recompute_decision_is_reported_and_present_blocks_are_not_rewritten(tiny_llama: LoadedModel) -> None:
    ids = prompt_ids(tiny_llama, N)
    store = TieredStore([MemoryStore(64 << 20)])
    first, conn = engine_with(tiny_llama, store)
    serve(first, ids)
    assert conn is not None and conn.flush()
    puts = store.tiers[0].stats().puts

    store.cost.set_prefill_rate(1e15)  # recomputing is now "free": loading can never win
    second, conn2 = engine_with(tiny_llama, store)
    b = serve(second, ids)
    assert b.tokens == cold(tiny_llama, ids)
    assert (b.cached, b.external, b.sources) == (0, 0, {})
    assert b.decision.startswith("recompute:") and "tok/s" in b.decision
    assert conn2 is not None and conn2.flush()
    assert conn2.stats.saves == N // BS and conn2.stats.saves_skipped == N // BS
    assert store.tiers[0].stats().puts == puts


def test_entry_failing_the_codec_checksum_is_dropped_and_recomputed(tiny_llama: LoadedModel) -> None:
    """RAM entries carry no frame: the codec's own checksums must catch a damaged value."""
    ids = prompt_ids(tiny_llama, N)
    ram = MemoryStore(64 << 20)
    store = TieredStore([ram])
    first, conn = engine_with(tiny_llama, store)
    reference = serve(first, ids).tokens
    assert conn is not None and conn.flush()
    hashes = chain_hashes(ids, BS, (*first.extra_keys, None))
    bad = conn.key(hashes[3])
    value = bytearray(ram.get(bad) or b"")
    value[len(value) // 2] ^= 0x40
    ram.put(bad, bytes(value))

    second, conn2 = engine_with(tiny_llama, store)
    b = serve(second, ids)
    assert b.tokens == reference
    assert b.external == 3 * BS and b.sources == {"ram": 3 * BS}
    assert "only 3 of 12 blocks arrived intact" in b.decision
    assert conn2 is not None and conn2.stats.blocks_corrupt == 1
    assert conn2.flush() and ram.get(bad) is not None  # recomputed and written again, intact
    third, _ = engine_with(tiny_llama, store)
    assert serve(third, ids).external == (N - 1) // BS * BS


def test_pinned_prefix_gets_the_pin_ttl_in_redis(tiny_llama: LoadedModel, redis_server: RedisServer) -> None:
    ids = prompt_ids(tiny_llama, N)
    tier = RedisStore(redis_server.url, prefix=unique_prefix())
    engine, conn = engine_with(tiny_llama, TieredStore([tier]))
    serve(engine, ids, pins=(CachePin(num_tokens=100, ttl_s=3600.0),))
    assert conn is not None and conn.flush()
    hashes = chain_hashes(ids, BS, (*engine.extra_keys, None))
    ttls = [tier.ttl_s(conn.key(h)) for h in hashes]
    pinned = 100 // BS
    assert all(t is not None and 3590 < t <= 3600 for t in ttls[:pinned]), ttls
    assert all(t is not None and 290 < t <= 300 for t in ttls[pinned:]), ttls
    client = redis.Redis.from_url(redis_server.url)
    assert client.exists(tier.prefix + conn.key(hashes[0]))
    client.close()
    tier.clear()
    conn.close()


def test_unknown_codec_is_a_clear_error() -> None:
    assert check_codec("zstd") == "zstd"
    with pytest.raises(StoreCodecError, match="choose one of raw, zstd"):
        check_codec("gzip")


def test_lookup_failure_is_a_miss_not_an_engine_error(tiny_llama: LoadedModel) -> None:
    """`lookup` runs on the engine thread: a failure inside it (here a hash `block_key` rejects) is a miss."""
    _, conn = engine_with(tiny_llama, TieredStore([MemoryStore(64 << 20)]))
    assert conn is not None
    hit = conn.lookup(["not a hex hash"])
    assert (hit.num_blocks, hit.load) == (0, False) and hit.reason.startswith("miss: store lookup failed")
    assert conn.stats.lookup_errors == 1 and conn.stats.decisions["miss"] == 1
    conn.close()


def test_redis_auth_outage_mid_serving_changes_nothing(tiny_llama: LoadedModel, own_redis: RedisServer) -> None:
    """The server's password changes between two requests: answers stay right, and no thread sees an error
    (before, the encoder's `contains` raised ValueError from a connection closed under it)."""
    ids = prompt_ids(tiny_llama, N)
    tier = RedisStore(own_redis.url, prefix="t:", retry_interval_s=0.02)
    engine, conn = engine_with(tiny_llama, TieredStore([tier]))
    assert conn is not None
    first = serve(engine, ids)
    assert conn.flush()
    admin = redis.Redis(port=own_redis.port)
    admin.config_set("requirepass", "rotated")
    admin = redis.Redis(port=own_redis.port, password="rotated")
    admin.client_kill_filter(_type="normal", skipme=True)
    other = prompt_ids(tiny_llama, N, offset=N)
    second, conn2 = engine_with(tiny_llama, TieredStore([RedisStore(own_redis.url, prefix="t:")]))
    assert conn2 is not None
    b = serve(second, ids)  # the new engine cannot authenticate: every lookup is a miss, it recomputes
    c = serve(engine, other)  # the first engine's encoder now meets the auth failure on every block
    assert conn.flush() and conn2.flush()
    assert b.tokens == first.tokens == cold(tiny_llama, ids) and b.external == 0
    assert c.tokens == cold(tiny_llama, other)
    assert conn.stats.encode_errors == conn2.stats.encode_errors == 0
    assert conn.stats.lookup_errors == conn2.stats.lookup_errors == 0
    assert tier.outages >= 1
    admin.config_set("requirepass", "")
    conn.close()
    conn2.close()
