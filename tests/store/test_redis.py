"""Redis tier against real redis-server processes: TTL, prefixes, damaged values, outages, Redis Cluster."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from hafiza.store.redis_store import RedisStore
from tests.support.redis_server import RedisClusterServers, RedisServer

from .conftest import unique_prefix


def test_ttl_is_applied_and_honoured(redis_server: RedisServer, raw_redis: redis.Redis) -> None:
    store = RedisStore(redis_server.url, prefix=unique_prefix(), default_ttl_s=300.0)
    store.put("default", b"v")
    store.put("short", b"v", ttl_s=0.2)
    default_ttl, short_ttl = store.ttl_s("default"), store.ttl_s("short")
    assert default_ttl is not None and 299 <= default_ttl <= 300
    assert short_ttl is not None and 0 < short_ttl <= 0.2
    time.sleep(0.3)
    assert store.get("short") is None and not store.contains("short")
    assert store.get("default") == b"v"

    forever = RedisStore(redis_server.url, prefix=unique_prefix(), default_ttl_s=None)
    forever.put("k", b"v")
    assert raw_redis.pttl(forever.prefix + "k") == -1
    for s in (store, forever):
        s.clear()
        s.close()


def test_keys_live_under_the_prefix_and_clear_touches_nothing_else(
    redis_server: RedisServer, raw_redis: redis.Redis
) -> None:
    a = RedisStore(redis_server.url, prefix=unique_prefix())
    b = RedisStore(redis_server.url, prefix=unique_prefix())
    for i in range(1200):  # more than one SCAN batch
        a.put(f"k{i}", b"a")
    b.put("k0", b"b")
    assert raw_redis.exists(a.prefix + "k0") and a.get("k0") == b"a" and b.get("k0") == b"b"
    a.clear()
    assert a.get("k0") is None and a.get("k1199") is None
    assert b.get("k0") == b"b"
    b.clear()


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_damaged_value_is_detected_and_dropped(redis_server: RedisServer, raw_redis: redis.Redis, damage: str) -> None:
    store = RedisStore(redis_server.url, prefix=unique_prefix())
    store.put("k", os.urandom(4096))
    rkey = store.prefix + "k"
    data = raw_redis.get(rkey)
    assert data is not None
    if damage == "flip":
        raw_redis.setrange(rkey, len(data) // 2, bytes([data[len(data) // 2] ^ 0x10]))
    elif damage == "truncate":
        raw_redis.set(rkey, data[:-7], keepttl=True)
    else:
        raw_redis.set(rkey, b"written by something else")
    assert store.get("k") is None
    assert raw_redis.exists(rkey) == 0
    s = store.stats()
    assert (s.errors, s.misses, s.hits) == (1, 1, 0) and not s.degraded
    assert store.get_many(["k"]) == [None]
    store.close()


def test_server_killed_then_restarted(own_redis: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    store = RedisStore(own_redis.url, prefix="t:", retry_interval_s=0.2, connect_timeout_s=0.5)
    assert store.put("before", b"v") and store.get("before") == b"v"

    with caplog.at_level(logging.WARNING, logger="hafiza.store"):
        own_redis.kill()
        assert store.get("before") is None  # a miss, not an exception
        assert store.degraded and store.stats().degraded
        assert store.put("during", b"v") is False
        assert store.contains("before") is False
        assert store.get_many(["before", "during"]) == [None, None]
        assert store.contains_many(["before"]) == [False]
        assert store.delete("before") is False
        store.clear()
        errors_while_down = store.stats().errors
        assert errors_while_down >= 1

        own_redis.start()  # same port, empty (no persistence)
        time.sleep(0.25)  # past retry_interval_s: the next call probes the server again
        assert store.put("after", b"v2") is True
    assert not store.degraded and store.get("after") == b"v2"
    assert store.outages == 1
    messages = [r.getMessage() for r in caplog.records]
    assert sum("degraded" in m for m in messages) == 1
    assert sum("reconnected" in m for m in messages) == 1
    store.close()


def test_unreachable_at_start_is_degraded_not_an_exception() -> None:
    from tests.support.redis_server import free_port

    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", connect_timeout_s=0.5)
    assert store.put("k", b"v") is False and store.get("k") is None
    assert store.degraded and store.stats().errors == 1
    store.close()


def test_cluster_spreads_keys_over_slots_and_nodes(redis_cluster: RedisClusterServers) -> None:
    store = RedisStore(redis_cluster.url, cluster=True, prefix=unique_prefix(), default_ttl_s=60.0)
    keys = [f"block-{i}" for i in range(60)]
    values = {k: os.urandom(100 + i) for i, k in enumerate(keys)}
    for k in keys:
        assert store.put(k, values[k])
    per_node = []
    for node in redis_cluster.nodes:
        client = redis.Redis.from_url(node.url)
        per_node.append(sum(1 for _ in client.scan_iter(match=store.prefix + "*")))
        client.close()
    assert sum(per_node) == 60 and sum(1 for n in per_node if n) >= 2
    assert store.get_many(keys) == [values[k] for k in keys]
    assert store.contains_many([*keys, "absent"]) == [True] * 60 + [False]
    ttl = store.ttl_s(keys[0])
    assert ttl is not None and 0 < ttl <= 60
    store.clear()
    assert store.get_many(keys) == [None] * 60
    store.close()


def test_cluster_master_killed_then_restarted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with RedisClusterServers(tmp_path) as cluster:
        store = RedisStore(cluster.url, cluster=True, prefix="t:", retry_interval_s=0.1)
        keys = [f"k{i}" for i in range(30)]
        for k in keys:
            store.put(k, b"v")
        with caplog.at_level(logging.WARNING, logger="hafiza.store"):
            cluster.nodes[1].kill()
            assert store.get_many(keys) == [None] * 30 and store.degraded
            for _ in range(3):  # probes keep failing while one master is down: no flapping
                time.sleep(0.15)
                assert store.get(keys[0]) is None and store.degraded
            cluster.nodes[1].start()
            deadline = time.monotonic() + 60  # a hang guard, not a speed requirement
            while not store.put("after", b"v2") and time.monotonic() < deadline:
                time.sleep(0.15)
        assert not store.degraded and store.get("after") == b"v2"
        assert store.get_many(keys).count(b"v") >= 1  # keys on the surviving masters are still there
        messages = [r.getMessage() for r in caplog.records]
        assert sum("degraded" in m for m in messages) == 1
        assert sum("reconnected" in m for m in messages) == 1
        store.close()


class _Hammer:
    """Threads calling every RedisStore method in a loop; any exception that escapes a method is recorded."""

    def __init__(self, store: RedisStore, threads: int = 4) -> None:
        self.store = store
        self.escaped: list[str] = []
        self.calls = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(threads)]

    def _loop(self, i: int) -> None:
        s, n = self.store, 0
        value = os.urandom(64 << 10)
        while not self._stop.is_set():
            k = f"k{i}-{n % 16}"
            try:
                s.put(k, value)
                s.contains(k)
                s.get(k)
                s.get_many([k, f"k{i}-0"])
                s.contains_many([k, "absent"])
                s.ttl_s(k)
                s.stats()
                if n % 8 == 7:
                    s.delete(k)
            except Exception as e:  # the contract says this never happens
                self.escaped.append(f"{type(e).__name__}: {e}")
            self.calls += 1
            n += 1

    def __enter__(self) -> _Hammer:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)


def _wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _kill_clients(port: int, password: str | None) -> None:
    admin = redis.Redis(port=port, password=password)
    admin.client_kill_filter(_type="normal", skipme=True)
    admin.close()


@pytest.mark.parametrize("store_password", [None, "old-secret"])
def test_password_changed_mid_run_no_method_raises(own_redis: RedisServer, store_password: str | None) -> None:
    """An auth outage (the server's password changes under running clients, and back) never raises.

    Before, closing the broken client under the other threads raised `ValueError: I/O operation on closed
    file` (and AttributeError) out of `contains`, `get` and `put`.
    """
    admin = redis.Redis(port=own_redis.port)
    if store_password is not None:
        admin.config_set("requirepass", store_password)
        admin = redis.Redis(port=own_redis.port, password=store_password)
    url = f"redis://:{store_password}@127.0.0.1:{own_redis.port}/0" if store_password else own_redis.url
    store = RedisStore(url, prefix="t:", retry_interval_s=0.02)
    with _Hammer(store) as hammer:
        for cycle in range(6):
            _wait_for(lambda: store.put("probe", b"v"))  # serving with the right password
            calls = hammer.calls
            _wait_for(lambda c=calls: hammer.calls > c + 20)
            admin.config_set("requirepass", f"changed-{cycle}")
            admin = redis.Redis(port=own_redis.port, password=f"changed-{cycle}")
            _kill_clients(own_redis.port, f"changed-{cycle}")  # reconnects now fail authentication
            _wait_for(lambda: store.degraded)
            calls = hammer.calls
            _wait_for(lambda c=calls: hammer.calls > c + 20)
            admin.config_set("requirepass", store_password or "")
            admin = redis.Redis(port=own_redis.port, password=store_password)
    assert hammer.escaped == []
    assert store.outages >= 6 and store.stats().errors >= 6
    _wait_for(lambda: store.put("after", b"v2"))
    assert store.get("after") == b"v2" and not store.degraded
    store.close()


def test_server_killed_mid_run_no_method_raises(own_redis: RedisServer) -> None:
    store = RedisStore(own_redis.url, prefix="t:", retry_interval_s=0.02, connect_timeout_s=0.2)
    with _Hammer(store) as hammer:
        for _ in range(4):
            _wait_for(lambda: store.put("probe", b"v"))
            calls = hammer.calls
            _wait_for(lambda c=calls: hammer.calls > c + 20)
            own_redis.kill()
            _wait_for(lambda: store.degraded)
            calls = hammer.calls
            _wait_for(lambda c=calls: hammer.calls > c + 20)
            own_redis.start()
    assert hammer.escaped == []
    assert store.outages >= 4
    _wait_for(lambda: store.put("after", b"v2"))
    assert store.get("after") == b"v2"
    store.close()


def test_noeviction_refusals_log_one_line_per_interval(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A full server under `maxmemory noeviction` refuses every SET: counted each time, logged once."""
    admin = redis.Redis(port=own_redis.port)
    admin.config_set("maxmemory", str(2 << 20))
    admin.config_set("maxmemory-policy", "noeviction")
    store = RedisStore(own_redis.url, prefix="t:")
    value = os.urandom(100 << 10)
    with caplog.at_level(logging.WARNING, logger="hafiza.store"):
        results = [store.put(f"k{i}", value) for i in range(200)]
    refused = results.count(False)
    assert refused >= 150 and results[0] is True
    s = store.stats()
    assert s.errors == refused and not s.degraded
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1 and "OutOfMemoryError" in lines[0], lines
    store.close()
