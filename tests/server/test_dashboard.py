"""The dashboard in a real headless Chromium (Debian's `chromium`, driven by Playwright) against a real server.

The server is uvicorn on a loopback port over the default model, with a RAM store tier. Checks: the page loads
without console errors, its charts move while requests run, dropping a cached prefix from the table evicts it
(the next identical request reads fewer cached tokens), the state needs a key and the actions the admin key.
Set HAFIZA_DASHBOARD_SCREENSHOT=docs/dashboard.png to refresh the committed screenshot.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hafiza.engine import EngineConfig, LLMEngine
from hafiza.engine.async_engine import AsyncEngine
from hafiza.engine.speculative import SpeculativeConfig
from hafiza.models import LoadedModel
from hafiza.server import ServerSettings, create_app
from hafiza.server.launch import ServerThread, served_name
from hafiza.server.store import StoreOptions, connect_store, serve_store

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
KEY = "dash-key-42"
ADMIN = "dash-admin-7"
WORDS = ["kernel", "ledger", "harbor", "copper", "meadow", "lantern", "orbit", "pepper", "marble", "signal", "valley"]


class Site:
    """Two apps (open and keyed) on one engine with a RAM store tier, each served over HTTP."""

    def __init__(self, model: LoadedModel) -> None:
        self.model = served_name(model)
        spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
        engine = LLMEngine(model, EngineConfig(kv_memory="48MiB", speculative=spec))
        self.connector = connect_store(engine, StoreOptions(ram="32MiB"))
        self.aengine = AsyncEngine(engine)
        open_app = create_app(self.aengine, ServerSettings(model_name=self.model, min_cache_tokens=32))
        keyed_app = create_app(self.aengine, ServerSettings(model_name=self.model, api_key=KEY, admin_key=ADMIN))
        for app in (open_app, keyed_app):
            serve_store(app, self.connector)
        self.aengine.start()
        self.open = ServerThread(open_app).start()
        self.keyed = ServerThread(keyed_app).start()

    def ask(self, system: str, question: str, max_tokens: int = 4) -> dict:
        """One Anthropic request with a cache breakpoint on `system`; returns its usage."""
        r = httpx.post(f"{self.open.url}/v1/messages", timeout=300, json={
            "model": self.model, "max_tokens": max_tokens, "temperature": 0,
            "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": question}]})
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    def close(self) -> None:
        self.open.stop()
        self.keyed.stop()
        self.aengine.shutdown()
        self.connector.close()


def notes(tag: str, words: int = 90) -> str:
    """A system prompt of about `words` tokens that starts with `tag` (its own prefix)."""
    rng = random.Random(tag)
    return f"Notes {tag}: " + " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def site(default_model: LoadedModel) -> Iterator[Site]:
    s = Site(default_model)
    yield s
    s.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory):
    """Headless Chromium with a fresh profile (Playwright drives the system binary; nothing is downloaded)."""
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "chromium is not installed: run `make system-deps` (scripts/system-deps.sh)"
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1280, "height": 1400})
        yield context
        context.close()


def open_page(browser, url: str) -> tuple:
    """A new tab on the dashboard, with every console message and page error collected."""
    page = browser.new_page()
    messages: list[tuple[str, str]] = []
    page.on("console", lambda m: messages.append((m.type, m.text)))
    page.on("pageerror", lambda e: messages.append(("pageerror", str(e))))
    page.goto(f"{url}/dashboard")
    return page, messages


def save_small_png(src: Path, dest: Path) -> None:
    """Copy a screenshot as a palette PNG (a fraction of the size, for the docs)."""
    from PIL import Image

    with Image.open(src) as im:
        im.convert("RGB").quantize(colors=96).save(dest, optimize=True)


def last(page, chart: str) -> dict:
    return page.eval_on_selector(f"#{chart}", "c => JSON.parse(c.dataset.last || '{}')")


def test_dashboard_charts_move_and_drop_evicts_a_prefix(site: Site, browser, tmp_path: Path) -> None:
    page, messages = open_page(browser, site.open.url)
    page.wait_for_selector("#status[data-state='live']", timeout=30_000)
    assert page.locator("#key-form").is_hidden()
    points = int(page.eval_on_selector("#chart-usage", "c => c.dataset.points"))

    load = threading.Thread(target=lambda: [site.ask(notes(f"load-{i}"), "Tell me a story.", 24) for i in range(3)])
    load.start()
    page.wait_for_function("() => JSON.parse(document.querySelector('#chart-toks').dataset.last || '{}').tok_s > 0",
                           timeout=120_000)
    page.wait_for_function("() => JSON.parse(document.querySelector('#chart-reqs').dataset.last || '{}').running > 0"
                           " || document.querySelector('#tile-reqs').textContent !== '0 / 0'", timeout=120_000)
    load.join()
    assert int(page.eval_on_selector("#chart-usage", "c => c.dataset.points")) > points
    assert page.locator("#tile-hit").text_content() != "–"
    page.wait_for_function("() => document.querySelector('#tile-spec').textContent.endsWith('%')", timeout=30_000)
    assert "drafted tokens accepted" in page.locator("#tile-spec-note").text_content()

    tag = f"drop-{uuid.uuid4().hex[:8]}"
    system = notes(tag)
    site.ask(system, "What is cached?")
    before = site.ask(system, "What is cached?")["cache_read_input_tokens"]
    assert before >= 64
    row = page.locator("#prefix-table tbody tr", has_text=tag)
    row.wait_for(timeout=30_000)
    assert int(row.get_attribute("data-tokens")) >= before
    assert "blocks" in row.locator("td").nth(4).text_content()  # the breakpoint pinned it, with its TTL
    assert row.locator("td").nth(5).text_content().endswith(("s", "min"))
    blocks = last(page, "chart-blocks")
    assert blocks["pinned"] > 0 and blocks["cached"] > 0

    row.locator("button.drop").click()
    page.locator("#prefix-table tbody tr", has_text=tag).wait_for(state="detached", timeout=30_000)
    toast = page.locator("#toast").text_content()
    assert "dropped" in toast and "deleted from tiers: ram" in toast
    after = site.ask(system, "What is cached?")["cache_read_input_tokens"]
    assert after < before

    tiers = page.locator("#tier-table tbody tr[data-tier='ram']")
    assert tiers.count() == 1 and int(tiers.locator("td").nth(2).text_content().replace(",", "")) > 0
    assert last(page, "chart-ratio")["ratio"] > 1.0
    page.wait_for_timeout(1500)
    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("HAFIZA_DASHBOARD_SCREENSHOT"):
        save_small_png(shot, Path(os.environ["HAFIZA_DASHBOARD_SCREENSHOT"]))
    errors = [m for m in messages if m[0] in ("error", "pageerror")]
    assert not errors, errors
    page.close()


def test_keyed_dashboard_asks_for_the_key(site: Site, browser) -> None:
    page, messages = open_page(browser, site.keyed.url)
    page.wait_for_selector("#key-form:not([hidden])", timeout=30_000)
    assert page.locator("#status").get_attribute("data-state") == "auth"
    page.fill("#key-input", KEY)
    page.click("#key-form button[type=submit]")
    page.wait_for_selector("#status[data-state='live']", timeout=30_000)
    assert page.locator("#key-form").is_hidden()
    unexpected = [m for m in messages if m[0] == "pageerror" or (m[0] == "error" and "401" not in m[1])]
    assert not unexpected, unexpected
    page.close()


def test_state_counts_drafted_and_accepted_tokens(site: Site) -> None:
    """The engine speculates by prompt lookup: the state carries its counters, which the acceptance tile shows."""
    site.ask(notes("spec", 40), "Repeat the notes above word for word.", 24)
    spec = httpx.get(f"{site.open.url}/dashboard/state").json()["speculative"]
    assert spec["draft_tokens"] > 0 and 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
    assert spec["acceptance_rate"] == spec["accepted_tokens"] / spec["draft_tokens"]
    assert sum(spec["accepted_per_position"]) == spec["accepted_tokens"]


def test_state_needs_a_key_and_actions_the_admin_key(site: Site) -> None:
    url = site.keyed.url
    assert httpx.get(f"{url}/dashboard").status_code == 200  # the page itself asks for the key
    assert httpx.get(f"{url}/dashboard/state").status_code == 401
    assert httpx.post(f"{url}/dashboard/tiers/ram/clear", json={}).status_code == 401
    wrong = {"x-api-key": "wrong"}
    assert httpx.post(f"{url}/dashboard/prefixes/{'0' * 32}/drop", json={}, headers=wrong).status_code == 401
    state = httpx.get(f"{url}/dashboard/state", headers={"authorization": f"Bearer {KEY}"})
    assert state.status_code == 200 and state.json()["auth"] is True and state.json()["admin"] is False
    api = {"x-api-key": KEY}
    assert httpx.post(f"{url}/dashboard/prefixes/{'0' * 32}/drop", json={}, headers=api).status_code == 403
    assert httpx.post(f"{url}/dashboard/tiers/nowhere/clear", json={}, headers=api).status_code == 403
    admin = {"x-api-key": ADMIN}
    assert httpx.post(f"{url}/dashboard/prefixes/{'0' * 32}/drop", json={}, headers=admin).status_code == 404
    assert httpx.post(f"{url}/dashboard/tiers/nowhere/clear", json={}, headers=admin).status_code == 404


def test_clearing_a_tier_and_the_pool(site: Site) -> None:
    site.ask(notes("clear-me"), "Hello?")
    site.connector.flush()
    cleared = httpx.post(f"{site.open.url}/dashboard/tiers/ram/clear", json={}).json()
    assert cleared["tier"] == "ram" and cleared["entries_before"] > 0 and cleared["entries_after"] == 0
    state = httpx.get(f"{site.open.url}/dashboard/state").json()
    assert next(t for t in state["store"]["tiers"] if t["name"] == "ram")["entries"] == 0
    pool = httpx.post(f"{site.open.url}/dashboard/tiers/pool/clear", json={}).json()
    assert pool["dropped_blocks"] > 0
    state = httpx.get(f"{site.open.url}/dashboard/state").json()
    assert state["blocks"]["cached"] == 0 and state["prefixes"] == []
