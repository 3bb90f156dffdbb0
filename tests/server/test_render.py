"""POST /v1/chat/completions/render, /v1/completions/render and /v1/responses/render: vLLM's GenerateRequest
shape, the very ids the engine is then given for the same body (recorded at AsyncEngine.submit), tools and
templates included, no engine step, and 400s in the API's error shape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.conftest import API_KEY, Server, long_text

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture
def submitted(server: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[int]]]:
    """The prompt ids of every request queued on the engine while the test runs."""
    seen: list[list[int]] = []
    real = server.aengine.submit

    async def submit(ids: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(list(ids))
        return await real(ids, *args, **kwargs)

    monkeypatch.setattr(server.aengine, "submit", submit)
    yield seen


def rendered_then_run(http: httpx.Client, path: str, body: dict[str, Any], seen: list[list[int]]) -> Any:
    """Render `body`, check no engine request was made, run it, and return the render answer and what ran."""
    r = http.post(f"{path}/render", json=body)
    assert r.status_code == 200, r.text
    assert seen == [], "render queued an engine request"
    run = http.post(path, json=body)
    assert run.status_code == 200, run.text
    return r.json(), run.json()


def test_chat_render_is_the_prompt_the_engine_runs(http: httpx.Client, server: Server,
                                                   submitted: list[list[int]]) -> None:
    body = {"model": server.model, "max_tokens": 3, "temperature": 0, "cache_salt": "render-salt",
            "messages": [{"role": "system", "content": long_text("render-chat", 60)},
                         {"role": "user", "content": "What is the weather in Paris?"}]}
    rendered, run = rendered_then_run(http, "/v1/chat/completions", body, submitted)
    assert submitted == [rendered["token_ids"]]
    assert run["usage"]["prompt_tokens"] == len(rendered["token_ids"])
    assert rendered["request_id"].startswith("chatcmpl-") and rendered["model"] == server.model
    assert rendered["cache_salt"] == "render-salt" and rendered["stream"] is False
    assert rendered["kv_transfer_params"] is None and rendered["features"] is None
    sp = rendered["sampling_params"]
    assert sp["max_tokens"] == 3 and sp["temperature"] == 0 and sp["n"] == 1 and sp["structured_outputs"] is None


def test_chat_render_includes_tools_and_a_continued_final_message(http: httpx.Client, server: Server,
                                                                  submitted: list[list[int]]) -> None:
    messages = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "Let me"}]
    body = {"model": server.model, "max_tokens": 2, "temperature": 0, "tools": TOOLS, "messages": messages,
            "continue_final_message": True}
    rendered, _ = rendered_then_run(http, "/v1/chat/completions", body, submitted)
    assert submitted == [rendered["token_ids"]]
    without = http.post("/v1/chat/completions/render", json={k: v for k, v in body.items() if k != "tools"}).json()
    assert len(rendered["token_ids"]) > len(without["token_ids"])  # the tools are in the prompt
    assert server.aengine.engine.tokenizer.decode(rendered["token_ids"]).endswith("Let me")
    forced = http.post("/v1/chat/completions/render", json=body | {
        "continue_final_message": False, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert forced.json()["sampling_params"]["structured_outputs"] is not None


def test_completions_render_answers_one_request_per_prompt(http: httpx.Client, server: Server,
                                                           submitted: list[list[int]]) -> None:
    body = {"model": server.model, "prompt": ["The sky is", "Grass is"], "max_tokens": 2, "temperature": 0,
            "ignore_eos": True, "min_tokens": 1}
    rendered, run = rendered_then_run(http, "/v1/completions", body, submitted)
    assert isinstance(rendered, list) and len(rendered) == 2
    assert sorted(submitted) == sorted(r["token_ids"] for r in rendered)
    ids = http.post("/v1/completions/render", json=body | {"prompt": [[1, 2, 3, 4], [5, 6]]}).json()
    assert [r["token_ids"] for r in ids] == [[1, 2, 3, 4], [5, 6]]
    assert run["usage"]["prompt_tokens"] == sum(len(r["token_ids"]) for r in rendered)
    assert rendered[0]["sampling_params"]["ignore_eos"] is True and rendered[0]["sampling_params"]["min_tokens"] == 1


def test_responses_render_follows_previous_response_id(http: httpx.Client, server: Server,
                                                       submitted: list[list[int]]) -> None:
    first = http.post("/v1/responses", json={"model": server.model, "input": "Say hi.", "max_output_tokens": 3,
                                             "temperature": 0, "instructions": "Be brief."}).json()
    submitted.clear()
    body = {"model": server.model, "input": "And again.", "max_output_tokens": 3, "temperature": 0,
            "previous_response_id": first["id"], "tools": [{"type": "function", "name": "get_weather",
                                                             "parameters": TOOLS[0]["function"]["parameters"]}]}
    rendered, run = rendered_then_run(http, "/v1/responses", body, submitted)
    assert submitted == [rendered["token_ids"]]
    assert run["usage"]["input_tokens"] == len(rendered["token_ids"])
    assert rendered["sampling_params"]["max_tokens"] == 3


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions/render", {"messages": []}, "messages"),
    ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": "hi"}], "bogus": 1}, "bogus"),
    ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6},
     "max_tokens"),
    ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 5,
                                     "max_tokens": 2}, "min_tokens"),
    ("/v1/completions/render", {"prompt": [10**9]}, "prompt"),
    ("/v1/completions/render", {"prompt": "hi", "return_hidden_states": True}, "return_hidden_states"),
    ("/v1/responses/render", {"input": "hi", "previous_response_id": "resp_missing"}, "previous_response_id"),
    ("/v1/responses/render", {"input": "hi", "max_output_tokens": -1}, "max_output_tokens"),
])
def test_bad_bodies_are_400s_in_the_openai_shape(http: httpx.Client, server: Server, path: str,
                                                  body: dict[str, Any], param: str) -> None:
    r = http.post(path, json={"model": server.model, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_malformed_json_and_a_missing_key_are_refused(http: httpx.Client, keyed_server: Server) -> None:
    r = http.post("/v1/chat/completions/render", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    body = {"model": keyed_server.model, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=keyed_server.url, timeout=60) as keyed:
        assert keyed.post("/v1/chat/completions/render", json=body).status_code == 401
        ok = keyed.post("/v1/chat/completions/render", json=body, headers={"authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200 and ok.json()["token_ids"]
