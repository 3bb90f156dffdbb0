"""Cache partitions reach the store tiers: with a real redis-server as the only tier, a request of one partition
(`cache_salt`, API key) never loads another partition's blocks, and every partition writes keys of its own."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import redis

from hafiza.engine import EngineConfig, LLMEngine
from hafiza.engine.async_engine import AsyncEngine
from hafiza.models import LoadedModel
from hafiza.server import ServerSettings, create_app
from hafiza.server.launch import ServerThread, served_name
from hafiza.server.store import StoreOptions, connect_store, serve_store
from hafiza.store.connector import StoreConnector
from tests.server.conftest import long_text
from tests.support.redis_server import RedisServer, redis_available

ALICE, BOB = "tier-alice-1", "tier-bob-2"


@dataclass
class Site:
    """One engine with a Redis tier, served twice: open (salts only) and with two API keys."""

    model: str
    open: ServerThread
    keyed: ServerThread
    connector: StoreConnector
    redis: redis.Redis

    def ask(self, url: str, text: str, salt: str | None = None, key: str | None = None) -> httpx.Response:
        """One request after emptying the KV pool, so that anything reused must come from Redis."""
        with httpx.Client(base_url=url, timeout=300) as c:
            admin = {"x-api-key": "tier-admin"} if url == self.keyed.url else {}
            assert c.post("/dashboard/tiers/pool/clear", json={}, headers=admin).status_code == 200
            body: dict[str, object] = {"model": self.model, "max_tokens": 1, "temperature": 0,
                                       "messages": [{"role": "user", "content": text}]}
            if salt is not None:
                body["cache_salt"] = salt
            r = c.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"} if key else {})
        assert r.status_code == 200, r.text
        assert self.connector.flush(60.0)
        return r

    def keys(self) -> int:
        return int(self.redis.dbsize())


def cached(r: httpx.Response) -> int:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def site(default_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    if not redis_available():
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path_factory.mktemp("redis-security")).start()
    engine = LLMEngine(default_model, EngineConfig(kv_memory="64MiB", kv_dtype="model"))
    connector = connect_store(engine, StoreOptions(redis=server.url))
    aengine = AsyncEngine(engine)
    model = served_name(default_model)
    open_app = create_app(aengine, ServerSettings(model_name=model))
    keyed_app = create_app(aengine, ServerSettings(model_name=model, api_keys=(ALICE, BOB), admin_key="tier-admin"))
    for app in (open_app, keyed_app):
        serve_store(app, connector)
    aengine.start()
    threads = [ServerThread(open_app).start(), ServerThread(keyed_app).start()]
    client = redis.Redis.from_url(server.url)
    yield Site(model, threads[0], threads[1], connector, client)
    client.close()
    for t in threads:
        t.stop()
    aengine.shutdown()
    connector.close()
    server.stop()


def tiers(r: httpx.Response) -> dict[str, str]:
    return dict(p.strip().split("=", 1) for p in r.headers["x-hafiza-tiers"].split(";") if "=" in p)


def test_a_salt_never_loads_another_salts_blocks_from_redis(site: Site) -> None:
    text = long_text("tier-salt", 300)
    first = site.ask(site.open.url, text, salt="a")
    written = site.keys()
    assert cached(first) == 0 and written >= 18
    other = site.ask(site.open.url, text, salt="b")
    assert cached(other) == 0 and tiers(other).get("redis", "0") == "0"
    assert site.keys() == 2 * written  # salt b wrote a key for every block: none is shared with salt a
    plain = site.ask(site.open.url, text)
    assert cached(plain) == 0 and site.keys() == 3 * written
    again = site.ask(site.open.url, text, salt="a")
    assert cached(again) >= 288 and int(tiers(again)["redis"]) == cached(again)  # its own blocks, from Redis


def test_api_keys_never_load_each_others_blocks_from_redis(site: Site) -> None:
    text = long_text("tier-keys", 300)
    before = site.keys()
    assert cached(site.ask(site.keyed.url, text, key=ALICE)) == 0
    written = site.keys() - before
    assert written >= 18
    assert cached(site.ask(site.keyed.url, text, key=BOB)) == 0
    assert site.keys() - before == 2 * written
    assert cached(site.ask(site.keyed.url, text, key=ALICE)) >= 288
