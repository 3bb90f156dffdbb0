"""Tenants stay apart, over real HTTP: cache partitions (per API key, per `cache_salt`) and what `x-hafiza-cache`
may reveal, including the PIN-probing attack that read another caller's prompt through the explanation header."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from hafiza.engine.async_engine import AsyncEngine
from hafiza.server import ServerSettings
from tests.server.conftest import Server, _start, long_text

ALICE, BOB, ADMIN = "key-alice-1", "key-bob-2", "admin-key-3"
PIN = "4821"
FILLER = " ".join(["filler"] * 40)


def header(r: httpx.Response) -> dict[str, str]:
    """`x-hafiza-cache` as a dict ('status' for its first part)."""
    first, *rest = (p.strip() for p in r.headers["x-hafiza-cache"].split(";"))
    return {"status": first, **dict(p.split("=", 1) for p in rest)}


def chat(client: httpx.Client, model: str, system: str, user: str, key: str | None = None,
         salt: str | None = None) -> httpx.Response:
    body: dict[str, object] = {"model": model, "max_tokens": 1, "temperature": 0,
                               "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"authorization": f"Bearer {key}"} if key else {}
    r = client.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r


def cached(r: httpx.Response) -> int:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


Send = Callable[[str], httpx.Response]


def probe_pin(victim: Callable[[], httpx.Response], probe: Send) -> str | None:
    """The attack: guess the PIN digit by digit from the `offset=` where each guess stopped agreeing with the
    victim's cached prompt (`similar=` naming a request that is not the attacker's own). The victim keeps using
    its conversation between guesses, as a live chat does. Returns the PIN, or None when the header does not
    single out one digit."""
    known, own = "", set()
    for _ in range(len(PIN)):
        offsets = {}
        for d in "0123456789":
            victim()
            r = probe(f"The vault PIN is {known}{d}|{FILLER}")  # filler: the guess ends before the cached blocks do
            own.add(r.json()["id"])
            h = header(r)
            offsets[d] = int(h["offset"]) if "offset" in h and h.get("similar") not in own else -1
        best = max(offsets.values())
        winners = [d for d, o in offsets.items() if o == best]
        if best < 0 or len(winners) != 1:
            return None
        known += winners[0]
    return known


@pytest.fixture(scope="module")
def tenants(engine: AsyncEngine, server: Server) -> Iterator[Server]:
    """Two API keys and an admin key: each key its own partition; explanation details turned on by the operator."""
    settings = ServerSettings(model_name=server.model, api_keys=(ALICE, BOB), admin_key=ADMIN, explain_details=True)
    for thread in _start(engine, settings):
        yield Server(thread.url, server.model, engine)


@pytest.fixture(scope="module")
def default_server(engine: AsyncEngine, server: Server) -> Iterator[Server]:
    """An open server with the default settings (no explanation details)."""
    for thread in _start(engine, ServerSettings(model_name=server.model)):
        yield Server(thread.url, server.model, engine)


def client(s: Server) -> httpx.Client:
    return httpx.Client(base_url=s.url, timeout=300)


def victim_prompt(tag: str) -> tuple[str, str]:
    return long_text(tag, 60), f"The vault PIN is {PIN}. Keep it safe and never say it."


def test_pin_probe_works_with_details_in_one_partition(server: Server) -> None:
    """The reproduction: with `--explain-details` and a shared partition the PIN comes out in 40 guesses (this is
    what every caller could do before; the operator now has to turn details on for it)."""
    system, secret = victim_prompt("pin-shared")
    with client(server) as c:
        found = probe_pin(lambda: chat(c, server.model, system, secret), lambda g: chat(c, server.model, system, g))
    assert found == PIN


def test_pin_probe_fails_by_default(default_server: Server) -> None:
    system, secret = victim_prompt("pin-default")
    with client(default_server) as c:
        m = default_server.model
        found = probe_pin(lambda: chat(c, m, system, secret), lambda g: chat(c, m, system, g))
        h = header(chat(c, m, system, f"The vault PIN is 48|{FILLER}"))
    assert found is None
    assert "offset" not in h and "similar" not in h and "at" not in h and h["reason"] == "diverged"


def test_pin_probe_fails_across_api_keys(tenants: Server) -> None:
    system, secret = victim_prompt("pin-keys")
    alice_ids: set[str] = set()

    def victim() -> httpx.Response:
        r = chat(c, m, system, secret, ALICE)
        alice_ids.add(r.json()["id"])
        return r

    with client(tenants) as c:
        m = tenants.model
        found = probe_pin(victim, lambda g: chat(c, m, system, g, BOB))
        right, wrong = chat(c, m, system, secret, BOB), chat(c, m, system, secret.replace(PIN, "9999"), BOB)
        again = victim()
    assert found is None
    assert cached(right) == cached(wrong)  # the right guess reuses only bob's own blocks: no hit, no time saved
    assert header(right).get("similar") not in alice_ids and header(wrong).get("similar") not in alice_ids
    assert cached(again) > cached(right) and header(again)["status"] == "hit"


def test_pin_probe_fails_across_salts(server: Server) -> None:
    system, secret = victim_prompt("pin-salts")
    with client(server) as c:
        m = server.model
        found = probe_pin(lambda: chat(c, m, system, secret, salt="tenant-a"),
                          lambda g: chat(c, m, system, g, salt="tenant-b"))
        right = chat(c, m, system, secret, salt="tenant-b")
        wrong = chat(c, m, system, secret.replace(PIN, "9999"), salt="tenant-b")
        unsalted = chat(c, m, system, secret)
    assert found is None
    assert cached(right) == cached(wrong)
    assert cached(unsalted) == 0  # neither salt's blocks serve the shared partition


def test_a_salted_request_never_hits_another_salts_blocks(server: Server) -> None:
    system, user = long_text("salted-pool", 200), "What is in these notes?"
    with client(server) as c:
        m = server.model
        first = chat(c, m, system, user, salt="s1")
        assert cached(first) == 0
        assert cached(chat(c, m, system, user, salt="s2")) == 0
        assert cached(chat(c, m, system, user)) == 0
        assert cached(chat(c, m, system, user, salt="s1")) >= 192  # its own partition still hits


def test_salt_combines_with_the_key_partition(tenants: Server) -> None:
    system, user = long_text("salted-keys", 200), "Summarise."
    with client(tenants) as c:
        m = tenants.model
        assert cached(chat(c, m, system, user, ALICE, salt="team")) == 0
        assert cached(chat(c, m, system, user, BOB, salt="team")) == 0
        assert cached(chat(c, m, system, user, ALICE)) == 0
        assert cached(chat(c, m, system, user, ADMIN, salt="team")) == 0  # the admin key is a partition too
        assert cached(chat(c, m, system, user, ALICE, salt="team")) >= 192


def test_one_key_or_shared_cache_keeps_one_partition(engine: AsyncEngine, server: Server) -> None:
    system, user = long_text("shared-keys", 200), "Summarise."
    settings = ServerSettings(model_name=server.model, api_keys=(ALICE, BOB), shared_cache=True)
    for thread in _start(engine, settings):
        with httpx.Client(base_url=thread.url, timeout=300) as c:
            assert cached(chat(c, server.model, system, user, ALICE)) == 0
            assert cached(chat(c, server.model, system, user, BOB)) >= 192


def test_cache_salt_on_the_anthropic_api(server: Server) -> None:
    system = long_text("salted-anthropic", 1100)
    body = {"model": server.model, "max_tokens": 1, "temperature": 0,
            "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "Hello?"}]}
    with client(server) as c:
        a = c.post("/v1/messages", json={**body, "cache_salt": "a"}).json()["usage"]
        b = c.post("/v1/messages", json={**body, "cache_salt": "b"}).json()["usage"]
        a2 = c.post("/v1/messages", json={**body, "cache_salt": "a"}).json()["usage"]
    assert a["cache_creation_input_tokens"] >= 1024 and b["cache_read_input_tokens"] == 0
    assert b["cache_creation_input_tokens"] >= 1024 and a2["cache_read_input_tokens"] >= 1024


def test_official_clients_send_cache_salt(server: Server) -> None:
    import anthropic
    import openai

    system = long_text("salted-clients", 200)
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    first = oai.chat.completions.create(model=server.model, messages=msgs, max_tokens=1, extra_body={"cache_salt": "x"})
    other = oai.chat.completions.create(model=server.model, messages=msgs, max_tokens=1, extra_body={"cache_salt": "y"})
    same = oai.chat.completions.create(model=server.model, messages=msgs, max_tokens=1, extra_body={"cache_salt": "x"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert same.usage.prompt_tokens_details.cached_tokens >= 192
    ant = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    reply = ant.messages.create(model=server.model, max_tokens=1, messages=[{"role": "user", "content": "Hi"}],
                                extra_body={"cache_salt": "x"})
    assert reply.usage.input_tokens > 0


@pytest.mark.parametrize(("path", "value", "problem"), [
    ("/v1/chat/completions", 42, "valid string"), ("/v1/chat/completions", "", "at least 1"),
    ("/v1/chat/completions", "s" * 257, "at most 256"), ("/v1/messages", ["a"], "valid string"),
    ("/v1/messages", "", "at least 1"), ("/v1/messages", "s" * 257, "at most 256")])
def test_bad_cache_salt_is_a_400_naming_it(http: httpx.Client, server: Server, path: str, value: object,
                                           problem: str) -> None:
    body = {"model": server.model, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}],
            "cache_salt": value}
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("cache_salt:") and problem in message
    if path == "/v1/chat/completions":
        assert r.json()["error"]["param"] == "cache_salt"
    else:
        assert r.json()["type"] == "error"
