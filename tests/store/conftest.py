"""Fixtures: real redis-server processes (one shared server, one 3-master cluster) and a store factory."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from hafiza.store.base import KVStore
from hafiza.store.disk import DiskStore
from hafiza.store.memory import MemoryStore
from hafiza.store.redis_store import RedisStore
from tests.support.redis_server import RedisClusterServers, RedisServer, redis_available

needs_redis = pytest.mark.skipif(not redis_available(), reason="redis-server is not installed")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server shared by the session (tests isolate themselves with unique key prefixes)."""
    if not redis_available():
        pytest.skip("redis-server is not installed")
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    """Three cluster-enabled masters joined by `redis-cli --cluster create`."""
    if not redis_available():
        pytest.skip("redis-server is not installed")
    with RedisClusterServers(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture
def raw_redis(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A plain client on the shared server, for inspecting and damaging stored values."""
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def unique_prefix() -> str:
    return f"test-{uuid.uuid4().hex[:12]}:"


BACKENDS = ["memory", "disk", "redis", "redis-cluster"]
StoreFactory = Callable[..., KVStore]


@pytest.fixture(params=BACKENDS)
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreFactory]:
    """A factory of fresh stores of one back end (every test using it runs once per back end)."""
    made: list[KVStore] = []

    def factory(capacity_bytes: int = 64 << 20) -> KVStore:
        kind = request.param
        store: KVStore
        if kind == "memory":
            store = MemoryStore(capacity_bytes)
        elif kind == "disk":
            store = DiskStore(tmp_path / f"disk{len(made)}", capacity_bytes)
        elif kind == "redis":
            server = request.getfixturevalue("redis_server")
            store = RedisStore(server.url, prefix=unique_prefix())
        else:
            cluster = request.getfixturevalue("redis_cluster")
            store = RedisStore(cluster.url, cluster=True, prefix=unique_prefix())
        made.append(store)
        return store

    yield factory
    for store in made:
        store.clear()
        store.close()
