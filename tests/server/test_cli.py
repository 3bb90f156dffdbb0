"""`hafiza serve` as `make serve` runs it: defaults on the default model, then a clean stop."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.support.serve import ServeProcess


def test_serve_with_defaults_answers_and_stops_cleanly(tmp_path: Path) -> None:
    server = ServeProcess(tmp_path / "serve.log")
    try:
        server.wait_ready(timeout_s=240)
        assert server.model == "SmolLM2-135M-Instruct.Q4_1"
        r = httpx.post(f"{server.url}/v1/messages", timeout=120, json={
            "model": server.model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] >= 1
    finally:
        server.stop(signal.SIGINT, timeout_s=60)
    out = server.output()
    assert server.returncode == 0, out
    assert "Traceback" not in out
    assert "serving 'SmolLM2-135M-Instruct.Q4_1'" in out


def test_serve_bad_option_is_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "hafiza", "serve", "--kv-memory", "lots"], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--kv-memory: cannot read size 'lots'" in proc.stderr
