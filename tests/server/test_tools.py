"""Tool definitions reach the model through its own chat template (or the generic rendering), calls are parsed
per family, and tool breakpoints fall on exact token offsets."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hafiza.models import LoadedModel
from hafiza.models.tokenizer import Tokenizer
from hafiza.server.convert import anthropic_conversation, openai_conversation, openai_tools
from hafiza.server.errors import ApiError
from hafiza.server.prompt import build_prompt
from hafiza.server.schemas.anthropic import MessagesRequest
from hafiza.server.schemas.openai import ChatCompletionRequest
from hafiza.server.tools.formats import GENERIC, HERMES, LLAMA3, tool_format
from hafiza.server.tools.parse import CallPart, TextPart, ToolCallParser, split_reply

TEMPLATES = Path(__file__).parent / "templates"
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time", "description": "The time now", "input_schema": {"type": "object", "properties": {}}}
NAMES = {"get_weather", "get_time"}


def with_template(tok: Tokenizer, name: str) -> Tokenizer:
    """The default model's vocabulary with another family's chat template."""
    return dataclasses.replace(tok, chat_template=(TEMPLATES / name).read_text(), _template=None)


def anthropic(**fields: object) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 4, **fields}, strict=True)


TOOL_LOOP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                       "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C, sunny"}]},
]


def test_formats_are_detected_from_the_template(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    assert tool_format(tok) is GENERIC
    assert tool_format(with_template(tok, "qwen2.5.jinja")) is HERMES
    assert tool_format(with_template(tok, "llama3.2.jinja")) is LLAMA3


def test_qwen_template_renders_tools_calls_and_results(default_model: LoadedModel) -> None:
    tok = with_template(default_model.tokenizer, "qwen2.5.jinja")
    conv = anthropic_conversation(anthropic(tools=[WEATHER], system="Be brief.", messages=TOOL_LOOP), HERMES)
    text = build_prompt(tok, conv).text
    schema = json.dumps(WEATHER["input_schema"])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert ('<tools>\n{"type": "function", "function": {"name": "get_weather", "description": "Current weather in '
            f'a city", "parameters": {schema}}}}}\n</tools>') in text
    assert ('<|im_start|>assistant\nLet me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_llama3_template_keeps_tools_in_the_system_turn(default_model: LoadedModel) -> None:
    tok = with_template(default_model.tokenizer, "llama3.2.jinja")
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"]}}]},
        strict=True)
    tools, choice = openai_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    text = build_prompt(tok, openai_conversation(req.messages, tools, LLAMA3, choice)).text
    system_end = text.index("<|eot_id|>")
    assert text.index('"name": "get_weather"') < system_end < text.index("Weather in Paris?")
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n" in text


def test_generic_rendering_lists_tools_ahead_of_the_messages(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    conv = anthropic_conversation(anthropic(tools=[WEATHER], messages=TOOL_LOOP), GENERIC)
    prompt = build_prompt(tok, conv)
    assert [t.label for t in conv.turns][:1] == ["tools"]
    assert prompt.text.startswith("<|im_start|>system\nYou can call tools.")
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt.text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt.text


@pytest.mark.parametrize("template", ["qwen2.5.jinja", "llama3.2.jinja", None])
def test_tool_breakpoints_are_exact_and_in_order(default_model: LoadedModel, template: str | None) -> None:
    base = default_model.tokenizer
    tok = with_template(base, template) if template else base
    tools = [{**WEATHER, "cache_control": {"type": "ephemeral", "ttl": "1h"}}, {**TIME, "cache_control":
                                                                               {"type": "ephemeral"}}]
    conv = anthropic_conversation(anthropic(tools=tools, system="Be brief.", messages=[
        {"role": "user", "content": "Hi"}]), tool_format(tok))
    prompt = build_prompt(tok, conv)
    first, second = prompt.breakpoints
    assert (first.ttl, second.ttl) == ("1h", "5m") and 0 < first.tokens < second.tokens < len(prompt.ids)
    for bp in prompt.breakpoints:
        char = prompt.token_ends[bp.tokens - 1]
        assert tok.encode(prompt.text[:char]) == prompt.ids[: bp.tokens]
    head = tok.decode(prompt.ids[: first.tokens], skip_special=False)
    assert '"get_weather"' in head and '"get_time"' not in head
    assert '"get_time"' in tok.decode(prompt.ids[: second.tokens], skip_special=False)
    assert "Hi" not in tok.decode(prompt.ids[: second.tokens], skip_special=False)
    labels = {prompt.segment_at(i) for i in range(len(prompt.ids))}
    assert {"tools", "messages[0]", "generation_prompt"} <= labels


def test_forced_choice_starts_the_reply_with_the_call_prefix(default_model: LoadedModel) -> None:
    tok = with_template(default_model.tokenizer, "qwen2.5.jinja")
    conv = anthropic_conversation(anthropic(tools=[WEATHER], tool_choice={"type": "any"},
                                            messages=[{"role": "user", "content": "Hi"}]), HERMES)
    assert build_prompt(tok, conv).text.endswith("<|im_start|>assistant\n<tool_call>\n")


@pytest.mark.parametrize("fields, message", [
    ({"tools": [WEATHER, WEATHER]}, "tool names must be unique"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "no tool named 'nope'"),
    ({"tool_choice": {"type": "any"}}, "needs at least one tool"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
])
def test_bad_tool_requests_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ApiError, match=message):
        anthropic_conversation(anthropic(messages=[{"role": "user", "content": "Hi"}], **fields))


CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize("fmt, reply, text, calls", [
    (HERMES, f"<tool_call>\n{CALL}\n</tool_call>", "", [("get_weather", {"city": "Paris"})]),
    (HERMES, f"Sure.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>{{\"name\": \"get_time\", \"arguments\": {{}}}}"
             "</tool_call>", "Sure.\n\n", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    (HERMES, "No tools needed: 4.", "No tools needed: 4.", []),
    (HERMES, "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    (HERMES, '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
    (HERMES, f"<tool_call>\n{CALL}", "", [("get_weather", {"city": "Paris"})]),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    (LLAMA3, '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": '
             '{"city": "Oslo"}}', "", [("get_time", {}), ("get_weather", {"city": "Oslo"})]),
    (LLAMA3, '{"answer": 4}', '{"answer": 4}', []),
    (LLAMA3, "It is 4.", "It is 4.", []),
    (GENERIC, f"<tool_call>{CALL}</tool_call>", "", [("get_weather", {"city": "Paris"})]),
    (HERMES, f"```json\n{CALL}\n```", "", [("get_weather", {"city": "Paris"})]),
    (HERMES, 'Here:\n```json\n{"answer": 4}\n```', 'Here:\n```json\n{"answer": 4}\n```', []),
])
def test_calls_are_parsed_whole_and_streamed(fmt, reply: str, text: str, calls: list) -> None:
    got_text, got_calls = split_reply(reply, fmt, NAMES)
    assert got_text == text
    assert [(c.name, c.input) for c in got_calls] == calls
    parser = ToolCallParser(fmt, NAMES)
    parts = [p for ch in reply for p in parser.feed(ch)] + parser.finish()
    assert "".join(p.text for p in parts if isinstance(p, TextPart)) == text
    assert [(p.call.name, p.call.input) for p in parts if isinstance(p, CallPart)] == calls


def test_streaming_holds_back_a_partial_marker_only() -> None:
    parser = ToolCallParser(HERMES, NAMES)
    assert parser.feed("Hello <tool") == [TextPart("Hello ")]
    assert parser.feed("box>") == [TextPart("<toolbox>")]


def test_forced_reply_is_the_json_after_the_prefix() -> None:
    text, calls = split_reply(CALL, HERMES, NAMES, forced=True)
    assert text == "" and [c.name for c in calls] == ["get_weather"]
    text, calls = split_reply('{"name": "get_weather", "argu', HERMES, NAMES, forced=True)
    assert text == '{"name": "get_weather", "argu' and calls == []


def test_without_parallel_calls_only_the_first_is_kept(default_model: LoadedModel) -> None:
    from hafiza.engine.results import RequestOutput
    from hafiza.server.tools.reply import ReplyReader
    from hafiza.server.tools.spec import ToolChoice, ToolDef

    tools = [ToolDef("get_weather", None, {"type": "object"}), ToolDef("get_time", None, {"type": "object"})]
    reply = f"<tool_call>{CALL}</tool_call><tool_call>{{\"name\": \"get_time\", \"arguments\": {{}}}}</tool_call>"
    for parallel, names in ((True, ["get_weather", "get_time"]), (False, ["get_weather"])):
        reader = ReplyReader(default_model.tokenizer, GENERIC, tools, ToolChoice("auto", None, parallel))
        reader.feed(RequestOutput("r", [], reply, True))
        reader.finish()
        assert [c.name for c in reader.calls] == names and reader.text == ""
