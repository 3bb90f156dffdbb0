"""Bad input gets a 400 (413 for a huge body, 401 without the key) in each API's own error shape, names the
problem, and disturbs nothing: afterwards requests work, cached prefixes still hit, no block is left in use."""

from __future__ import annotations

import http.client
import json
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from fastapi.responses import StreamingResponse

from hafiza.engine.async_engine import AsyncEngine
from hafiza.server import ServerSettings, create_app
from hafiza.server.launch import ServerThread
from tests.server.conftest import API_KEY, Server, long_text

MSG = [{"role": "user", "content": "hi"}]
CC = {"type": "ephemeral"}
TOO_LONG = long_text("too-long", 9000)


def anthropic_cases(model: str) -> list[tuple[str, object, str]]:
    five = [{"type": "text", "text": f"block {i}", "cache_control": CC} for i in range(5)]
    return [
        ("malformed json", b'{"model": "x", "messages": [', "malformed JSON"),
        ("not an object", b"[1, 2]", "JSON object"),
        ("empty body", b"", "empty"),
        ("wrong type", {"model": model, "max_tokens": "ten", "messages": MSG}, "max_tokens"),
        ("messages not a list", {"model": model, "max_tokens": 5, "messages": "hi"}, "messages"),
        ("missing max_tokens", {"model": model, "messages": MSG}, "max_tokens: field required"),
        ("empty messages", {"model": model, "max_tokens": 5, "messages": []}, "at least one message"),
        ("empty content", {"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": ""}]},
         "non-empty"),
        ("bad role", {"model": model, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
         "messages[0].role"),
        ("unknown model", {"model": "claude-nope", "max_tokens": 5, "messages": MSG}, "claude-nope"),
        ("temperature", {"model": model, "max_tokens": 5, "messages": MSG, "temperature": 1.5}, "temperature"),
        ("image block", {"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, "image"),
        ("prompt too long", {"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": TOO_LONG}]},
         "exceeds the model's context of 8192"),
        ("max_tokens too large", {"model": model, "max_tokens": 100000, "messages": MSG}, "max_tokens 100000"),
        ("five breakpoints", {"model": model, "max_tokens": 5, "system": five, "messages": MSG},
         "A maximum of 4 blocks with cache_control may be provided. Found 5."),
        ("1h after 5m", {"model": model, "max_tokens": 5, "messages": MSG, "system": [
            {"type": "text", "text": "a", "cache_control": CC},
            {"type": "text", "text": "b", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}, "ttl='1h'"),
        ("bad ttl", {"model": model, "max_tokens": 5, "messages": MSG, "system": [
            {"type": "text", "text": "a", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}, "ttl"),
    ]


def openai_cases(model: str) -> list[tuple[str, object, str]]:
    return [
        ("malformed json", b"{nope", "malformed JSON"),
        ("wrong type", {"model": model, "messages": MSG, "max_tokens": 2.5}, "max_tokens"),
        ("messages not a list", {"model": model, "messages": {"role": "user"}}, "messages"),
        ("empty messages", {"model": model, "messages": []}, "at least one message"),
        ("unknown model", {"model": "gpt-nope", "messages": MSG}, "gpt-nope"),
        ("n < 1", {"model": model, "messages": MSG, "n": 0}, "n: Input should be greater than or equal to 1"),
        ("unknown field", {"model": model, "messages": MSG, "functions_v9": []}, "functions_v9: Extra inputs"),
        ("image part", {"model": model, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "image_url"),
        ("prompt too long", {"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": TOO_LONG}]},
         "exceeds the model's context of 8192"),
        ("max_tokens too large", {"model": model, "messages": MSG, "max_tokens": 100000}, "max_tokens 100000"),
    ]


def post(http: httpx.Client, path: str, body: object, **kw) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"content-type": "application/json"}, **kw)
    return http.post(path, json=body, **kw)


def assert_anthropic_error(r: httpx.Response, status: int, kind: str, needle: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    assert needle in body["error"]["message"], body
    assert "Traceback" not in r.text


def assert_openai_error(r: httpx.Response, status: int, needle: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and needle in err["message"], err
    assert "Traceback" not in r.text
    return err


def test_anthropic_bad_inputs(http: httpx.Client, server: Server) -> None:
    for name, body, needle in anthropic_cases(server.model):
        r = post(http, "/v1/messages", body)
        assert_anthropic_error(r, 400, "invalid_request_error", needle)
        if isinstance(body, dict) and name not in ("missing max_tokens",):
            r = post(http, "/v1/messages", {**body, "stream": True})
            assert_anthropic_error(r, 400, "invalid_request_error", needle)


def test_openai_bad_inputs(http: httpx.Client, server: Server) -> None:
    for _, body, needle in openai_cases(server.model):
        assert_openai_error(post(http, "/v1/chat/completions", body), 400, needle)
    err = assert_openai_error(post(http, "/v1/chat/completions", {"model": "x", "messages": MSG}), 400, "x")
    assert err["param"] == "model" and err["code"] == "model_not_found"


def test_body_over_the_limit(http: httpx.Client, server: Server) -> None:
    huge = {"model": server.model, "max_tokens": 1, "messages": [{"role": "user", "content": "x" * 300_000}]}
    assert_anthropic_error(post(http, "/v1/messages", huge), 413, "request_too_large", "exceeds the limit")
    assert_openai_error(post(http, "/v1/chat/completions", huge), 413, "exceeds the limit")

    def chunks():
        yield b'{"model": "x", "messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"y" * 10_000
        yield b'"}]}'

    r = http.post("/v1/messages", content=chunks(), headers={"content-type": "application/json"})
    assert_anthropic_error(r, 413, "request_too_large", "exceeds the limit")


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert_anthropic_error(http.post("/v1/messages/nope", json={}), 404, "not_found_error", "no route")
    assert http.get("/v1/chat/completions").status_code == 405
    assert "error" in http.get("/v1/chat/completions").json()


def test_errors_disturb_nothing(http: httpx.Client, server: Server, warm_document: str) -> None:
    for _, body, _ in anthropic_cases(server.model):
        post(http, "/v1/messages", body)
    for _, body, _ in openai_cases(server.model):
        post(http, "/v1/chat/completions", body)
    r = http.post("/v1/messages", json={
        "model": server.model, "max_tokens": 2, "messages": [{"role": "user", "content": "Still there?"}],
        "system": [{"type": "text", "text": warm_document, "cache_control": CC}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["cache_read_input_tokens"] >= 1024
    assert server.wait_idle() == 0


@pytest.mark.parametrize("headers,status", [({}, 401), ({"x-api-key": "wrong"}, 401),
                                            ({"authorization": "Bearer wrong"}, 401),
                                            ({"authorization": f"Bearer {API_KEY}"}, 200),
                                            ({"x-api-key": API_KEY}, 200)])
def test_anthropic_key(keyed_server: Server, headers: dict, status: int) -> None:
    r = httpx.post(f"{keyed_server.url}/v1/messages", headers=headers, timeout=120, json={
        "model": keyed_server.model, "max_tokens": 1, "messages": MSG})
    assert r.status_code == status, r.text
    if status == 401:
        assert_anthropic_error(r, 401, "authentication_error", "x-api-key")


@pytest.mark.parametrize("headers,status", [({}, 401), ({"authorization": "Bearer wrong"}, 401),
                                            ({"x-api-key": API_KEY}, 401),
                                            ({"authorization": f"Bearer {API_KEY}"}, 200)])
def test_openai_key(keyed_server: Server, headers: dict, status: int) -> None:
    r = httpx.post(f"{keyed_server.url}/v1/chat/completions", headers=headers, timeout=120, json={
        "model": keyed_server.model, "max_tokens": 1, "messages": MSG})
    assert r.status_code == status, r.text
    if status == 401:
        assert_openai_error(r, 401, "API key")


def test_official_clients_send_their_keys(keyed_server: Server) -> None:
    import anthropic
    import openai

    a = anthropic.Anthropic(base_url=keyed_server.url, api_key=API_KEY, max_retries=0)
    assert a.messages.create(model=keyed_server.model, max_tokens=1, messages=MSG).usage.output_tokens == 1
    o = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=API_KEY, max_retries=0)
    assert o.chat.completions.create(model=keyed_server.model, max_tokens=1, messages=MSG).usage.completion_tokens
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=keyed_server.url, api_key="bad", max_retries=0).messages.create(
            model=keyed_server.model, max_tokens=1, messages=MSG)
    assert httpx.get(f"{keyed_server.url}/health").status_code == 200
    assert httpx.get(f"{keyed_server.url}/v1/models").status_code == 401


# Hostile bodies: 400 in the API's shape, never a 500.

def hostile_bodies(model: str) -> list[tuple[str, bytes, str]]:
    head = f'{{"model": "{model}", "max_tokens": 1, "messages": [{{"role": "user", "content": "hi"}}]'.encode()
    return [
        ("nested 1,000 deep", head + b', "x": ' + b"[" * 1000 + b"]" * 1000 + b"}", "deeper than the limit of 100"),
        ("nested 100,000 deep", head + b', "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
         "deeper than the limit of 100"),
        ("lone surrogate in content",
         f'{{"model": "{model}", "max_tokens": 1, "messages": [{{"role": "user", "content": "a\\ud800b"}}]}}'.encode(),
         "messages[0].content: text has a lone UTF-16 surrogate (\\ud800) at character 1"),
        ("lone surrogate in model",
         b'{"model": "\\udfff", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}', "model:"),
        ("lone surrogate in a key", head + b', "\\ud800": 1}', "a key has a lone UTF-16 surrogate"),
        ("NaN", head + b', "temperature": NaN}', "NaN is not a JSON value"),
        ("Infinity", head + b', "top_p": -Infinity}', "-Infinity is not a JSON value"),
        ("5,000-digit integer", head + b', "max_tokens": ' + b"9" * 5000 + b"}", "cannot be read"),
    ]


def test_hostile_bodies_get_400(http: httpx.Client, server: Server) -> None:
    for name, body, needle in hostile_bodies(server.model):
        assert_anthropic_error(post(http, "/v1/messages", body), 400, "invalid_request_error", needle)
        assert_anthropic_error(post(http, "/v1/messages/count_tokens", body), 400, "invalid_request_error", needle)
        assert_openai_error(post(http, "/v1/chat/completions", body), 400, needle), name
    surrogates = [{"system": "\ud800"}, {"stop_sequences": ["ok\udbff"]},
                  {"messages": [{"role": "user", "content": [{"type": "text", "text": "x\udc00"}]}]}]
    for extra in surrogates:
        body = json.dumps({"model": server.model, "max_tokens": 1, "messages": MSG, **extra}).encode()
        assert_anthropic_error(post(http, "/v1/messages", body), 400, "invalid_request_error", "lone UTF-16 surrogate")


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 10**30])
def test_seed_outside_int64_gets_400(http: httpx.Client, server: Server, seed: int) -> None:
    body = {"model": server.model, "max_tokens": 1, "messages": MSG, "temperature": 1.0, "seed": seed}
    err = assert_openai_error(post(http, "/v1/chat/completions", body), 400, "seed")
    assert err["param"] == "seed"


def test_engine_refusal_names_the_field_in_each_apis_words(http: httpx.Client, server: Server) -> None:
    """The engine's one check carries the field at fault; each API reports it under its own name."""
    chat = {"model": server.model, "max_tokens": 10**6, "messages": MSG}
    err = assert_openai_error(post(http, "/v1/chat/completions", chat), 400, "exceeds the model's context")
    assert err["param"] == "max_tokens"
    resp = {"model": server.model, "max_output_tokens": 10**6, "input": "hi"}
    err = assert_openai_error(post(http, "/v1/responses", resp), 400, "exceeds the model's context")
    assert err["param"] == "max_output_tokens"
    legacy = {"model": server.model, "max_tokens": 10**6, "prompt": ["hi", "there"]}
    err = assert_openai_error(post(http, "/v1/completions", legacy), 400, "exceeds the model's context")
    assert err["param"] == "max_tokens"


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), 0])
def test_seed_at_the_int64_ends_is_served(http: httpx.Client, server: Server, seed: int) -> None:
    body = {"model": server.model, "max_tokens": 2, "messages": MSG, "temperature": 1.0, "seed": seed}
    r = post(http, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text


# An unexpected failure is a 500 in the API's shape, and the keep-alive connection survives it.

@pytest.fixture(scope="module")
def failing_server(engine: AsyncEngine, server: Server) -> Iterator[str]:
    """The real app plus routes that fail the way a bug would (before and after the response starts)."""
    app = create_app(engine, ServerSettings(model_name=server.model))

    async def boom() -> None:
        raise RuntimeError("a bug")

    async def half_stream() -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"data: first\n\n"
            raise RuntimeError("a bug mid-stream")

        return StreamingResponse(chunks(), media_type="text/event-stream")

    for path in ("/v1/messages/boom", "/v1/chat/boom"):
        app.add_api_route(path, boom, methods=["POST"])
    app.add_api_route("/v1/chat/half", half_stream, methods=["POST"])
    thread = ServerThread(app).start()
    yield thread.url
    thread.stop()


def test_unexpected_errors_keep_the_connection(failing_server: str, server: Server) -> None:
    host, port = failing_server.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    ok = json.dumps({"model": server.model, "max_tokens": 1, "messages": MSG})
    try:
        conn.request("POST", "/v1/messages/boom", body="{}", headers={"content-type": "application/json"})
        r = conn.getresponse()
        body = json.loads(r.read())
        assert r.status == 500 and body["type"] == "error" and body["error"]["type"] == "api_error", body
        assert "RuntimeError" in body["error"]["message"] and "a bug" not in body["error"]["message"]
        sock = conn.sock
        assert sock is not None
        conn.request("POST", "/v1/chat/boom", body="{}", headers={"content-type": "application/json"})
        r = conn.getresponse()
        body = json.loads(r.read())
        assert r.status == 500 and body["error"]["type"] == "server_error", body
        conn.request("POST", "/v1/chat/half", body="{}", headers={"content-type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and r.read() == b"data: first\n\n"
        conn.request("POST", "/v1/messages", body=ok, headers={"content-type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200, r.read()
        r.read()
        assert conn.sock is sock  # one connection throughout: never reset, never reopened
    finally:
        conn.close()


HUGE = 2**64 + 1


@pytest.mark.parametrize("path,field", [
    ("/v1/messages", {"max_tokens": HUGE}), ("/v1/messages", {"top_k": HUGE}),
    ("/v1/chat/completions", {"max_tokens": HUGE}), ("/v1/chat/completions", {"max_completion_tokens": HUGE}),
    ("/v1/chat/completions", {"top_k": HUGE}), ("/v1/chat/completions", {"n": HUGE}),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": HUGE}),
    ("/v1/chat/completions", {"logit_bias": {str(HUGE): 1.0}}),
    ("/v1/chat/completions", {"logit_bias": {"-1": 1.0}}),
    ("/v1/chat/completions", {"logit_bias": {"9" * 5000: 1.0}}),
    ("/v1/chat/completions", {"logit_bias": {"\u00b2": 1.0}}),
    ("/v1/chat/completions", {"logit_bias": {"49152": 1.0}}),
])
def test_integers_past_64_bits_get_400_or_are_served(http: httpx.Client, server: Server, path: str,
                                                     field: dict) -> None:
    """Every integer parameter: a value past 64 bits is refused with a 400, or (top_k: larger than the
    vocabulary means off) served; never a 500."""
    body = {"model": server.model, "messages": MSG, "max_tokens": 1, "temperature": 1.0, **field}
    r = post(http, path, body)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert "Traceback" not in r.text and "internal" not in r.text


def test_a_failing_middleware_keeps_the_connection(engine: AsyncEngine, server: Server,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The catch-all wraps every middleware, not only the routes: a bug in the browser guard is a 500 too."""
    from hafiza.server.guard import BrowserGuard

    def broken(self: BrowserGuard, method: str, headers: dict[str, str]) -> None:
        raise RuntimeError("a guard bug")

    monkeypatch.setattr(BrowserGuard, "check", broken)
    thread = ServerThread(create_app(engine, ServerSettings(model_name=server.model))).start()
    host, port = thread.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        for _ in range(2):
            conn.request("POST", "/v1/messages", body="{}", headers={"content-type": "application/json"})
            r = conn.getresponse()
            body = json.loads(r.read())
            assert r.status == 500 and body["error"]["type"] == "api_error", body
            assert "RuntimeError" in body["error"]["message"]
    finally:
        conn.close()
        thread.stop()
