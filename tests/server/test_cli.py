"""`hafiza serve` as `make serve` runs it: defaults on the default model, then a clean stop."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx

from hafiza.server.launch import free_port


def test_serve_with_defaults_answers_and_stops_cleanly() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hafiza", "serve", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.5)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        assert model == "SmolLM2-135M-Instruct.Q4_1"
        r = httpx.post(f"{url}/v1/messages", timeout=120, json={
            "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    assert "Traceback" not in out
    assert "serving 'SmolLM2-135M-Instruct.Q4_1'" in out


def test_serve_bad_option_is_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "hafiza", "serve", "--kv-memory", "lots"], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--kv-memory: cannot read size 'lots'" in proc.stderr
