"""The real vllm-router (cache_aware) in front of 2 real hafiza workers that check API keys, all on loopback: the
deployment docs/CLUSTER.md calls safe (the router holds no key; each tenant's key is forwarded for chat and
completions). Chat gets affinity from the workers' render routes, a routed request is answered as a direct one
(answer, usage, cache headers), tenants' cache partitions hold, and what the router drops is refused."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from openai import OpenAI

from hafiza.cluster import Cluster, Layout
from tests.cluster.test_router import prompt_tokens
from tests.server.test_vllm_fields import ROUTER_CHAT
from tests.support.redis_server import redis_available

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not redis_available(), reason="redis-server is not installed")]

TENANT_A, TENANT_B = "tenant-a-key", "tenant-b-key"
RENDER_OK = re.compile(r'"POST /v1/chat/completions/render HTTP/1\.1" 200')


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    layout = Layout.on_free_ports(2, policy="cache_aware", worker_args=(
        "--kv-memory", "256MiB", "--api-key", TENANT_A, "--api-key", TENANT_B))
    running = Cluster(layout, Path(tmp_path_factory.mktemp("cache-aware"))).start()
    yield running
    running.stop()


def client(url: str, key: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def workers(cluster: Cluster) -> list[str]:
    return [w.url for w in cluster.layout.workers]


def served_by(cluster: Cluster, before: list[float]) -> list[int]:
    """The workers whose finished prompt tokens grew since `before`."""
    return [i for i, (u, b) in enumerate(zip(workers(cluster), before, strict=True)) if prompt_tokens(u) > b]


def renders(cluster: Cluster) -> int:
    """Chat render calls the workers answered 200 (their access logs)."""
    return sum(len(RENDER_OK.findall((cluster.log_dir / f"worker{i}.log").read_text(errors="replace")))
               for i in range(len(cluster.layout.workers)))


def system(tag: str) -> str:
    return f"You are the {tag} desk. Answer in one short sentence and name the desk. " * 8


def test_chat_users_of_one_system_prompt_land_on_one_worker(cluster: Cluster) -> None:
    router = client(cluster.layout.url, TENANT_A)
    rendered = renders(cluster)
    for tag in ("travel", "billing", "weather"):
        before = [prompt_tokens(u) for u in workers(cluster)]
        for user in range(3):
            router.chat.completions.create(model="hafiza", max_tokens=2, temperature=0, messages=[
                {"role": "system", "content": system(tag)}, {"role": "user", "content": f"User {user}: hello"}])
        assert len(served_by(cluster, before)) == 1, f"the {tag} prompt's users went to several workers"
    assert renders(cluster) >= rendered + 9  # the router asked the workers for token ids for every request


def test_a_routed_chat_is_answered_as_a_direct_one(cluster: Cluster) -> None:
    messages = [{"role": "system", "content": system("library")}, {"role": "user", "content": "Name a book."}]
    router = client(cluster.layout.url, TENANT_A)
    router.chat.completions.create(model="hafiza", max_tokens=6, temperature=0, messages=messages)
    before = [prompt_tokens(u) for u in workers(cluster)]
    raw = router.chat.completions.with_raw_response.create(model="hafiza", max_tokens=6, temperature=0,
                                                           messages=messages)
    (worker,) = served_by(cluster, before)
    routed = raw.parse()
    body: dict[str, Any] = {"model": "hafiza", "max_tokens": 6, "temperature": 0, "messages": messages, **ROUTER_CHAT}
    direct = httpx.post(f"{workers(cluster)[worker]}/v1/chat/completions", json=body, timeout=120,
                        headers={"authorization": f"Bearer {TENANT_A}"})
    assert direct.status_code == 200, direct.text
    out = direct.json()
    assert routed.choices[0].message.content == out["choices"][0]["message"]["content"]
    assert routed.usage is not None and routed.usage.model_dump(exclude_none=True) == out["usage"]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    for header in ("x-hafiza-cache", "x-hafiza-tiers"):
        assert raw.headers.get(header) == direct.headers.get(header), header
    assert direct.headers["x-hafiza-cache"].startswith("hit")


def test_keys_are_checked_behind_the_router(cluster: Cluster) -> None:
    url = cluster.layout.url
    body = {"model": "hafiza", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        client(url, "wrong-key").chat.completions.create(**body)  # type: ignore[call-overload]
    assert client(url, TENANT_B).completions.create(model="hafiza", prompt="Hi", max_tokens=1).usage is not None


def test_messages_and_responses_lose_the_key_at_the_router(cluster: Cluster) -> None:
    def ask(url: str) -> None:
        anthropic.Anthropic(base_url=url, api_key=TENANT_A, max_retries=0).messages.create(
            model="hafiza", max_tokens=1, messages=[{"role": "user", "content": "hi"}])

    ask(workers(cluster)[0])  # straight to a worker the key is good
    with pytest.raises(anthropic.AuthenticationError):
        ask(cluster.layout.url)
    with pytest.raises(openai.AuthenticationError):
        client(cluster.layout.url, TENANT_A).responses.create(model="hafiza", input="hi", max_output_tokens=16)


def test_tenant_partitions_hold_through_the_router(cluster: Cluster) -> None:
    messages = [{"role": "system", "content": system("private")}, {"role": "user", "content": "Hello."}]

    def cached(key: str, **extra: Any) -> tuple[int, list[int]]:
        before = [prompt_tokens(u) for u in workers(cluster)]
        out = client(cluster.layout.url, key).chat.completions.create(
            model="hafiza", max_tokens=1, temperature=0, messages=messages, **extra)
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        return out.usage.prompt_tokens_details.cached_tokens or 0, served_by(cluster, before)

    first, where = cached(TENANT_A)
    again, where_again = cached(TENANT_A)
    other, where_other = cached(TENANT_B)
    salted, where_salted = cached(TENANT_A, extra_body={"cache_salt": "another-session"})
    assert first == 0 and again > 0
    assert other == 0 and salted == 0
    assert where == where_again == where_other == where_salted  # same worker: the partition, not routing, kept it
