"""Acceptance with the real `hafiza serve` (default model) as subprocesses: restart from `--store-disk`, two
instances sharing one redis-server, and redis-server killed mid-run and restarted under both instances."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hafiza.models import LoadedModel
from tests.support.redis_server import RedisServer, redis_available

from .serve_support import Answer, ServeProcess, prompt_text

BS = 16


def reusable(prompt_tokens: int) -> int:
    """Whole blocks before the last prompt token: the most any cache can serve."""
    return (prompt_tokens - 1) // BS * BS


def test_restart_serves_a_2000_token_prompt_from_disk(default_model: LoadedModel, tmp_path: Path) -> None:
    text = prompt_text(default_model.tokenizer, 2000)
    disk = str(tmp_path / "kv")

    first = ServeProcess(tmp_path / "first.log", "--store-disk", disk).wait_ready()
    try:
        cold = first.chat(text)
    finally:
        assert first.stop(), first.output()  # SIGTERM: pending writes are flushed before exit
    assert cold.prompt_tokens >= 2000 and cold.cached_tokens == 0
    assert cold.tiers()["decision"] == "miss" and cold.tiers()["computed"] == str(cold.prompt_tokens)

    second = ServeProcess(tmp_path / "second.log", "--store-disk", disk).wait_ready()
    try:
        warm = second.chat(text)
        disk_hits = second.metric("hafiza:store_hits_total", tier="disk")
    finally:
        assert second.stop(), second.output()
    assert warm.text == cold.text
    assert warm.prompt_tokens == cold.prompt_tokens
    assert warm.cached_tokens == reusable(warm.prompt_tokens)
    tiers = warm.tiers()
    assert tiers["decision"] == "load" and int(tiers["disk"]) == warm.cached_tokens and tiers["pool"] == "0"
    assert warm.cache_header.startswith("hit; reused=")
    assert disk_hits is not None and disk_hits >= warm.cached_tokens // BS
    assert "Traceback" not in first.output() + second.output()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, ServeProcess, ServeProcess]]:
    """One redis-server and two `hafiza serve` instances using it (no RAM or disk tier: Redis alone)."""
    if not redis_available():
        pytest.skip("redis-server is not installed")
    root = tmp_path_factory.mktemp("pair")
    server = RedisServer(root).start()
    a = ServeProcess(root / "a.log", "--store-redis", server.url)
    b = ServeProcess(root / "b.log", "--store-redis", server.url)
    try:
        a.wait_ready()
        b.wait_ready()
        yield server, a, b
    finally:
        codes = (a.stop(), b.stop())
        server.stop()
    assert all(codes), a.output() + b.output()


def test_two_instances_share_a_prefill_through_redis(default_model: LoadedModel,
                                                     pair: tuple[RedisServer, ServeProcess, ServeProcess]) -> None:
    _, a, b = pair
    text = prompt_text(default_model.tokenizer, 1500, offset=200)
    on_a = a.chat(text)
    assert_recomputed(on_a)
    wait_written(a)
    on_b = b.chat(text)
    assert on_b.text == on_a.text
    assert_from_redis(on_b)


def assert_recomputed(answer: Answer) -> None:
    """Nothing came from the store: at most the shared chat-template block from the instance's own pool."""
    tiers = answer.tiers()
    assert tiers["decision"] == "miss" and "redis" not in tiers, answer.tiers_header
    assert answer.cached_tokens == int(tiers["pool"]) <= BS


def assert_from_redis(answer: Answer) -> None:
    """Every reusable token was cached; all but the instance's own pool hit came from Redis."""
    tiers = answer.tiers()
    assert tiers["decision"] == "load", answer.tiers_header
    assert answer.cached_tokens == reusable(answer.prompt_tokens)
    assert int(tiers["redis"]) == answer.cached_tokens - int(tiers["pool"]) > answer.prompt_tokens // 2


def wait_written(server: ServeProcess, timeout_s: float = 60.0) -> None:
    """Wait until the instance has encoded and written every block it saved (writes are asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while (server.metric("hafiza:store_encode_queue_bytes") or server.metric("hafiza:store_write_queue_depth")):
        assert time.monotonic() < deadline, "store writes still pending"
        time.sleep(0.1)


def test_redis_killed_mid_run_and_restarted(default_model: LoadedModel,
                                           pair: tuple[RedisServer, ServeProcess, ServeProcess]) -> None:
    redis_server, a, b = pair
    texts = [prompt_text(default_model.tokenizer, 600, offset=1000 + 600 * i) for i in range(3)]
    before = a.chat(texts[0])  # Redis up: computed on A and written down
    wait_written(a)

    during: list[Answer] = []
    mid = threading.Thread(target=lambda: during.append(a.chat(texts[1])))
    mid.start()
    time.sleep(0.5)
    redis_server.kill()  # while A is prefilling texts[1]
    mid.join()
    on_b = b.chat(texts[0])  # in Redis, but Redis is gone: recomputed on B
    assert on_b.text == before.text
    assert_recomputed(on_b)
    for server in (a, b):
        assert server.metric("hafiza:store_degraded", tier="redis") == 1.0
        errors = server.metric("hafiza:store_errors_total", tier="redis")
        assert errors is not None and errors >= 1

    redis_server.start()  # same port, empty
    time.sleep(2.5)  # past the tier's 2 s retry interval: the next call reconnects
    first_after = a.chat(texts[2])
    assert_recomputed(first_after)
    wait_written(a)
    recomputed_on_b = b.chat(texts[1])  # A could not write it while Redis was down
    assert recomputed_on_b.text == during[0].text
    assert_recomputed(recomputed_on_b)
    hit = b.chat(texts[2])
    assert hit.text == first_after.text
    assert_from_redis(hit)
    for server in (a, b):
        assert server.metric("hafiza:store_degraded", tier="redis") == 0.0
        assert "reconnected" in server.output()
