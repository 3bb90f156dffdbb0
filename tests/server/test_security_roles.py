"""Roles and browser safety over real HTTP: the admin key alone acts on the dashboard and reads prompt text;
cross-origin and non-JSON state changes, foreign Host headers (DNS rebinding) and CORS are refused unless
configured; /metrics and /dashboard/state are protected as configured."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from difflib import SequenceMatcher

import httpx
import pytest

from hafiza.engine.async_engine import AsyncEngine
from hafiza.errors import HafizaError
from hafiza.server import ServerSettings
from hafiza.server.settings import Access, read_keys_file
from tests.server.conftest import Server, _start, long_text
from tests.support.serve import ServeProcess, run_cli

ALICE, BOB, ADMIN = "role-alice-1", "role-bob-2", "role-admin-3"


@pytest.fixture(scope="module")
def keyed(engine: AsyncEngine, server: Server) -> Iterator[Server]:
    settings = ServerSettings(model_name=server.model, api_keys=(ALICE, BOB), admin_key=ADMIN)
    for thread in _start(engine, settings):
        yield Server(thread.url, server.model, engine)


def serve(engine: AsyncEngine, model: str, **kw: object) -> Iterator[httpx.Client]:
    for thread in _start(engine, ServerSettings(model_name=model, **kw)):
        with httpx.Client(base_url=thread.url, timeout=300) as c:
            yield c


def ask(c: httpx.Client, model: str, text: str, key: str | None = None, max_tokens: int = 1) -> httpx.Response:
    headers = {"x-api-key": key} if key else {}
    r = c.post("/v1/messages", headers=headers, json={
        "model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    return r


def _shared_text(a: str, b: str) -> str:
    """The longest piece of text a and b share (a preview's tail also holds the template and the answer)."""
    m = SequenceMatcher(None, a, b, autojunk=False).find_longest_match(0, len(a), 0, len(b))
    return a[m.a : m.a + m.size]


def test_an_api_key_reads_no_prompt_text_and_clears_nothing(keyed: Server) -> None:
    """The reproduction: with one shared key every user could read others' prompts and clear the tiers."""
    secret = "Confidential: the merger with Globex closes on Friday. " + long_text("role-secret", 120)
    with httpx.Client(base_url=keyed.url, timeout=300) as c:
        ask(c, keyed.model, secret, ALICE, max_tokens=6)
        state = c.get("/dashboard/state", headers={"x-api-key": BOB})
        assert state.status_code == 200 and state.json()["admin"] is False
        assert state.json()["prefixes"] and all(p["head"] is None and p["tail"] is None and p["id"] is None
                                                for p in state.json()["prefixes"])
        assert "Globex" not in state.text
        for path in ("/dashboard/tiers/pool/clear", f"/dashboard/prefixes/{'0' * 32}/drop"):
            r = c.post(path, json={}, headers={"x-api-key": BOB})
            assert r.status_code == 403 and "admin key" in r.json()["error"]["message"]
        assert keyed.engine_stats().blocks.cached > 0
        admin = c.get("/dashboard/state", headers={"x-api-key": ADMIN}).json()
        seen = [_shared_text(p["tail"] or "", secret) for p in admin["prefixes"]]
        seen = [text for text in seen if len(text) >= 20]
        assert admin["admin"] is True and seen, "the admin's listing shows none of the prompt's text"
        assert not any(text in state.text for text in seen)
        assert c.post("/dashboard/tiers/pool/clear", json={}, headers={"x-api-key": ADMIN}).status_code == 200
        assert c.post("/dashboard/tiers/pool/clear", json={}, headers={"x-api-key": "nope"}).status_code == 401
        assert c.get("/dashboard/state", headers={"x-api-key": "nope"}).status_code == 401


def test_api_keys_and_the_admin_key_on_the_api(keyed: Server) -> None:
    with httpx.Client(base_url=keyed.url, timeout=300) as c:
        for key in (ALICE, BOB, ADMIN):
            ask(c, keyed.model, "Hello", key)
        r = c.post("/v1/messages", headers={"x-api-key": "wrong"},
                   json={"model": keyed.model, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = c.post("/v1/chat/completions", json={"model": keyed.model, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 401


def test_without_an_admin_key_nobody_acts(engine: AsyncEngine, server: Server) -> None:
    for c in serve(engine, server.model, api_key=ALICE):
        r = c.post("/dashboard/tiers/pool/clear", json={}, headers={"x-api-key": ALICE})
        assert r.status_code == 403 and "needs the admin key" in r.json()["error"]["message"]


def test_cross_origin_form_post_cannot_clear_the_pool(engine: AsyncEngine, server: Server) -> None:
    """The reproduction: an open server on localhost, a page elsewhere posting a form to it."""
    for c in serve(engine, server.model):
        ask(c, server.model, long_text("role-csrf", 40))
        before = server.engine_stats().blocks.cached
        assert before > 0
        form = {"origin": "http://evil.example", "sec-fetch-site": "cross-site",
                "content-type": "application/x-www-form-urlencoded"}
        r = c.post("/dashboard/tiers/pool/clear", content=b"x=1", headers=form)
        assert r.status_code == 403 and "cross-origin" in r.json()["error"]["message"]
        r = c.post("/dashboard/tiers/pool/clear", content=b"x=1", headers={"sec-fetch-site": "cross-site",
                                                                           "content-type": "text/plain"})
        assert r.status_code == 403 and "Sec-Fetch-Site" in r.json()["error"]["message"]
        r = c.post("/dashboard/tiers/pool/clear", content=b"{}", headers={"content-type": "text/plain"})
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
        r = c.post("/dashboard/tiers/pool/clear")
        assert r.status_code == 415
        assert server.engine_stats().blocks.cached >= before
        metrics = c.get("/metrics").text
        assert 'hafiza:request_errors_total{api="openai",status="403"} 2.0' in metrics
        assert 'hafiza:request_errors_total{api="openai",status="415"} 2.0' in metrics
        same = {"origin": str(c.base_url).rstrip("/"), "sec-fetch-site": "same-origin"}
        r = c.post("/dashboard/tiers/pool/clear", json={}, headers=same)
        assert r.status_code == 200 and r.json()["dropped_blocks"] > 0


def test_text_plain_json_is_refused_on_the_apis(http: httpx.Client, server: Server) -> None:
    body = json.dumps({"model": server.model, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]})
    r = http.post("/v1/messages", content=body, headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["type"] == "error"
    r = http.post("/v1/chat/completions", content=body, headers={"content-type": "text/plain;charset=UTF-8"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = http.post("/v1/messages", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_foreign_host_headers_are_refused(http: httpx.Client, server: Server) -> None:
    """DNS rebinding: a name the attacker controls, resolved to 127.0.0.1, reaches the server with its own Host."""
    port = server.url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}"):
        r = http.get("/health", headers={"host": host})
        assert r.status_code == 400 and "allowed_hosts" in r.json()["error"]["message"], host
    r = http.post("/dashboard/tiers/pool/clear", json={}, headers={"host": f"rebind.example:{port}"})
    assert r.status_code == 400
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert http.get("/health", headers={"host": host}).status_code == 200, host


def test_allowed_hosts_are_configurable(engine: AsyncEngine, server: Server) -> None:
    for c in serve(engine, server.model, allowed_hosts=("api.internal",)):
        assert c.get("/health", headers={"host": "api.internal:8000"}).status_code == 200
        assert c.get("/health").status_code == 400  # 127.0.0.1 was not listed
    for c in serve(engine, server.model, allowed_hosts=("*",)):
        assert c.get("/health", headers={"host": "anything.example"}).status_code == 200


def test_cors_is_off_unless_configured(http: httpx.Client, engine: AsyncEngine, server: Server) -> None:
    preflight = {"origin": "http://app.example", "access-control-request-method": "POST",
                 "access-control-request-headers": "content-type,x-api-key"}
    r = http.options("/v1/messages", headers=preflight)
    assert "access-control-allow-origin" not in r.headers
    r = http.get("/v1/models", headers={"origin": "http://app.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = http.post("/v1/messages", json={}, headers={"origin": "http://app.example"})
    assert r.status_code == 403
    for c in serve(engine, server.model, cors_origins=("http://app.example",)):
        r = c.options("/v1/messages", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        r = c.post("/v1/messages", headers={"origin": "http://app.example"}, json={
            "model": server.model, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        assert "x-hafiza-cache" in r.headers["access-control-expose-headers"]
        r = c.options("/v1/messages", headers={**preflight, "origin": "http://other.example"})
        assert "access-control-allow-origin" not in r.headers
        assert c.post("/v1/messages", json={}, headers={"origin": "http://other.example"}).status_code == 403


@pytest.mark.parametrize(("level", "none", "api", "admin"), [
    (Access.NONE, 200, 200, 200), (Access.API, 401, 200, 200), (Access.ADMIN, 401, 403, 200)])
def test_metrics_and_dashboard_protection(engine: AsyncEngine, server: Server, level: Access, none: int,
                                          api: int, admin: int) -> None:
    for c in serve(engine, server.model, api_key=ALICE, admin_key=ADMIN, metrics_auth=level, dashboard_auth=level):
        for path in ("/metrics", "/dashboard/state"):
            assert c.get(path).status_code == none, path
            assert c.get(path, headers={"authorization": f"Bearer {ALICE}"}).status_code == api, path
            assert c.get(path, headers={"x-api-key": ADMIN}).status_code == admin, path


def test_default_protection(engine: AsyncEngine, server: Server) -> None:
    for c in serve(engine, server.model, api_key=ALICE):
        assert c.get("/metrics").status_code == 200
        assert c.get("/dashboard/state").status_code == 401
        assert c.get("/dashboard").status_code == 200  # the page holds no data; it asks for a key


def test_settings_refuse_unsafe_combinations(tmp_path) -> None:
    with pytest.raises(HafizaError, match="must differ"):
        ServerSettings(api_keys=(ALICE,), admin_key=ALICE)
    with pytest.raises(HafizaError, match="needs an admin key"):
        ServerSettings(api_keys=(ALICE,), metrics_auth=Access.ADMIN)
    with pytest.raises(HafizaError, match="must not be empty"):
        ServerSettings(api_keys=("",))
    path = tmp_path / "keys.txt"
    path.write_text("# team keys\nk-one\n\n  k-two  \n", encoding="utf-8")
    assert read_keys_file(path) == ("k-one", "k-two")
    path.write_text("# nothing\n", encoding="utf-8")
    with pytest.raises(HafizaError, match="no keys"):
        read_keys_file(path)
    s = ServerSettings(api_key="a", api_keys=("b", "a"))
    assert s.keys == ("a", "b") and s.partition_by_key and not ServerSettings(api_key="a").partition_by_key


@pytest.mark.parametrize(("args", "message"), [
    (("--metrics-auth", "bogus"), "--metrics-auth must be none, api or admin, got 'bogus'"),
    (("--api-key", "k1", "--admin-key", "k1"), "--admin-key: the admin key must differ from every API key"),
    (("--api-key", "k1", "--dashboard-auth", "admin"), "--dashboard-auth: dashboard_auth admin needs an admin key"),
    (("--api-keys-file", "/nonexistent/keys"), "--api-keys-file: keys file /nonexistent/keys: cannot read it")])
def test_serve_refuses_bad_security_flags_in_one_line(args: tuple[str, ...], message: str,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    done = run_cli(["serve", *args], monkeypatch, capsys)
    assert done.returncode == 2 and message in done.stderr + done.stdout
    assert "Traceback" not in done.stderr + done.stdout


def test_serve_with_several_keys_partitions_and_checks_hosts(tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# tenants\n{BOB}\n", encoding="utf-8")
    server = ServeProcess(tmp_path / "serve.log", "--api-key", ALICE, "--api-keys-file", str(keys),
                          "--admin-key", ADMIN)
    port = server.port
    try:
        server.wait_ready(timeout_s=240, api_key=ALICE)
        model = server.model
        with httpx.Client(base_url=server.url, timeout=300) as c:
            text = long_text("cli-keys", 200)

            def cached_tokens(key: str) -> int:
                r = c.post("/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, json={
                    "model": model, "max_tokens": 1, "messages": [{"role": "user", "content": text}]})
                assert r.status_code == 200, r.text
                return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

            assert cached_tokens(ALICE) == 0
            assert cached_tokens(BOB) == 0  # the keys file's key is a partition of its own
            assert cached_tokens(ALICE) >= 192
            assert c.get("/health", headers={"host": f"evil.example:{port}"}).status_code == 400
            assert c.get("/dashboard/state", headers={"x-api-key": BOB}).json()["admin"] is False
            assert c.post("/dashboard/tiers/pool/clear", json={}, headers={"x-api-key": BOB}).status_code == 403
            assert c.post("/dashboard/tiers/pool/clear", json={}, headers={"x-api-key": ADMIN}).status_code == 200
    finally:
        server.stop(signal.SIGINT, timeout_s=60)
    out = server.output()
    assert "Traceback" not in out and ALICE not in out and BOB not in out
