"""CLI option parsing: sizes, --store-disk, --store-redis, and the tier stack they build."""

from __future__ import annotations

from pathlib import Path

import pytest

from hafiza.store.config import (
    DEFAULT_DISK_BYTES,
    StoreConfigError,
    build_tiers,
    parse_disk_spec,
    parse_redis_url,
)
from hafiza.store.disk import DiskStore
from hafiza.store.memory import MemoryStore
from hafiza.store.redis_store import RedisStore
from tests.support.redis_server import RedisClusterServers, RedisServer


def test_parse_disk_spec() -> None:
    assert parse_disk_spec("/var/kv:20GiB") == (p := parse_disk_spec("/var/kv:20GiB")) and p.path == "/var/kv"
    assert p.capacity_bytes == 20 << 30
    assert parse_disk_spec("/var/kv").capacity_bytes == DEFAULT_DISK_BYTES
    assert parse_disk_spec("/odd:dir").path == "/odd:dir"  # a suffix that is no size stays in the path
    assert parse_disk_spec("rel/dir:100").capacity_bytes == 100
    with pytest.raises(StoreConfigError):
        parse_disk_spec(":2G")


def test_parse_redis_url() -> None:
    single = parse_redis_url("redis://10.0.0.5:6380/2")
    assert (single.url, single.cluster, single.prefix, single.ttl_s) == (
        "redis://10.0.0.5:6380/2", False, "hafiza:", 300.0,
    )  # fmt: skip
    cluster = parse_redis_url("redis+cluster://node1:7000?prefix=team-a:&ttl=300")
    assert (cluster.url, cluster.cluster, cluster.prefix, cluster.ttl_s) == (
        "redis://node1:7000", True, "team-a:", 300.0,
    )  # fmt: skip
    flagged = parse_redis_url("rediss://user:pw@node1:7000?cluster=1&ttl=none&socket_timeout=3")
    assert flagged.cluster and flagged.ttl_s is None
    assert flagged.url == "rediss://user:pw@node1:7000?socket_timeout=3"
    assert parse_redis_url("unix:///run/redis.sock").url == "unix:///run/redis.sock"


@pytest.mark.parametrize(
    "url", ["http://h:1", "redis://", "redis://h:1?ttl=soon", "redis://h:1?ttl=-1", "unix+cluster:///s"]
)
def test_parse_redis_url_rejects(url: str) -> None:
    with pytest.raises(StoreConfigError):
        parse_redis_url(url)


def test_build_tiers_orders_ram_disk_redis(
    tmp_path: Path, redis_server: RedisServer, redis_cluster: RedisClusterServers
) -> None:
    ts = build_tiers("1MiB", f"{tmp_path}:2Mi", f"{redis_server.url}?prefix=cfg-test:&ttl=60")
    ram, disk, rds = ts.tiers
    assert isinstance(ram, MemoryStore) and ram.capacity_bytes == 1 << 20
    assert isinstance(disk, DiskStore) and disk.root == tmp_path and disk.capacity_bytes == 2 << 20
    assert isinstance(rds, RedisStore) and not rds.cluster and rds.default_ttl_s == 60.0
    assert ts.names == ["ram", "disk", "redis"]
    assert ts.put_async("k", b"v") and ts.flush(timeout=30)
    assert ts.lookup_prefix(["k"]).sources == ["ram"]
    rds.clear()
    ts.close()

    port = redis_cluster.nodes[0].port
    only = build_tiers(None, None, f"redis+cluster://127.0.0.1:{port}?prefix=cfg-test:")
    (crds,) = only.tiers
    assert isinstance(crds, RedisStore) and crds.cluster
    assert crds.put("k", b"v") and crds.get("k") == b"v"
    crds.clear()
    only.close()

    empty = build_tiers(None, None, None)
    assert empty.tiers == [] and empty.lookup_prefix(["k"]).num_hits == 0
    assert empty.put_async("k", b"v") is False and empty.load(["k"]).values == []
    empty.close()
