"""32 concurrent clients (both APIs, streaming and not) get the right answers; clients that leave free their
blocks; afterwards no KV block is in use."""

from __future__ import annotations

import contextlib
import re
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.server.conftest import Server

QUESTIONS = ["Count from one to five.", "What color is the sky?", "Name a fruit.", "Say hello in French."]
MAX_TOKENS = 6


def ask_anthropic(client, model: str, question: str, stream: bool) -> tuple[str, int]:
    messages = [{"role": "user", "content": question}]
    kw = {"model": model, "max_tokens": MAX_TOKENS, "messages": messages, "extra_body": {"temperature": 0}}
    if stream:
        with client.messages.stream(**kw) as s:
            text = "".join(s.text_stream)
            u = s.get_final_message().usage
    else:
        msg = client.messages.create(**kw)
        text, u = msg.content[0].text, msg.usage
    return text, u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens


def ask_openai(client, model: str, question: str, stream: bool) -> tuple[str, int]:
    kw = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0,
          "messages": [{"role": "user", "content": question}]}
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.usage.prompt_tokens
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage.prompt_tokens


def test_32_concurrent_clients(server: Server, http: httpx.Client, anthropic_client, openai_client) -> None:
    expected = {}
    for q in QUESTIONS:
        r = http.post("/v1/messages", json={"model": server.model, "max_tokens": MAX_TOKENS, "temperature": 0,
                                            "messages": [{"role": "user", "content": q}]})
        body = r.json()
        expected[q] = (body["content"][0]["text"], sum(body["usage"][k] for k in (
            "input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")))

    def client(i: int) -> tuple[str, tuple[str, int]]:
        q, stream = QUESTIONS[i % 4], (i // 2) % 2 == 0
        if i % 2:
            return q, ask_openai(openai_client, server.model, q, stream)
        return q, ask_anthropic(anthropic_client, server.model, q, stream)

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(client, range(32)))
    assert len(results) == 32
    for q, got in results:
        assert got == expected[q], (q, got, expected[q])
    assert server.wait_idle() == 0
    metrics = http.get("/metrics").text
    assert re.search(r'hafiza:kv_blocks\{[^}]*state="in_use"\} 0\.0', metrics)
    assert re.search(r"hafiza:num_requests_running\{[^}]*\} 0\.0", metrics)


def disconnects(http: httpx.Client) -> float:
    text = http.get("/metrics").text
    return sum(float(v) for v in re.findall(r"hafiza:client_disconnects_total\{[^}]*\} (\S+)", text))


def test_client_leaving_mid_stream_frees_its_blocks(server: Server, http: httpx.Client) -> None:
    before = disconnects(http)
    body = {"model": server.model, "max_tokens": 1500, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a very long story about a dragon and a city."}]}
    with httpx.Client(base_url=server.url, timeout=120) as client, client.stream("POST", "/v1/messages",
                                                                                 json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept referenced: a dropped httpx line iterator closes the connection
        for line in lines:
            if "content_block_delta" in line:
                break
        assert server.engine_stats().num_running == 1
        assert next(lines)
    assert server.wait_idle(30) == 0
    assert disconnects(http) == before + 1


def test_client_leaving_before_a_plain_answer_frees_its_blocks(server: Server, http: httpx.Client) -> None:
    before = disconnects(http)
    body = {"model": server.model, "max_tokens": 1500, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a very long poem about the sea and the stars."}]}
    with contextlib.suppress(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(120, read=2.0))
    assert server.wait_idle(30) == 0
    assert disconnects(http) == before + 1
