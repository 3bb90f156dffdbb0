"""A real server (uvicorn on a loopback port, in a thread) over the default model, shared by the server tests.

Two apps share one engine: `server` has no API key, `keyed_server` requires one. Long prompts are built from a
seeded word list so each test can have a prefix no other test has cached.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from hafiza.engine import EngineConfig, LLMEngine
from hafiza.engine.async_engine import AsyncEngine
from hafiza.engine.results import EngineStats
from hafiza.models import LoadedModel
from hafiza.server import ServerSettings, create_app
from hafiza.server.launch import ServerThread, served_name

API_KEY = "test-key-123"
WORDS = ["memory", "cache", "block", "token", "prefix", "river", "mountain", "garden", "window", "letter", "market",
         "engine", "signal", "harbor", "forest", "lantern", "copper", "meadow", "silver", "thunder", "candle",
         "anchor", "valley", "orbit", "pepper", "marble"]


@dataclass
class Server:
    """A running server: its base URL, the model id to send, and the engine behind it."""

    url: str
    model: str
    aengine: AsyncEngine

    def engine_stats(self) -> EngineStats:
        """Fresh stats taken on the engine thread (the server's snapshot may be up to 0.2 s old)."""
        return asyncio.run(self.aengine.call(lambda e: e.stats()))

    def in_use_blocks(self) -> int:
        return self.engine_stats().blocks.in_use

    def wait_idle(self, timeout_s: float = 60.0) -> int:
        """Wait until no request runs or waits; returns the KV blocks still in use plus live requests (0 expected)."""
        deadline = time.monotonic() + timeout_s
        while True:
            s = self.engine_stats()
            busy = s.blocks.in_use + s.num_running + s.num_waiting
            if busy == 0 or time.monotonic() > deadline:
                return busy
            time.sleep(0.05)


def long_text(tag: str, words: int = 1220) -> str:
    """About one token per word of seeded filler, starting with `tag` (so each tag is its own prefix)."""
    rng = random.Random(tag)
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"Reference notes {tag}. {body}."


@pytest.fixture(scope="session")
def engine(default_model: LoadedModel) -> Iterator[AsyncEngine]:
    """fp32 KV (the model's dtype): a prefix hit then gives the same logits as computing it afresh."""
    aengine = AsyncEngine(LLMEngine(default_model, EngineConfig(kv_memory="512MiB", kv_dtype="model"))).start()
    yield aengine
    aengine.shutdown()


def _start(aengine: AsyncEngine, settings: ServerSettings) -> Iterator[ServerThread]:
    thread = ServerThread(create_app(aengine, settings)).start()
    yield thread
    thread.stop()


@pytest.fixture(scope="session")
def server(engine: AsyncEngine, default_model: LoadedModel) -> Iterator[Server]:
    name = served_name(default_model)
    settings = ServerSettings(model_name=name, aliases=("smollm2",), max_body_bytes=256 * 1024,
                              explain_details=True)  # the explain tests read offsets and similar=
    for thread in _start(engine, settings):
        yield Server(thread.url, name, engine)


@pytest.fixture(scope="session")
def keyed_server(engine: AsyncEngine, default_model: LoadedModel) -> Iterator[Server]:
    settings = ServerSettings(model_name=served_name(default_model), api_key=API_KEY)
    for thread in _start(engine, settings):
        yield Server(thread.url, settings.model_name, engine)


@pytest.fixture(scope="session")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=300) as client:
        yield client


@pytest.fixture(scope="session")
def anthropic_client(server: Server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def openai_client(server: Server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def warm_document(http: httpx.Client, server: Server) -> str:
    """A ≥1,024-token system prompt already cached (written by a `max_tokens: 0` request)."""
    text = long_text("warm-shared")
    r = http.post("/v1/messages", json={
        "model": server.model, "max_tokens": 0, "messages": [{"role": "user", "content": "ok"}],
        "system": [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["cache_creation_input_tokens"] >= 1024
    return text
