"""The official openai SDK over real HTTP: forced tool calls, structured output with .parse(), logprobs, n=2,
legacy completions with echo, and the Responses API. Constrained decoding makes the default 135M model's calls
valid whatever its skill, so these prove the protocol."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import Server

pytestmark = pytest.mark.slow

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                           "parameters": {"type": "object", "properties": {
                                               "zone": {"type": "string", "maxLength": 24}}, "required": ["zone"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _valid_call(call, tools=TOOLS) -> dict:
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema)
    return args


def test_tool_choice_required_gives_a_valid_call(openai_client, server: Server) -> None:
    r = openai_client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS, tool_choice="required",
                                              max_tokens=48, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in {"get_weather", "get_time"}
    _valid_call(call)


def test_named_function_is_the_one_called_streamed_too(openai_client, server: Server) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    r = openai_client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS, tool_choice=named,
                                              max_tokens=48, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _valid_call(call)
    stream = openai_client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS, tool_choice=named,
                                                   max_tokens=48, temperature=0, stream=True)
    name, args, finish, ids = "", "", None, set()
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                assert d.index == 0
                ids.add(d.id) if d.id else None
                name += d.function.name or ""
                args += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and name == "get_time" and len(ids) == 1
    assert json.loads(args) == json.loads(call.function.arguments)


def test_tool_choice_none_never_calls(openai_client, server: Server) -> None:
    r = openai_client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS, tool_choice="none",
                                              max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


class City(BaseModel):
    """Bounded fields: the 135M model's unbounded strings and integers may run to the token limit (still valid
    JSON so far, but .parse() then raises LengthFinishReasonError)."""

    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=100000)
    capital: bool


def test_parse_with_a_pydantic_model(openai_client, server: Server) -> None:
    r = openai_client.chat.completions.parse(
        model=server.model, messages=[{"role": "user", "content": "Describe Paris as JSON."}], response_format=City,
        max_tokens=80, temperature=0)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City) and r.choices[0].finish_reason == "stop"


def test_json_object_mode_returns_an_object(openai_client, server: Server) -> None:
    r = openai_client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
        response_format={"type": "json_object"}, max_tokens=60, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].finish_reason == "length"


def test_logprobs_and_top_logprobs(openai_client, server: Server) -> None:
    r = openai_client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert e.top_logprobs[0].token == e.token and math.isclose(e.top_logprobs[0].logprob, e.logprob)
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token


def test_two_choices(openai_client, server: Server) -> None:
    r = openai_client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "A fruit?"}],
                                              max_tokens=6, temperature=1.0, seed=7, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content for c in r.choices)
    assert r.usage.completion_tokens <= 12 and r.usage.completion_tokens >= 2


def test_completions_echo_with_logprobs(openai_client, server: Server) -> None:
    prompt = "The capital of France is"
    r = openai_client.completions.create(model=server.model, prompt=prompt, max_tokens=1, echo=True, logprobs=1,
                                         temperature=0)
    (c,) = r.choices
    lp = c.logprobs
    assert c.text.startswith(prompt) and r.usage.prompt_tokens == len(lp.tokens) - 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == c.text and lp.text_offset[1] == len(lp.tokens[0])
    greedy = lp.tokens[-1]
    assert max(lp.top_logprobs[-1].values()) == lp.token_logprobs[-1] and greedy in lp.top_logprobs[-1]


def test_completions_token_id_prompts_and_stream(openai_client, server: Server, http) -> None:
    ids = http.post("/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    r = openai_client.completions.create(model=server.model, prompt=[ids, ids[:2]], max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.prompt_tokens == len(ids) + 2
    text = "".join(ch.choices[0].text for ch in openai_client.completions.create(
        model=server.model, prompt=ids, max_tokens=3, temperature=0, stream=True) if ch.choices)
    assert text == r.choices[0].text


def test_responses_text_tools_and_previous_response(openai_client, server: Server) -> None:
    system = "You are a weather bot. " * 40
    first = openai_client.responses.create(model=server.model, instructions=system, input="Weather in Oslo?",
                                           tools=[{"type": "function", "name": "get_weather",
                                                   "parameters": WEATHER_PARAMS}],
                                           tool_choice="required", max_output_tokens=48, temperature=0)
    (call,) = [o for o in first.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    second = openai_client.responses.create(
        model=server.model, previous_response_id=first.id, instructions=system, max_output_tokens=8, temperature=0,
        tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS}], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "-3 C, snow"}])
    assert second.output[0].type == "message" and second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16 - 16
    assert second.usage.input_tokens > first.usage.input_tokens


def test_responses_stream_events(openai_client, server: Server) -> None:
    events = []
    with openai_client.responses.stream(model=server.model, input="Say hello.", max_output_tokens=6,
                                        temperature=0) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert deltas and done.text == deltas
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")  # incomplete: max_output_tokens reached
    assert final.response.output[0].content[0].text == deltas
    assert final.response.usage.output_tokens <= 6
