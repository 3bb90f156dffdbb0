"""Acceptance at engine level: restart from disk, two instances through one redis-server, and faults (redis
killed and restarted, damaged disk files and Redis values, unwritable or full disk). Every request must be
answered with the output of a run without any store."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry

from hafiza.cache.hashing import chain_hashes
from hafiza.engine import LLMEngine, RequestOutput
from hafiza.models import LoadedModel
from hafiza.server.store_metrics import register_store_metrics
from hafiza.store.connector import StoreConnector
from hafiza.store.disk import DiskStore
from hafiza.store.memory import MemoryStore
from hafiza.store.redis_store import RedisStore
from hafiza.store.tiered import TieredStore
from tests.support.redis_server import RedisServer

from .conftest import unique_prefix
from .engine_support import GREEDY, cold, engine_with, prompt_ids, serve

BS = 16
LABELS = {"tier": "redis", "kind": "redis"}


def keys_of(engine: LLMEngine, conn: StoreConnector, ids: list[int]) -> list[str]:
    """Store keys of the full blocks of `ids` as the engine names them."""
    return [conn.key(h) for h in chain_hashes(ids, BS, (*engine.extra_keys, None))]


def test_restart_serves_a_2000_token_prompt_from_disk(default_model: LoadedModel, tmp_path: Path) -> None:
    """Two engines, one after the other, on the same disk directory (the default model, 2,000 tokens)."""
    ids = prompt_ids(default_model, 2000)
    first, conn = engine_with(default_model, TieredStore([DiskStore(tmp_path, 1 << 30)]), kv_memory="160MiB")
    a = serve(first, ids)  # the store is empty: this is the cold run
    assert a.cached == 0 and a.decision.startswith("miss")
    assert conn is not None
    conn.close()
    del first

    second, conn2 = engine_with(default_model, TieredStore([DiskStore(tmp_path, 1 << 30)]), kv_memory="160MiB")
    b = serve(second, ids)
    assert b.tokens == a.tokens
    assert b.cached == b.external == 1984 and b.sources == {"disk": 1984}
    assert b.decision.startswith("load")
    assert conn2 is not None
    conn2.close()


def test_two_instances_share_blocks_through_one_redis(tiny_llama: LoadedModel, redis_server: RedisServer) -> None:
    ids = prompt_ids(tiny_llama, 800)
    prefix = unique_prefix()
    a_engine, a = engine_with(tiny_llama, TieredStore([MemoryStore(64 << 20), RedisStore(redis_server.url,
                                                                                        prefix=prefix)]))
    b_engine, b = engine_with(tiny_llama, TieredStore([MemoryStore(64 << 20), RedisStore(redis_server.url,
                                                                                        prefix=prefix)]))
    on_a = serve(a_engine, ids)
    assert a is not None and a.flush()
    on_b = serve(b_engine, ids)
    assert on_b.tokens == on_a.tokens == cold(tiny_llama, ids)
    assert on_b.external == on_b.cached == 784 and on_b.sources == {"redis": 784}
    assert b is not None and b.store.tiers[0].contains(b.key(chain_hashes(ids, BS, (*b_engine.extra_keys, None))[0]))
    for c in (a, b):
        c.store.tiers[1].clear()
        c.close()


def test_redis_killed_mid_run_then_restarted(tiny_llama: LoadedModel, own_redis: RedisServer,
                                             caplog: pytest.LogCaptureFixture) -> None:
    prompts = [prompt_ids(tiny_llama, 700, offset=100 * i) for i in range(4)]
    expected = [cold(tiny_llama, p) for p in prompts]

    def store() -> TieredStore:
        return TieredStore([RedisStore(own_redis.url, prefix="t:", retry_interval_s=0.2)])

    with caplog.at_level(logging.WARNING, logger="hafiza.store"):
        writer, w = engine_with(tiny_llama, store())
        assert serve(writer, prompts[0]).tokens == expected[0]
        assert w is not None and w.flush()

        reader, r = engine_with(tiny_llama, store())
        assert r is not None
        registry = CollectorRegistry()
        register_store_metrics(registry, r.store)
        reader.add_request(prompts[1], GREEDY)
        reader.step()  # the first chunk of prompt 1 is computed and its blocks queued for Redis
        own_redis.kill()
        tokens = [t for out in drain(reader) for t in out.new_token_ids]
        assert tokens == expected[1]
        during = serve(reader, prompts[0])  # was in Redis: now unreachable, so recomputed
        assert during.tokens == expected[0] and during.external == 0
        assert registry.get_sample_value("hafiza:store_degraded", LABELS) == 1.0
        assert r.store.tiers[0].stats().errors >= 1

        own_redis.start()  # same port, empty
        time.sleep(0.3)  # past retry_interval_s: the next call reconnects
        after = serve(reader, prompts[2])
        assert after.tokens == expected[2]
        assert r.flush() and not r.store.tiers[0].degraded
        assert registry.get_sample_value("hafiza:store_degraded", LABELS) == 0.0

        third, t = engine_with(tiny_llama, store())
        hit = serve(third, prompts[2])
        assert hit.tokens == expected[2] and hit.sources == {"redis": hit.external} and hit.external == 688
    messages = [rec.getMessage() for rec in caplog.records]
    assert any("degraded" in m for m in messages) and any("reconnected" in m for m in messages)
    for c in (w, r, t):
        assert c is not None
        c.close()


def drain(engine: LLMEngine) -> list[RequestOutput]:
    """Step until every request has finished; all outputs."""
    out: list[RequestOutput] = []
    while engine.has_unfinished():
        out += engine.step()
    return out


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_disk_file_is_detected_dropped_and_recomputed(tiny_llama: LoadedModel, tmp_path: Path,
                                                              damage: str) -> None:
    ids = prompt_ids(tiny_llama, 300)
    first, conn = engine_with(tiny_llama, TieredStore([DiskStore(tmp_path, 64 << 20)]))
    reference = serve(first, ids).tokens
    assert conn is not None
    conn.close()

    disk = DiskStore(tmp_path, 64 << 20)
    path = disk.path_of(keys_of(first, conn, ids)[5])
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        del data[-100:]
    path.write_bytes(bytes(data))

    second, conn2 = engine_with(tiny_llama, TieredStore([disk]))
    b = serve(second, ids)
    assert b.tokens == reference
    assert b.external == 5 * BS and "only 5 of 18 blocks" in b.decision
    assert disk.stats().errors == 1
    assert conn2 is not None and conn2.flush()
    assert path.exists()  # recomputed and written again
    conn2.close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_redis_value_is_detected_dropped_and_recomputed(tiny_llama: LoadedModel, redis_server: RedisServer,
                                                                damage: str) -> None:
    ids = prompt_ids(tiny_llama, 300)
    prefix = unique_prefix()
    first, conn = engine_with(tiny_llama, TieredStore([RedisStore(redis_server.url, prefix=prefix)]))
    reference = serve(first, ids).tokens
    assert conn is not None and conn.flush()

    client = redis.Redis.from_url(redis_server.url)
    rkey = prefix + keys_of(first, conn, ids)[4]
    data = client.get(rkey)
    assert data is not None
    if damage == "flip":
        client.setrange(rkey, len(data) - 10, bytes([data[-10] ^ 0x80]))
    else:
        client.set(rkey, data[: len(data) // 3], keepttl=True)

    tier = RedisStore(redis_server.url, prefix=prefix)
    second, conn2 = engine_with(tiny_llama, TieredStore([tier]))
    b = serve(second, ids)
    assert b.tokens == reference
    assert b.external == 4 * BS and b.sources == {"redis": 4 * BS}
    assert tier.stats().errors == 1
    assert conn2 is not None and conn2.flush()
    assert client.get(rkey) is not None  # recomputed and written again
    client.close()
    tier.clear()
    conn.close()
    conn2.close()


def test_unwritable_disk_tier_disables_itself_and_serving_continues(
    tiny_llama: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a regular file where the store directory should be")
    ids = prompt_ids(tiny_llama, 300)
    with caplog.at_level(logging.ERROR, logger="hafiza.store"):
        disk = DiskStore(blocker / "kv", 64 << 20)
        ram = MemoryStore(64 << 20)
        engine, conn = engine_with(tiny_llama, TieredStore([ram, disk]))
        first = serve(engine, ids)
        assert conn is not None and conn.flush()
    assert first.tokens == cold(tiny_llama, ids)
    assert not disk.enabled and ram.stats().puts == (300 + GREEDY.max_tokens) // BS
    lines = [r.getMessage() for r in caplog.records if "disabled" in r.getMessage()]
    assert len(lines) == 1 and "serving continues" in lines[0]

    again, conn2 = engine_with(tiny_llama, TieredStore([ram, disk]))
    second = serve(again, ids)
    assert second.tokens == first.tokens and second.sources == {"ram": 288}
    conn.close()
    assert conn2 is not None
    conn2.close()


def test_full_disk_tier_disables_itself_and_serving_continues(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A real short write (RLIMIT_FSIZE, enforced even for root) in a process serving with a disk tier."""
    script = textwrap.dedent(
        """
        import json, logging, resource, signal, sys
        from hafiza.models import load_model
        from hafiza.store.disk import DiskStore
        from hafiza.store.tiered import TieredStore
        from tests.store.engine_support import engine_with, prompt_ids, serve
        logging.basicConfig(level=logging.ERROR, format="%(message)s")
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        model = load_model(sys.argv[1], dtype="fp32", device="cpu")
        prompts = [prompt_ids(model, 300, offset=400 * i) for i in range(3)]
        reference = [serve(engine_with(model, None)[0], p).tokens for p in prompts]
        disk = DiskStore(sys.argv[2], 1 << 30)
        engine, conn = engine_with(model, TieredStore([disk]))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))  # smaller than any stored block
        served = [serve(engine, p).tokens for p in prompts]
        conn.flush()
        print(json.dumps({"same": served == reference, "enabled": disk.enabled, "errors": disk.stats().errors,
                          "entries": disk.stats().entries}))
        """
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", script, str(tiny_dirs["llama"]), str(tmp_path / "kv")],
                         capture_output=True, text=True, check=True, cwd=root, timeout=600)
    result = json.loads(out.stdout)
    assert result == {"same": True, "enabled": False, "errors": 1, "entries": 0}
    assert out.stderr.count("disabled") == 1 and "File too large" in out.stderr
