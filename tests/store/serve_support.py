"""Helpers for server-level store tests: `hafiza serve` as a real subprocess, and OpenAI chat requests."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from hafiza.models.tokenizer import Tokenizer
from hafiza.server.launch import free_port

from .engine_support import TEXT

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Answer:
    """One chat completion: its text, the prompt and cached token counts from `usage`, and the cache headers."""

    text: str
    prompt_tokens: int
    cached_tokens: int
    cache_header: str
    tiers_header: str

    def tiers(self) -> dict[str, str]:
        """`x-hafiza-tiers` as a dict (everything but `why`, which is free text)."""
        head = self.tiers_header.split("; why=", 1)[0]
        return dict(part.split("=", 1) for part in head.split("; ") if "=" in part)


class ServeProcess:
    """`python -m hafiza serve` on a free port, with its output in a log file; stopped with SIGTERM."""

    def __init__(self, log: Path, *args: str, kv_memory: str = "160MiB") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        argv = [sys.executable, "-m", "hafiza", "serve", "--port", str(self.port), "--kv-memory", kv_memory, *args]
        self._out = log.open("w")
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, cwd=ROOT)
        self.model = ""

    def wait_ready(self, timeout_s: float = 600.0) -> ServeProcess:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"hafiza serve exited:\n{self.output()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"hafiza serve did not come up:\n{self.output()}"
            time.sleep(0.5)
        self.model = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"]
        return self

    def chat(self, text: str, max_tokens: int = 8) -> Answer:
        """A greedy OpenAI chat completion of one user message."""
        r = httpx.post(f"{self.url}/v1/chat/completions", timeout=600, json={
            "model": self.model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": text}]})
        assert r.status_code == 200, r.text
        body = r.json()
        usage = body["usage"]
        return Answer(body["choices"][0]["message"]["content"], usage["prompt_tokens"],
                      usage["prompt_tokens_details"]["cached_tokens"], r.headers.get("x-hafiza-cache", ""),
                      r.headers.get("x-hafiza-tiers", ""))

    def metric(self, name: str, **labels: str) -> float | None:
        """One sample from GET /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return None

    def stop(self, timeout_s: float = 120.0) -> bool:
        """SIGTERM (a graceful shutdown flushes pending store writes); True when it ended cleanly (uvicorn
        re-raises SIGTERM once its shutdown is complete, so the status is 0 or -SIGTERM)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._out.close()
        return self.proc.returncode in (0, -signal.SIGTERM)

    def output(self) -> str:
        """Everything the process has written so far."""
        return self.log.read_text()


def prompt_text(tokenizer: Tokenizer, n: int, offset: int = 0) -> str:
    """About `n` tokens of the benchmark prose as text (the chat template adds a few more)."""
    ids = tokenizer.encode(TEXT.read_text())[offset : offset + n]
    return tokenizer.decode(ids)
