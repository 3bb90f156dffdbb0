"""`hafiza top --once` against a real server over HTTP (in-process, rich's output captured), and as a user runs it
(a subprocess) against no server at all."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from click.testing import Result
from typer.testing import CliRunner

from hafiza.engine import EngineConfig, LLMEngine
from hafiza.engine.async_engine import AsyncEngine
from hafiza.models import LoadedModel
from hafiza.server import ServerSettings, create_app
from hafiza.server.launch import ServerThread, served_name

KEY = "top-key-7"


@dataclass
class Servers:
    open: ServerThread
    keyed: ServerThread
    aengine: AsyncEngine
    model: str


@pytest.fixture(scope="module")
def servers(default_model: LoadedModel) -> Iterator[Servers]:
    aengine = AsyncEngine(LLMEngine(default_model, EngineConfig(kv_memory="16MiB"))).start()
    name = served_name(default_model)
    open_ = ServerThread(create_app(aengine, ServerSettings(model_name=name))).start()
    keyed = ServerThread(create_app(aengine, ServerSettings(model_name=name, api_key=KEY))).start()
    yield Servers(open_, keyed, aengine, name)
    open_.stop()
    keyed.stop()
    aengine.shutdown()


def top(*args: str) -> Result:
    """Run `hafiza top --once` in this process; rich writes into the runner's captured stdout."""
    from hafiza.cli import _register, app

    _register()
    env = {"COLUMNS": "160", "NO_COLOR": "1", "HAFIZA_API_KEY": None}
    return CliRunner().invoke(app, ["top", "--once", "--interval", "0.3", *args], env=env)


def test_top_once_shows_the_servers_numbers(servers: Servers) -> None:
    for question in ("Name three rivers in Europe, please.", "Name three rivers in Europe, please."):
        r = httpx.post(f"{servers.open.url}/v1/chat/completions", timeout=300, json={
            "model": servers.model, "max_tokens": 3, "messages": [
                {"role": "system", "content": "You answer questions about geography in short lists. " * 4},
                {"role": "user", "content": question}]})
        assert r.status_code == 200, r.text
    engine = servers.aengine.engine
    stats = engine.stats()
    out = top("--url", servers.open.url)
    assert out.exit_code == 0, out.output
    text = out.stdout
    assert f"of {engine.layout.num_blocks} blocks x {engine.layout.block_size} tokens" in text
    cached = int(re.search(r"cached (\d+)", text).group(1))
    assert cached == stats.blocks.cached > 0
    hits = stats.blocks.prefix_cache_hits
    assert f"({hits} of {stats.blocks.prefix_cache_queries} prompt tokens)" in text and hits > 0
    assert re.search(r"TTFT\s+\d+ ms mean since start|TTFT\s+[\d.]+ s mean since start", text)
    assert f"({stats.generation_tokens} generated since start)" in text
    assert "largest cached prefixes" in text and "geography" in text


def test_top_needs_the_key_only_for_the_prefix_table(servers: Servers) -> None:
    without = top("--url", servers.keyed.url)
    assert without.exit_code == 0, without.output
    assert "pass --api-key" in without.stdout and "KV in use" in without.stdout
    with_key = top("--url", servers.keyed.url, "--api-key", KEY)
    assert with_key.exit_code == 0 and "largest cached prefixes" in with_key.stdout


def test_top_without_a_server_is_one_clear_line() -> None:
    out = subprocess.run([sys.executable, "-m", "hafiza", "top", "--url", "http://127.0.0.1:1"], capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: cannot reach a hafiza server at http://127.0.0.1:1: ")
    assert "connection refused" in out.stderr
