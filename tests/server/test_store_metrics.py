"""Prometheus export of the KV store's tier stack."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from hafiza.server.store_metrics import register_store_metrics
from hafiza.store.disk import DiskStore
from hafiza.store.memory import MemoryStore
from hafiza.store.redis_store import RedisStore
from hafiza.store.tiered import TieredStore
from tests.support.redis_server import RedisServer


def test_metrics_per_tier(tmp_path: Path, own_redis: RedisServer) -> None:
    rds = RedisStore(own_redis.url, prefix="m:", retry_interval_s=60.0)
    ts = TieredStore([MemoryStore(1 << 20, name="ram"), DiskStore(tmp_path, 1 << 20, name="disk"), rds])
    registry = CollectorRegistry()
    register_store_metrics(registry, ts)
    ts.put_async("a", b"x" * 100, raw_nbytes=250)
    ts.put_async("b", b"y" * 100, raw_nbytes=250)
    ts.flush(timeout=30)
    ts.tiers[0].delete("a")
    ts.lookup_prefix(["a", "b", "c"])
    got = ts.load(["a", "b"])
    ts.put_async("a", got.values[0], targets=[0])  # the promotion the connector does for a disk hit
    ts.flush(timeout=30)

    def sample(name: str, tier: str, kind: str) -> float | None:
        return registry.get_sample_value(name, {"tier": tier, "kind": kind})

    assert sample("hafiza:store_entries", "ram", "memory") == 2.0
    assert sample("hafiza:store_entries", "disk", "disk") == 2.0
    assert sample("hafiza:store_entries", "redis", "redis") is None  # unknown for a shared server
    assert sample("hafiza:store_hits_total", "ram", "memory") == 1.0
    assert sample("hafiza:store_misses_total", "ram", "memory") == 1.0
    assert sample("hafiza:store_hits_total", "disk", "disk") == 1.0
    assert sample("hafiza:store_puts_total", "redis", "redis") == 2.0
    assert sample("hafiza:store_lookup_hits_total", "disk", "disk") == 1.0
    assert sample("hafiza:store_compression_ratio", "disk", "disk") == 2.5
    assert sample("hafiza:store_errors_total", "redis", "redis") == 0.0
    assert sample("hafiza:store_degraded", "redis", "redis") == 0.0
    assert sample("hafiza:store_enabled", "disk", "disk") == 1.0
    assert sample("hafiza:store_load_seconds_count", "disk", "disk") == 1.0
    assert sample("hafiza:store_save_seconds_count", "ram", "memory") == 3.0  # 2 writes + 1 promotion
    assert (
        registry.get_sample_value("hafiza:store_load_seconds_bucket", {"tier": "ram", "kind": "memory", "le": "+Inf"})
        == 1.0
    )
    assert registry.get_sample_value("hafiza:store_lookup_keys_total") == 3.0
    assert registry.get_sample_value("hafiza:store_write_queue_depth") == 0.0

    own_redis.kill()
    ts.lookup_prefix(["a", "b", "c"])  # RAM and disk still answer; Redis fails and is marked degraded
    text = generate_latest(registry).decode()
    assert 'hafiza:store_degraded{kind="redis",tier="redis"} 1.0' in text
    assert sample("hafiza:store_errors_total", "redis", "redis") == 1.0
    ts.close(timeout=5)
