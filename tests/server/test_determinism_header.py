"""`x-hafiza-deterministic` says whether greedy output is independent of cache state, and if not, why."""

from __future__ import annotations

import httpx

from hafiza.engine import EngineConfig, LLMEngine
from hafiza.engine.async_engine import AsyncEngine
from hafiza.models import LoadedModel
from hafiza.server import ServerSettings, create_app
from hafiza.server.launch import ServerThread, served_name
from tests.server.conftest import Server

BODY = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}


def test_full_precision_pool_on_the_cpu_is_deterministic(http: httpx.Client, server: Server) -> None:
    r = http.post("/v1/chat/completions", json={**BODY, "model": server.model})
    assert r.status_code == 200 and r.headers["x-hafiza-deterministic"] == "true"


def test_lossy_pool_and_eviction_say_why(default_model: LoadedModel) -> None:
    engine = LLMEngine(default_model, EngineConfig(kv_memory="32MiB", kv_dtype="int8", eviction="streaming",
                                                   kv_budget_tokens=256))
    aengine = AsyncEngine(engine).start()
    name = served_name(default_model)
    thread = ServerThread(create_app(aengine, ServerSettings(model_name=name))).start()
    try:
        with httpx.Client(base_url=thread.url, timeout=300) as client:
            r = client.post("/v1/chat/completions", json={**BODY, "model": name})
            assert r.status_code == 200
            assert r.headers["x-hafiza-deterministic"] == "false; reason=lossy-kv-int8,eviction-streaming"
            assert "x-hafiza-deterministic" not in client.get("/health").headers
    finally:
        thread.stop()
        aengine.shutdown()
