"""The vLLM/SGLang fields vllm-router adds to chat and completions bodies: honoured as vLLM does (ignore_eos,
min_tokens, skip_special_tokens, no_stop_trim, continue_final_message), accepted at the values that ask nothing
(reasoning flags, return_hidden_states, kv_transfer_params), refused with a 400 naming them otherwise."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from hafiza.server.errors import ApiError
from hafiza.server.extensions import check_extensions
from hafiza.server.schemas.openai import ChatCompletionRequest
from tests.server.conftest import Server

# What vllm-router 0.1.17 adds to every chat and completions body it forwards (seen on the wire).
ROUTER_CHAT = {"stream": False, "logprobs": False, "no_stop_trim": False, "ignore_eos": False,
               "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
               "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True}
ROUTER_COMPLETIONS = {"stream": False, "echo": False, "no_stop_trim": False, "ignore_eos": False,
                      "skip_special_tokens": True, "return_hidden_states": False}
USER = [{"role": "user", "content": "Name three colours."}]


def chat(http: httpx.Client, server: Server, **fields: Any) -> dict[str, Any]:
    r = http.post("/v1/chat/completions", json={"model": server.model, "messages": USER, "max_tokens": 8,
                                                "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def refused(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


def eos(server: Server) -> int:
    return server.aengine.engine.tokenizer.eos_token_ids[0]


def test_the_routers_chat_body_is_accepted_and_answered_as_without_its_fields(http: httpx.Client,
                                                                              server: Server) -> None:
    plain, routed = chat(http, server), chat(http, server, **ROUTER_CHAT)
    assert routed["choices"][0]["message"] == plain["choices"][0]["message"]
    assert routed["usage"] == plain["usage"] | {"prompt_tokens_details": routed["usage"]["prompt_tokens_details"]}
    assert chat(http, server, max_completion_tokens=8, **ROUTER_CHAT)["choices"] == routed["choices"]


def test_the_routers_completions_body_is_accepted_and_answered_as_without_its_fields(http: httpx.Client,
                                                                                     server: Server) -> None:
    body = {"model": server.model, "prompt": "The sky is", "max_tokens": 6, "temperature": 0}
    plain = http.post("/v1/completions", json=body).json()
    routed = http.post("/v1/completions", json=body | ROUTER_COMPLETIONS)
    assert routed.status_code == 200, routed.text
    assert routed.json()["choices"][0]["text"] == plain["choices"][0]["text"]


def test_ignore_eos_goes_on_past_eos(http: httpx.Client, server: Server) -> None:
    bias = {str(eos(server)): 100}
    stopped = chat(http, server, logit_bias=bias)
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] <= 1
    going = chat(http, server, logit_bias=bias, ignore_eos=True)
    assert going["choices"][0]["finish_reason"] == "length" and going["usage"]["completion_tokens"] == 8


def test_min_tokens_holds_eos_back_until_that_many_tokens(http: httpx.Client, server: Server) -> None:
    out = chat(http, server, logit_bias={str(eos(server)): 100}, min_tokens=3)
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == 4  # three tokens, then the EOS that was held back
    error = refused(http, "/v1/chat/completions", {"model": server.model, "messages": USER, "max_tokens": 2,
                                                   "min_tokens": 3})
    assert error["param"] == "min_tokens"


def test_min_tokens_holds_a_stop_string_back(http: httpx.Client, server: Server) -> None:
    free = chat(http, server, max_tokens=12)["choices"][0]["message"]["content"]
    first_word = free.split()[0]
    assert chat(http, server, max_tokens=12, stop=[first_word])["choices"][0]["message"]["content"] == \
        free[: free.index(first_word)]
    held = chat(http, server, max_tokens=12, stop=[first_word], min_tokens=12)
    assert held["choices"][0]["message"]["content"].startswith(free[: free.index(first_word) + len(first_word)])


def test_skip_special_tokens_false_keeps_control_tokens_in_the_text(http: httpx.Client, server: Server) -> None:
    eos_text = server.aengine.engine.tokenizer.decode([eos(server)], skip_special=False)
    fields = {"logit_bias": {str(eos(server)): 100}, "ignore_eos": True, "max_tokens": 3}
    assert chat(http, server, **fields)["choices"][0]["message"]["content"] == ""
    kept = chat(http, server, skip_special_tokens=False, **fields)
    assert kept["choices"][0]["message"]["content"] == eos_text * 3
    body = {"model": server.model, "prompt": "Hi", "temperature": 0, "skip_special_tokens": False, **fields}
    assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == eos_text * 3


def test_no_stop_trim_keeps_the_matched_stop_string(http: httpx.Client, server: Server) -> None:
    free = chat(http, server, max_tokens=12)["choices"][0]["message"]["content"]
    word = free.split()[1]
    cut = free.index(word)
    trimmed = chat(http, server, max_tokens=12, stop=[word])["choices"][0]
    kept = chat(http, server, max_tokens=12, stop=[word], no_stop_trim=True)["choices"][0]
    assert trimmed["message"]["content"] == free[:cut] and trimmed["finish_reason"] == "stop"
    assert kept["message"]["content"] == free[: cut + len(word)] and kept["finish_reason"] == "stop"


def test_continue_final_message_continues_the_assistant_turn(http: httpx.Client, server: Server) -> None:
    messages = [*USER, {"role": "assistant", "content": "Red, green and"}]
    body = {"model": server.model, "messages": messages, "max_tokens": 3, "temperature": 0}
    closed = http.post("/v1/chat/completions", json=body).json()
    opened = http.post("/v1/chat/completions", json=body | {"continue_final_message": True}).json()
    tok = server.aengine.engine.tokenizer
    head = tok.apply_chat_template(USER, add_generation_prompt=True)
    assert opened["usage"]["prompt_tokens"] == len(tok.encode(head + "Red, green and"))
    assert closed["usage"]["prompt_tokens"] > opened["usage"]["prompt_tokens"]  # closed, and a new turn opened
    error = refused(http, "/v1/chat/completions", {"model": server.model, "messages": USER,
                                                   "continue_final_message": True})
    assert error["param"] == "continue_final_message" and "assistant" in error["message"]


@pytest.mark.parametrize("value", [True, False])
def test_reasoning_flags_ask_nothing_of_a_model_without_reasoning(http: httpx.Client, server: Server,
                                                                  value: bool) -> None:
    out = chat(http, server, separate_reasoning=value, stream_reasoning=value, include_reasoning=value)
    assert out["choices"][0]["message"]["content"] == chat(http, server)["choices"][0]["message"]["content"]


def test_a_reasoning_model_refuses_the_flags_it_would_need_a_parser_for() -> None:
    thinker = SimpleNamespace(backend=SimpleNamespace(token_to_id=lambda t: 7 if t == "</think>" else None))
    base = {"model": "m", "messages": USER}
    check_extensions(ChatCompletionRequest(**base, separate_reasoning=False, include_reasoning=True,
                                           stream_reasoning=True), thinker)  # type: ignore[arg-type]
    for field, value in (("separate_reasoning", True), ("include_reasoning", False), ("stream_reasoning", False)):
        with pytest.raises(ApiError) as exc:
            check_extensions(ChatCompletionRequest(**base, **{field: value}), thinker)  # type: ignore[arg-type]
        assert exc.value.status == 400 and exc.value.param == field


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(("field", "value"), [("return_hidden_states", True), ("kv_transfer_params", {}),
                                              ("kv_transfer_params", {"do_remote_decode": True}),
                                              ("no_such_field", 1)])
def test_values_that_cannot_be_honoured_are_refused_by_name(http: httpx.Client, server: Server, path: str,
                                                            field: str, value: object) -> None:
    body = {"model": server.model, "max_tokens": 2, field: value}
    body |= {"messages": USER} if "chat" in path else {"prompt": "Hi"}
    error = refused(http, path, body)
    assert error["param"] == field and field in error["message"]
