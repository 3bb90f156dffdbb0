"""Breakpoint token offsets are exact, and the usage rules split a prompt as documented."""

from __future__ import annotations

import pytest

from hafiza.models import LoadedModel
from hafiza.server.convert import anthropic_conversation, check_breakpoints, openai_conversation
from hafiza.server.errors import ApiError
from hafiza.server.prompt import Breakpoint, Piece, Turn, build_prompt
from hafiza.server.schemas.anthropic import MessagesRequest
from hafiza.server.schemas.openai import ChatMessage
from hafiza.server.usage import anthropic_usage, counted_breakpoints, pins_for

CC = {"type": "ephemeral"}


def request(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 4, **fields}, strict=True)


def assert_exact(prompt, tokenizer) -> None:
    """Each breakpoint's first `tokens` ids are exactly what the text up to that block tokenizes to."""
    for bp in prompt.breakpoints:
        char = prompt.token_ends[bp.tokens - 1]
        assert tokenizer.encode(prompt.text[:char]) == prompt.ids[: bp.tokens]


@pytest.mark.parametrize("fields", [
    {"system": [{"type": "text", "text": "You are terse.", "cache_control": CC}],
     "messages": [{"role": "user", "content": "Hi there"}]},
    {"system": [{"type": "text", "text": "Part one.", "cache_control": CC},
                {"type": "text", "text": "Part two, longer.", "cache_control": {"type": "ephemeral", "ttl": "5m"}}],
     "messages": [{"role": "user", "content": [{"type": "text", "text": "a b c", "cache_control": CC},
                                               {"type": "text", "text": "d e f"}]}]},
    {"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"},
                  {"role": "user", "content": "How are you?"}], "cache_control": CC},
    {"tools": [{"name": "get_time", "description": "Time now", "input_schema": {"type": "object"},
                "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
     "messages": [{"role": "user", "content": "What time is it?"},
                  {"role": "assistant", "content": [{"type": "text", "text": "It is", "cache_control": CC}]}]},
])
def test_breakpoints_fall_on_exact_token_offsets(default_model: LoadedModel, fields) -> None:
    tok = default_model.tokenizer
    prompt = build_prompt(tok, anthropic_conversation(request(**fields)))
    assert prompt.ids == tok.encode(prompt.text)
    assert prompt.breakpoints and all(0 < b.tokens <= len(prompt.ids) for b in prompt.breakpoints)
    assert [b.tokens for b in prompt.breakpoints] == sorted(b.tokens for b in prompt.breakpoints)
    assert_exact(prompt, tok)


def test_breakpoint_at_end_of_system_includes_its_closing_tokens(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    prompt = build_prompt(tok, anthropic_conversation(request(
        system=[{"type": "text", "text": "Be brief.", "cache_control": CC}],
        messages=[{"role": "user", "content": "Hi"}])))
    system_only = tok.apply_chat_template([{"role": "system", "content": "Be brief."}], add_generation_prompt=False)
    assert prompt.breakpoints == [Breakpoint(len(tok.encode(system_only)), "5m", "system")]


def test_mid_message_block_breakpoint_stops_at_the_block(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    prompt = build_prompt(tok, anthropic_conversation(request(messages=[{"role": "user", "content": [
        {"type": "text", "text": "first block", "cache_control": CC}, {"type": "text", "text": "second"}]}])))
    (bp,) = prompt.breakpoints
    assert tok.decode(prompt.ids[: bp.tokens], skip_special=False).endswith("first block")
    assert bp.label == "messages[0]"


def test_segments_are_located(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    conv = anthropic_conversation(request(
        tools=[{"name": "t", "input_schema": {"type": "object"}}], system="System text.",
        messages=[{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
                  {"role": "user", "content": "three"}]))
    prompt = build_prompt(tok, conv)
    labels = [prompt.segment_at(i) for i in range(len(prompt.ids))]
    order = list(dict.fromkeys(labels))
    assert order == ["tools", "system", "messages[0]", "messages[1]", "messages[2]", "generation_prompt"]
    first_user = labels.index("messages[0]")
    assert tok.decode(prompt.ids[first_user:first_user + 1], skip_special=False) == "<|im_start|>"


def test_openai_conversation_labels_messages(default_model: LoadedModel) -> None:
    msgs = [ChatMessage(role="developer", content="Rules."), ChatMessage(role="user", content="Hi")]
    conv = openai_conversation(msgs, None)
    assert [(t.role, t.label) for t in conv.turns] == [("system", "messages[0]"), ("user", "messages[1]")]


def test_breakpoint_limits() -> None:
    turns = [Turn("user", f"messages[{i}]", [Piece("x", "5m")]) for i in range(5)]
    with pytest.raises(ApiError, match=r"^A maximum of 4 blocks with cache_control may be provided\. Found 5\.$"):
        check_breakpoints(turns)
    with pytest.raises(ApiError, match=r"ttl='1h'.*must not come after.*ttl='5m'"):
        check_breakpoints([Turn("system", "system", [Piece("a", "5m"), Piece("b", "1h")])])
    check_breakpoints([Turn("system", "system", [Piece("a", "1h"), Piece("b", "5m")])])


def test_usage_rules() -> None:
    bps = [Breakpoint(1030, "1h", "system"), Breakpoint(1500, "5m", "messages[0]")]
    first = anthropic_usage(1600, 0, bps, 16)
    assert (first.cache_read, first.write_1h, first.write_5m, first.input_tokens) == (0, 1024, 1488 - 1024, 112)
    again = anthropic_usage(1600, 1584, bps, 16)
    assert (again.cache_read, again.cache_write, again.input_tokens) == (1584, 0, 16)
    grown = anthropic_usage(1700, 1024, bps, 16)
    assert (grown.cache_read, grown.write_1h, grown.write_5m, grown.input_tokens) == (1024, 0, 464, 212)
    for u in (first, again, grown):
        assert u.input_tokens + u.cache_read + u.cache_write == u.prompt_tokens
    short = [Breakpoint(500, "5m", "system")]
    assert counted_breakpoints(short, 1024) == []
    assert anthropic_usage(600, 0, [], 16).input_tokens == 600
    assert [p.ttl_s for p in pins_for(bps)] == [3600.0, 300.0]
