"""The prefill/decode split through the shared tier: the real vllm-router (`--vllm-pd-disaggregation`) in front of
a real `hafiza serve --role prefill` and `--role decode` sharing a real redis-server, driven with the openai client.
Answers equal a colocated worker's (`--role both`); the decode worker loads the prompt's blocks from Redis rather
than computing them; with the Redis entries deleted or damaged it recomputes them and says so."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from openai import OpenAI

from hafiza.cluster import router_binary, wait_healthy
from hafiza.server.launch import free_port
from tests.support.redis_server import RedisServer, redis_available
from tests.support.serve import ServeProcess

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not redis_available(), reason="redis-server is not installed")]

BLOCK = 16


@dataclass
class Split:
    """The running processes: redis, the prefill and decode workers, a colocated worker, the router."""

    redis: RedisServer
    prefill: ServeProcess
    decode: ServeProcess
    colocated: ServeProcess
    router_url: str


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Split]:
    tmp = Path(tmp_path_factory.mktemp("pd"))
    server = RedisServer(tmp).start()
    common = ("--kv-memory", "256MiB", "--model-name", "hafiza")
    procs = [ServeProcess(tmp / "prefill.log", *common, "--role", "prefill", "--store-redis", server.url),
             ServeProcess(tmp / "decode.log", *common, "--role", "decode", "--store-redis", server.url),
             ServeProcess(tmp / "colocated.log", *common)]
    router: subprocess.Popen[bytes] | None = None
    try:
        for p in procs:
            p.wait_ready()
        port = free_port()
        log = (tmp / "router.log").open("w")
        router = subprocess.Popen([router_binary(), "--host", "127.0.0.1", "--port", str(port),
                                   "--vllm-pd-disaggregation", "--prefill", procs[0].url, "--decode", procs[1].url,
                                   "--prometheus-port", str(free_port())], stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, router, 120)
        yield Split(server, procs[0], procs[1], procs[2], url)
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        for p in procs:
            p.stop()
        server.stop()


def client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def tiers(raw: Any) -> str:
    return str(raw.headers.get("x-hafiza-tiers", ""))


def transfer_of(response: Any) -> dict[str, Any]:
    """The response's top-level kv_transfer_params (an extension field, kept by the openai client)."""
    extra = response.model_extra or {}
    value = extra.get("kv_transfer_params")
    assert isinstance(value, dict), f"no kv_transfer_params in {response}"
    return value


def test_answers_through_the_split_equal_the_colocated_run(split: Split) -> None:
    prompt = "The lighthouse keeper counted the ships that passed each night, and wrote " * 6
    body: dict[str, Any] = {"model": "hafiza", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    routed = client(split.router_url).completions.with_raw_response.create(**body)
    colocated = client(split.colocated.url).completions.create(**body)
    answer = routed.parse()
    assert answer.choices[0].text == colocated.choices[0].text
    assert answer.usage is not None and colocated.usage is not None
    assert answer.usage.completion_tokens == colocated.usage.completion_tokens
    header = tiers(routed)
    params = transfer_of(answer)
    blocks = (colocated.usage.prompt_tokens - 1) // BLOCK
    assert params["hafiza_loaded_blocks"] == blocks and params["hafiza_recomputed_blocks"] == 0, params
    assert "remote=loaded" in header and f"redis={blocks * BLOCK}" in header, header


def test_chat_through_the_split_equals_the_colocated_run(split: Split) -> None:
    messages: list[Any] = [{"role": "system", "content": "You answer about tides and harbours. " * 8},
                           {"role": "user", "content": "When is the water highest?"}]
    routed = client(split.router_url).chat.completions.with_raw_response.create(
        model="hafiza", messages=messages, max_tokens=10, temperature=0)
    colocated = client(split.colocated.url).chat.completions.create(model="hafiza", messages=messages,
                                                                     max_tokens=10, temperature=0)
    assert routed.parse().choices[0].message.content == colocated.choices[0].message.content
    assert "remote=loaded" in tiers(routed) and "decision=load" in tiers(routed), tiers(routed)


def test_streamed_decode_equals_the_colocated_run(split: Split) -> None:
    prompt = "A cartographer drew the river as it bent around the old mill and the orchard " * 5
    body: dict[str, Any] = {"model": "hafiza", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    with client(split.router_url).completions.with_streaming_response.create(**body, stream=True) as r:
        header = tiers(r)
        text = "".join(chunk.choices[0].text for chunk in r.parse() if chunk.choices)
    assert text == client(split.colocated.url).completions.create(**body).choices[0].text
    assert "remote=loaded" in header, header


def prefill_then_decode(split: Split, prompt: str, between: Any) -> tuple[Any, dict[str, Any], str]:
    """What the router does, by hand: prefill, `between(params)`, then decode with the prefill's params."""
    body: dict[str, Any] = {"model": "hafiza", "prompt": prompt, "temperature": 0}
    pre = client(split.prefill.url).completions.create(
        **body, max_tokens=1, extra_body={"min_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    params = transfer_of(pre)
    assert params["do_remote_prefill"] is True and params["hafiza_blocks"] == params["hafiza_prompt_blocks"] > 0
    between(params)
    raw = client(split.decode.url).completions.with_raw_response.create(
        **body, max_tokens=10, extra_body={"kv_transfer_params": params})
    answer = raw.parse()
    return answer, transfer_of(answer), tiers(raw)


def test_a_decode_whose_blocks_were_deleted_recomputes_them_and_says_so(split: Split) -> None:
    prompt = "The baker rose before dawn to knead the dough for the village's bread, " * 6
    answer, result, header = prefill_then_decode(split, prompt, lambda _: redis.Redis.from_url(split.redis.url)
                                                 .flushall())
    expected = client(split.colocated.url).completions.create(model="hafiza", prompt=prompt, max_tokens=10,
                                                              temperature=0)
    assert answer.choices[0].text == expected.choices[0].text
    assert result["hafiza_loaded_blocks"] == 0 and result["hafiza_recomputed_blocks"] > 0, result
    assert result["hafiza_note"] and "recomputed" in result["hafiza_note"]
    assert "remote=recomputed" in header and "decision=miss" in header, header


def test_a_decode_whose_blocks_are_damaged_recomputes_them_and_says_so(split: Split) -> None:
    prompt = "Snow fell on the pass, and the shepherds brought their flocks down to the valley " * 5

    def damage(_: dict[str, Any]) -> None:
        r = redis.Redis.from_url(split.redis.url)
        for key in r.scan_iter(count=1000):
            r.set(key, b"not a block", keepttl=True)

    answer, result, header = prefill_then_decode(split, prompt, damage)
    expected = client(split.colocated.url).completions.create(model="hafiza", prompt=prompt, max_tokens=10,
                                                              temperature=0)
    assert answer.choices[0].text == expected.choices[0].text
    assert result["hafiza_loaded_blocks"] == 0 and result["hafiza_recomputed_blocks"] > 0, result
    assert "remote=recomputed" in header and "blocks arrived intact" in header, header


@pytest.mark.parametrize(("worker", "value"), [
    ("decode", {"do_remote_prefill": True, "hafiza_blocks": "three"}),
    ("decode", {"do_remote_decode": True}),
    ("prefill", {"do_remote_prefill": True, "hafiza_blocks": 1, "hafiza_hashes_tail": "0" * 32}),
    ("prefill", [1, 2]),
])
def test_a_bad_transfer_is_an_http_400_naming_kv_transfer_params(split: Split, worker: str, value: object) -> None:
    url = split.decode.url if worker == "decode" else split.prefill.url
    r = httpx.post(f"{url}/v1/completions", json={"model": "hafiza", "prompt": "Hi", "max_tokens": 2,
                                                  "kv_transfer_params": value}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "kv_transfer_params" and "kv_transfer_params" in r.json()["error"]["message"]
