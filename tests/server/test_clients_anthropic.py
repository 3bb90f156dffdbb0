"""The official anthropic SDK over real HTTP: a full tool loop (tool_use -> tool_result -> answer), plain and
streamed, with cache_control on the tools; the second turn reads the first turn's prefix from the cache."""

from __future__ import annotations

import jsonschema
import pytest

from tests.server.conftest import Server, long_text

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"]}


def tools(tag: str) -> list[dict]:
    """Two tools whose definitions pass the 1,024-token cache minimum; the breakpoint is on the last one."""
    return [{"name": "get_weather", "description": long_text(f"{tag}-weather", 700), "input_schema": SCHEMA},
            {"name": "get_time", "description": long_text(f"{tag}-time", 500), "input_schema": SCHEMA,
             "cache_control": {"type": "ephemeral"}}]


def loop(client, server: Server, tag: str, stream: bool) -> None:
    defs = tools(tag)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]

    def create(**kw):
        if not stream:
            return client.messages.create(model=server.model, tools=defs, extra_body={"temperature": 0}, **kw)
        with client.messages.stream(model=server.model, tools=defs, extra_body={"temperature": 0}, **kw) as s:
            kinds = [e.type for e in s]
            msg = s.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        return msg

    first = create(max_tokens=40, messages=ask, tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, SCHEMA)
    assert first.usage.cache_creation_input_tokens >= 1024

    history = [*ask, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": "18 C and sunny"}]}]
    answer = create(max_tokens=12, messages=history, tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text
    assert answer.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens
    total = (answer.usage.input_tokens + answer.usage.cache_read_input_tokens
             + answer.usage.cache_creation_input_tokens)
    counted = client.messages.count_tokens(model=server.model, tools=defs, messages=history,
                                           tool_choice={"type": "none"})
    assert total == counted.input_tokens


def test_tool_loop(anthropic_client, server: Server) -> None:
    loop(anthropic_client, server, "loop-plain", stream=False)


def test_tool_loop_streamed(anthropic_client, server: Server) -> None:
    loop(anthropic_client, server, "loop-stream", stream=True)


def test_streamed_tool_use_arrives_as_input_json_delta(http, server: Server) -> None:
    body = {"model": server.model, "max_tokens": 40, "stream": True, "temperature": 0,
            "tools": [{"name": "get_weather", "input_schema": SCHEMA}], "tool_choice": {"type": "any"},
            "messages": [{"role": "user", "content": "Weather in Rome?"}]}
    with http.stream("POST", "/v1/messages", json=body) as r:
        lines = [line for line in r.iter_lines() if line.startswith("event: ")]
    kinds = [line.removeprefix("event: ") for line in lines]
    start = kinds.index("content_block_start")
    assert kinds[start:start + 3] == ["content_block_start", "content_block_delta", "content_block_stop"]
    assert "message_delta" in kinds


def test_tool_order_change_is_named_in_the_cache_header(http, server: Server) -> None:
    defs = tools("order")
    base = {"model": server.model, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    assert http.post("/v1/messages", json={**base, "tools": defs}).status_code == 200
    r = http.post("/v1/messages", json={**base, "tools": defs[::-1]})
    assert "reason=tool_order" in r.headers["x-hafiza-cache"]
