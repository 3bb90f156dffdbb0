"""Which of the caller's headers the real vllm-router (0.1.17) passes to a worker, per route, seen by a worker that
records what reaches it: the facts docs/CLUSTER.md's auth section rests on. No model is loaded."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest

from hafiza.cluster import HOST, free_port, router_binary, wait_healthy

pytestmark = pytest.mark.slow
ROUTER_KEY = "router-key"
CALLER = {"authorization": "Bearer caller-key", "x-api-key": "caller-x-key", "x-tenant": "t1"}
BODIES = {
    "/v1/chat/completions": {"model": "hafiza", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"model": "hafiza", "prompt": "hi", "max_tokens": 2},
    "/v1/messages": {"model": "hafiza", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/responses": {"model": "hafiza", "input": "hi", "max_output_tokens": 2},
}


class Recorder(BaseHTTPRequestHandler):
    """Answers 200 to everything and records each request's method, path and headers."""

    seen: ClassVar[list[tuple[str, str, dict[str, str]]]] = []

    def _answer(self) -> None:
        self.seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        body = json.dumps({"id": "x", "object": "chat.completion", "choices": [], "token_ids": [1, 2],
                           "usage": {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


def start_router(worker: str, extra: list[str], log: Path) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([router_binary(), "--host", HOST, "--port", str(port), "--policy", "cache_aware",
                                 "--worker-urls", worker, "--prometheus-port", str(free_port()), *extra],
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://{HOST}:{port}"
    wait_healthy(url, proc, 60)
    return url, proc


@pytest.fixture(scope="module")
def worker() -> Iterator[str]:
    server = ThreadingHTTPServer((HOST, 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://{HOST}:{server.server_address[1]}"
    server.shutdown()


def reached(router: str, path: str) -> dict[str, dict[str, str]]:
    """Send `path`'s body with the caller's headers; the headers of each request the worker then got, by path."""
    Recorder.seen.clear()
    r = httpx.post(f"{router}{path}", json=BODIES[path], headers=CALLER, timeout=30)
    assert r.status_code == 200, r.text
    return {p: h for m, p, h in Recorder.seen if m == "POST"}


@pytest.mark.parametrize("router_key", [False, True])
def test_which_caller_headers_reach_the_worker(worker: str, tmp_path: Path, router_key: bool) -> None:
    url, proc = start_router(worker, ["--api-key", ROUTER_KEY] if router_key else [], tmp_path / "router.log")
    try:
        for path in ("/v1/chat/completions", "/v1/completions"):
            got = reached(url, path)
            assert {k: got[path].get(k) for k in CALLER} == CALLER  # forwarded as sent, never replaced
            render = got.get(f"{path}/render")
            assert render is not None, f"cache_aware did not ask {path}/render"
            assert "x-api-key" not in render and "x-tenant" not in render
            assert render.get("authorization") == (f"Bearer {ROUTER_KEY}" if router_key else CALLER["authorization"])
        for path in ("/v1/messages", "/v1/responses"):
            got = reached(url, path)[path]
            assert not {"x-api-key", "x-tenant"} & got.keys()  # the caller's headers are dropped
            assert got.get("authorization") == (f"Bearer {ROUTER_KEY}" if router_key else None)
        Recorder.seen.clear()
        httpx.post(f"{url}/v1/chat/completions", json=BODIES["/v1/chat/completions"], timeout=30)
        chat = {p: h for m, p, h in Recorder.seen if m == "POST"}["/v1/chat/completions"]
        assert "authorization" not in chat  # the router adds no key of its own to a caller's chat request
    finally:
        proc.terminate()
        proc.wait(15)
