"""POST /v1/chat/completions through the official `openai` client and raw HTTP: automatic caching, streaming."""

from __future__ import annotations

import json

import httpx

from tests.server.conftest import Server, long_text


def test_repeated_long_prefix_reports_cached_tokens(openai_client, server: Server) -> None:
    messages = [{"role": "system", "content": long_text("openai-prefix")},
                {"role": "user", "content": "Give one word from the notes."}]
    raw = openai_client.chat.completions.with_raw_response.create(model=server.model, messages=messages,
                                                                  max_tokens=4, temperature=0)
    first = raw.parse()
    assert first.usage.prompt_tokens >= 1200
    assert first.usage.prompt_tokens_details is not None and first.usage.prompt_tokens_details.cached_tokens == 0
    assert raw.headers["x-hafiza-cache"].startswith("miss; reused=0")
    second = openai_client.chat.completions.create(model=server.model, messages=messages, max_tokens=4,
                                                   temperature=0)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= 1024
    assert second.usage.total_tokens == second.usage.prompt_tokens + second.usage.completion_tokens
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.object == "chat.completion" and second.choices[0].finish_reason in ("stop", "length")

    stream = openai_client.chat.completions.create(model=server.model, messages=messages, max_tokens=4,
                                                   temperature=0, stream=True,
                                                   stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 1024
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == first.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_stream_without_usage_ends_with_done(http: httpx.Client, server: Server) -> None:
    body = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_cached_tokens_present_when_zero_and_stop_string(http: httpx.Client, server: Server) -> None:
    body = {"model": server.model, "messages": [{"role": "user", "content": "Say: red, green, blue."}],
            "max_completion_tokens": 10, "temperature": 0}
    free = http.post("/v1/chat/completions", json=body).json()
    assert free["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    text = free["choices"][0]["message"]["content"]
    assert len(text) > 4
    stop = text[2:4]
    cut = http.post("/v1/chat/completions", json={**body, "stop": stop}).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["message"]["content"] == text[: text.index(stop)]
    fresh = [{"role": "system", "content": "Unique zero-check 8812."}, {"role": "user", "content": "x"}]
    tiny = http.post("/v1/chat/completions", json={**body, "messages": fresh}).json()
    assert tiny["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "audio_tokens": 0}


def test_models_and_health(http: httpx.Client, server: Server, openai_client) -> None:
    assert http.get("/health").json()["status"] == "ok"
    ids = [m.id for m in openai_client.models.list()]
    assert ids[0] == server.model and "smollm2" in ids
    assert http.get(f"/v1/models/{server.model}").status_code == 200
    alias = http.post("/v1/chat/completions", json={"model": "smollm2", "max_tokens": 1,
                                                    "messages": [{"role": "user", "content": "hi"}]})
    assert alias.status_code == 200 and alias.json()["model"] == "smollm2"
