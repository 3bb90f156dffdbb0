"""The real vllm-router (kv_aware, KV events) in front of 2 real hafiza servers sharing a real redis-server,
driven with the openai and anthropic clients: affinity, the same answer as a direct request, and failover."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from anthropic import Anthropic
from openai import OpenAI

from hafiza.cluster import Cluster, Layout
from tests.support.redis_server import redis_available

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not redis_available(), reason="redis-server is not installed")]

SYSTEM = "You are a careful assistant who answers in one short sentence. " * 8


def prompt_tokens(url: str) -> float:
    """The worker's finished requests' prompt tokens, from its /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(r"^\S*prompt_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    assert m, "no prompt_tokens_total in /metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    layout = Layout.on_free_ports(2, worker_args=("--kv-memory", "256MiB"))
    running = Cluster(layout, Path(tmp_path_factory.mktemp("cluster"))).start()
    yield running
    running.stop()


def client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def announced_blocks(replay_port: int) -> int:
    """The most 16-token blocks one BlockStored event of the worker announced so far (asked on its replay socket)."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    most = 0
    try:
        while dealer.poll(5_000):
            _, _topic, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return most
            most = max([most, *(len(e["block_hashes"]) for e in msgpack.unpackb(payload)[1]
                                if e["type"] == "BlockStored")])
        raise AssertionError("the replay socket did not answer")
    finally:
        dealer.close()
        ctx.term()


def warm(cluster: Cluster, worker: int, system: str) -> None:
    """Prefill `system` on one worker directly and wait until its events announced the prompt's blocks."""
    w = cluster.layout.workers[worker]
    before = announced_blocks(w.replay)
    client(w.url).completions.create(model="hafiza", prompt=f"{system}\nUser: warm up", max_tokens=1, temperature=0)
    while announced_blocks(w.replay) <= before:
        pass


def test_all_users_of_one_system_prompt_land_on_the_worker_that_holds_it(cluster: Cluster) -> None:
    first = "Rivers carry silt and stories from the hills down to the sea. " * 8
    second = "Mountains keep their snow long after the valleys turn green. " * 8
    warm(cluster, 1, first)  # the worker a tie between idle workers would not pick
    warm(cluster, 0, second)
    workers = [w.url for w in cluster.layout.workers]
    router = client(cluster.layout.url)
    for system, holder in ((first, 1), (second, 0)):
        before = [prompt_tokens(u) for u in workers]
        for user in range(3):
            router.completions.create(model="hafiza", prompt=f"{system}\nUser {user}: hello", max_tokens=2,
                                      temperature=0)
        grew = [prompt_tokens(u) > b for u, b in zip(workers, before, strict=True)]
        assert grew == [i == holder for i in range(2)], f"users of one prompt went to {grew}, not worker {holder}"


def test_through_the_router_the_answer_and_usage_equal_a_direct_request(cluster: Cluster) -> None:
    body = {"model": "hafiza", "prompt": f"{SYSTEM}\nUser: name a colour", "max_tokens": 6, "temperature": 0}
    routed = client(cluster.layout.url).completions.create(**body)
    direct = client(cluster.layout.workers[0].url).completions.create(**body)
    assert routed.choices[0].text == direct.choices[0].text
    assert routed.usage.prompt_tokens == direct.usage.prompt_tokens  # type: ignore[union-attr]
    assert routed.usage.completion_tokens == direct.usage.completion_tokens  # type: ignore[union-attr]


def test_anthropic_messages_pass_through_the_router_with_the_direct_answer(cluster: Cluster) -> None:
    def ask(url: str) -> tuple[str, int, int]:
        msg = Anthropic(base_url=url, api_key="unused", max_retries=0).messages.create(
            model="hafiza", max_tokens=6, system=SYSTEM, extra_body={"temperature": 0},
            messages=[{"role": "user", "content": "Name a colour."}])
        block = msg.content[0]
        assert block.type == "text"
        return block.text, msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0), \
            msg.usage.output_tokens

    assert ask(cluster.layout.url) == ask(cluster.layout.workers[0].url)


def test_a_killed_worker_leaves_every_request_answered(cluster: Cluster) -> None:
    router = client(cluster.layout.url)
    first = router.completions.create(model="hafiza", prompt=f"{SYSTEM}\nUser: hi", max_tokens=3, temperature=0)
    victim = cluster.procs[1]  # worker 0: procs are redis, worker0, worker1, router
    victim.kill()
    victim.wait()
    answers = [router.completions.create(model="hafiza", prompt=f"{SYSTEM}\nUser: hi", max_tokens=3,
                                         temperature=0).choices[0].text for _ in range(4)]
    assert answers == [first.choices[0].text] * 4
