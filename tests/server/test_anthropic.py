"""POST /v1/messages through the official `anthropic` client and raw HTTP: caching usage, SSE, explanations."""

from __future__ import annotations

import json

import httpx

from hafiza.models import LoadedModel
from hafiza.server.convert import anthropic_conversation
from hafiza.server.prompt import build_prompt
from hafiza.server.schemas.anthropic import MessagesRequest
from tests.server.conftest import Server, long_text

CC = {"type": "ephemeral"}
GREEDY = {"temperature": 0}


def total(usage) -> int:
    return usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens


def count(http: httpx.Client, model: str, **fields) -> int:
    r = http.post("/v1/messages/count_tokens", json={"model": model, **fields})
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[6:])))
    return events


def test_long_system_prompt_is_written_then_read(anthropic_client, server: Server, http: httpx.Client) -> None:
    system = [{"type": "text", "text": long_text("anthropic-plain"), "cache_control": CC}]
    messages = [{"role": "user", "content": "Summarise the notes in one line."}]
    n = count(http, server.model, system=system, messages=messages)
    assert n >= 1200
    raw = anthropic_client.messages.with_raw_response.create(
        model=server.model, max_tokens=4, system=system, messages=messages, extra_body=GREEDY)
    first = raw.parse()
    assert first.usage.cache_creation_input_tokens >= 1200 - 16
    assert first.usage.cache_read_input_tokens == 0
    assert first.usage.cache_creation.ephemeral_5m_input_tokens == first.usage.cache_creation_input_tokens
    assert first.usage.cache_creation.ephemeral_1h_input_tokens == 0
    assert total(first.usage) == n and first.usage.input_tokens > 0
    assert raw.headers["x-hafiza-cache"].startswith(f"miss; reused=0; prompt={n}")
    second = anthropic_client.messages.create(model=server.model, max_tokens=4, system=system, messages=messages,
                                              extra_body=GREEDY)
    assert second.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens
    assert second.usage.cache_creation_input_tokens == 0 and total(second.usage) == n
    assert second.content[0].text == first.content[0].text
    assert first.type == "message" and first.role == "assistant" and first.model == server.model
    assert first.stop_reason in ("end_turn", "max_tokens") and first.id.startswith("msg_")


def test_streaming_client_reports_write_then_read(anthropic_client, server: Server, warm_document: str) -> None:
    system = [{"type": "text", "text": warm_document},
              {"type": "text", "text": long_text("stream-tail", 60), "cache_control": CC}]
    messages = [{"role": "user", "content": "Name one word from the notes."}]
    usages, texts = [], []
    for _ in range(2):
        with anthropic_client.messages.stream(model=server.model, max_tokens=5, system=system, messages=messages,
                                              extra_body=GREEDY) as stream:
            texts.append("".join(stream.text_stream))
            final = stream.get_final_message()
        usages.append(final.usage)
        assert final.content[0].text == texts[-1]
    first, second = usages
    assert first.cache_read_input_tokens >= 1024 and first.cache_creation_input_tokens > 0
    assert second.cache_read_input_tokens >= first.cache_read_input_tokens + first.cache_creation_input_tokens
    assert second.cache_creation_input_tokens == 0
    assert total(first) == total(second) and first.output_tokens == second.output_tokens > 0
    assert texts[0] == texts[1]


def test_raw_sse_event_sequence(http: httpx.Client, server: Server, warm_document: str) -> None:
    body = {"model": server.model, "max_tokens": 6, "stream": True, "temperature": 0,
            "system": [{"type": "text", "text": warm_document, "cache_control": CC}],
            "messages": [{"role": "user", "content": "Hello"}]}
    with http.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-hafiza-cache"].split(";")[0] in ("hit", "partial")
        events = sse_events(r)
    names = [n for n, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) <= {"content_block_delta", "ping"}
    assert all(n == d["type"] for n, d in events)
    start = events[0][1]["message"]["usage"]
    n = count(http, server.model, system=body["system"], messages=body["messages"])
    assert start["input_tokens"] + start["cache_creation_input_tokens"] + start["cache_read_input_tokens"] == n
    assert start["cache_read_input_tokens"] >= 1024
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert delta["usage"]["output_tokens"] > 0
    assert delta["usage"]["cache_read_input_tokens"] == start["cache_read_input_tokens"]
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text


def test_max_tokens_zero_fills_the_cache(anthropic_client, server: Server, warm_document: str) -> None:
    system = [{"type": "text", "text": warm_document},
              {"type": "text", "text": long_text("prefill-only", 80), "cache_control": CC}]
    messages = [{"role": "user", "content": "Question later."}]
    filled = anthropic_client.messages.create(model=server.model, max_tokens=0, system=system, messages=messages)
    assert filled.content == [] and filled.stop_reason == "max_tokens" and filled.usage.output_tokens == 0
    assert filled.usage.cache_creation_input_tokens > 0
    later = anthropic_client.messages.create(model=server.model, max_tokens=2, system=system, messages=[
        {"role": "user", "content": "A different question now, please."}], extra_body=GREEDY)
    assert later.usage.cache_read_input_tokens >= (filled.usage.cache_read_input_tokens
                                                   + filled.usage.cache_creation_input_tokens)


def test_ttls_split_the_write(anthropic_client, server: Server, warm_document: str) -> None:
    system = [{"type": "text", "text": warm_document},
              {"type": "text", "text": long_text("ttl-hour", 60), "cache_control": {"type": "ephemeral", "ttl": "1h"}},
              {"type": "text", "text": long_text("ttl-five", 60), "cache_control": CC}]
    msg = anthropic_client.messages.create(model=server.model, max_tokens=1, system=system,
                                           messages=[{"role": "user", "content": "ok"}])
    u = msg.usage
    assert u.cache_creation.ephemeral_1h_input_tokens > 0 and u.cache_creation.ephemeral_5m_input_tokens > 0
    assert u.cache_creation_input_tokens == (u.cache_creation.ephemeral_1h_input_tokens
                                             + u.cache_creation.ephemeral_5m_input_tokens)
    assert server.engine_stats().blocks.pinned > 0


def test_top_level_cache_control_marks_the_last_block(anthropic_client, server: Server, warm_document: str,
                                                       http: httpx.Client) -> None:
    messages = [{"role": "user", "content": long_text("top-level", 60)}]
    system = [{"type": "text", "text": warm_document}]
    msg = anthropic_client.messages.create(model=server.model, max_tokens=1, system=system, messages=messages,
                                           cache_control=CC)
    n = count(http, server.model, system=system, messages=messages)
    assert msg.usage.cache_read_input_tokens >= 1024
    assert msg.usage.cache_read_input_tokens + msg.usage.cache_creation_input_tokens > n - 16 - 4


def test_breakpoint_below_minimum_is_ignored_and_said(http: httpx.Client, server: Server) -> None:
    body = {"model": server.model, "max_tokens": 1,
            "system": [{"type": "text", "text": long_text("short-prefix", 40), "cache_control": CC}],
            "messages": [{"role": "user", "content": "hi"}]}
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["cache_creation_input_tokens"] == 0
    assert usage["cache_creation"] == {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}
    assert "ignored_breakpoints=1; min_cache_tokens=1024" in r.headers["x-hafiza-cache"]


def test_stop_sequence_is_reported(anthropic_client, server: Server) -> None:
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    free = anthropic_client.messages.create(model=server.model, max_tokens=12, messages=messages, extra_body=GREEDY)
    words = free.content[0].text.split()
    assert len(words) >= 3, free.content[0].text
    stop = " " + words[2]
    cut = anthropic_client.messages.create(model=server.model, max_tokens=12, messages=messages,
                                           stop_sequences=[stop], extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == free.content[0].text[: free.content[0].text.index(stop)]


def test_assistant_prefill_is_continued(http: httpx.Client, server: Server, default_model: LoadedModel) -> None:
    body = {"model": server.model, "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": "Count from one."}, {"role": "assistant", "content": "One, two,"}]}
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    tok = default_model.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Count from one."}]) + "One, two,"
    n = count(http, server.model, messages=body["messages"])
    assert n == len(tok.encode(prompt))
    u = r.json()["usage"]
    assert u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"] == n


def header(r: httpx.Response) -> dict[str, str]:
    parts = [p.strip() for p in r.headers["x-hafiza-cache"].split(";")]
    return {"status": parts[0], **dict(p.split("=", 1) for p in parts[1:])}


def expected_divergence(tok, a: dict, b: dict) -> int:
    pa = build_prompt(tok, anthropic_conversation(MessagesRequest.model_validate(a)))
    pb = build_prompt(tok, anthropic_conversation(MessagesRequest.model_validate(b)))
    return next(i for i, (x, y) in enumerate(zip(pa.ids, pb.ids, strict=False)) if x != y)


def test_miss_explains_where_the_prefix_diverged(http: httpx.Client, server: Server,
                                                 default_model: LoadedModel) -> None:
    notes = long_text("explain-notes", 150)
    base = {"model": server.model, "max_tokens": 1, "messages": [{"role": "user", "content": "What is in the notes?"}]}
    a = {**base, "system": f"Time: 12:00:01. {notes}"}
    b = {**base, "system": f"Time: 12:00:02. {notes}"}
    ra = http.post("/v1/messages", json=a)
    rb = http.post("/v1/messages", json=b)
    assert ra.status_code == rb.status_code == 200
    h = header(rb)
    assert h["status"] == "miss" and h["reason"] == "diverged" and h["at"] == "system"
    assert int(h["offset"]) == expected_divergence(default_model.tokenizer, a, b)
    assert h["similar"] == ra.json()["id"]

    tools = [{"name": f"tool_{i}", "description": long_text(f"tool-{i}", 40), "input_schema": {"type": "object"}}
             for i in range(2)]
    c = {**base, "tools": tools, "system": notes}
    d = {**base, "tools": tools[::-1], "system": notes}
    http.post("/v1/messages", json=c)
    hd = header(http.post("/v1/messages", json=d))
    assert hd["status"] in ("miss", "partial") and hd["at"] == "tools" and hd["reason"] == "tool_order"


def test_partial_hit_names_the_edited_message_and_extensions(http: httpx.Client, server: Server) -> None:
    notes = long_text("edit-notes", 150)
    turns = [{"role": "user", "content": "First question?"}, {"role": "assistant", "content": "First answer."},
             {"role": "user", "content": "Second question?"}]
    a = {"model": server.model, "max_tokens": 1, "system": notes, "messages": turns}
    edited = [turns[0], {"role": "assistant", "content": "An edited answer."}, turns[2]]
    ra = http.post("/v1/messages", json=a)
    h = header(http.post("/v1/messages", json={**a, "messages": edited}))
    assert h["status"] == "partial" and h["reason"] == "diverged" and h["at"] == "messages[1]"
    assert int(h["reused"]) > 150 and h["similar"] == ra.json()["id"]
    longer = [*turns, {"role": "assistant", "content": "Second answer."}, {"role": "user", "content": "Third?"}]
    h2 = header(http.post("/v1/messages", json={**a, "messages": longer}))
    assert h2["status"] == "partial" and h2["reason"] == "extended" and h2["at"] == "messages[3]"


def test_count_tokens_matches_usage(http: httpx.Client, server: Server) -> None:
    body = {"model": server.model, "messages": [{"role": "user", "content": "Count me."}], "system": "Be kind."}
    n = count(http, server.model, **{k: v for k, v in body.items() if k != "model"})
    r = http.post("/v1/messages", json={**body, "max_tokens": 1})
    u = r.json()["usage"]
    assert u["input_tokens"] + u["cache_creation_input_tokens"] + u["cache_read_input_tokens"] == n
