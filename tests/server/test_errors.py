"""Bad input gets a 400 (413 for a huge body, 401 without the key) in each API's own error shape, names the
problem, and disturbs nothing: afterwards requests work, cached prefixes still hit, no block is left in use."""

from __future__ import annotations

import httpx
import pytest

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
        ("n > 1", {"model": model, "messages": MSG, "n": 2}, "n=1"),
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
