"""`hafiza serve --store-*` option checks, the `x-hafiza-tiers` header value, and a running app with a store."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hafiza.engine import EngineConfig, LLMEngine, RequestOutput
from hafiza.engine.async_engine import AsyncEngine
from hafiza.engine.connector import TierOutcome
from hafiza.models import LoadedModel
from hafiza.server import ServerSettings, create_app
from hafiza.server.launch import ServerThread
from hafiza.server.store import StoreOptions, connect_store, serve_store
from hafiza.server.tiers import tiers_header
from tests.support.serve import run_cli


@pytest.mark.parametrize(("args", "message"), [
    (["--store-codec", "gzip"], "--store-codec: unknown codec 'gzip': choose one of raw, zstd, fast, planes, "
                                "exponent, predictive, speculative"),
    (["--store-disk", "/tmp/x", "--store-write-back"], "--store-write-back needs --store-ram"),
    (["--store-ram", "lots"], "cannot read size 'lots'"),
    (["--store-redis", "http://h:1"], "scheme must be redis://"),
])  # fmt: skip
def test_bad_store_option_is_one_line_before_the_model_loads(args: list[str], message: str,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    proc = run_cli(["serve", *args], monkeypatch, capsys)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert message in proc.stderr


def test_no_store_option_means_no_store() -> None:
    assert not StoreOptions().enabled
    assert StoreOptions(redis="redis://127.0.0.1:1").enabled


def test_tiers_header_counts_tokens_by_source_in_ascii() -> None:
    loaded = TierOutcome("load", "load: 1.00 MB from disk at 1 MB/s ≈ 1.0 ms < recompute 2000 tokens ≈ 2.0 s",
                         pool_tokens=16, loaded_blocks=125, loaded_tokens=2000, per_tier={"ram": 800, "disk": 1200})
    out = RequestOutput("r", [1], "x", False, num_prompt_tokens=2030, num_cached_tokens=2016, tiers=loaded)
    value = tiers_header(out)
    assert value.startswith("decision=load; pool=16; ram=800; disk=1200; computed=14; why=load: 1.00 MB")
    assert "~ 1.0 ms" in value and value.isascii()
    miss = RequestOutput("r", [], "", False, num_prompt_tokens=40, num_cached_tokens=16)
    assert tiers_header(miss) == "decision=none; pool=16; computed=24"


def test_header_metrics_and_shutdown_flush_in_a_running_app(tiny_llama: LoadedModel, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Both APIs, streamed or not, get `x-hafiza-tiers`; /metrics shows the tiers; shutdown flushes the writes,
    so a second app on the same disk directory (empty pool) loads the prompt from disk."""
    chat = {"model": "tiny", "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": " ".join(["memory"] * 120)}]}
    runs = []
    for _ in range(2):
        engine = LLMEngine(tiny_llama, EngineConfig(kv_memory="8MiB"))
        connector = connect_store(engine, StoreOptions(ram="16MiB", disk=str(tmp_path / "kv")))
        aengine = AsyncEngine(engine)
        app = create_app(aengine, ServerSettings(model_name="tiny"))
        serve_store(app, connector)
        aengine.start()
        server = ServerThread(app).start()
        caplog.clear()
        try:
            with caplog.at_level(logging.INFO, logger="hafiza.store"):
                plain = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
                with httpx.stream("POST", f"{server.url}/v1/messages", json={**chat, "stream": True},
                                  timeout=60) as streamed:
                    streamed.read()
                metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
                server.stop()
        finally:
            aengine.shutdown()
            connector.close()
        assert plain.status_code == streamed.status_code == 200
        assert streamed.headers["x-hafiza-tiers"].startswith("decision=")
        assert "pending writes flushed at shutdown" in caplog.text
        runs.append((plain, metrics))
    (cold, metrics), (warm, _) = runs
    assert cold.headers["x-hafiza-tiers"].startswith("decision=miss; pool=0; computed=")
    cached = warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert warm.headers["x-hafiza-tiers"].startswith(f"decision=load; pool=0; disk={cached}; computed=")
    assert cached == (warm.json()["usage"]["prompt_tokens"] - 1) // 16 * 16
    assert warm.json()["choices"][0]["message"] == cold.json()["choices"][0]["message"]
    assert (sample(metrics, "hafiza:store_saves_total") or 0) > 0  # writes may still be in flight: no exact count
    assert sample(metrics, "hafiza:store_enabled", tier="disk", kind="disk") == 1.0


def sample(text: str, name: str, **labels: str) -> float | None:
    """One sample of a Prometheus text exposition."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None
