"""Helpers for server-level store tests: `hafiza serve` as a real subprocess, and OpenAI chat requests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx

from hafiza.models.tokenizer import Tokenizer
from tests.support.serve import ServeProcess as BaseServeProcess

from .engine_support import TEXT


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


class ServeProcess(BaseServeProcess):
    """`hafiza serve` with a small pool by default, and greedy OpenAI chat requests."""

    def __init__(self, log: Path, *args: str, kv_memory: str = "160MiB") -> None:
        super().__init__(log, *args, kv_memory=kv_memory)

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


def prompt_text(tokenizer: Tokenizer, n: int, offset: int = 0) -> str:
    """About `n` tokens of the benchmark prose as text (the chat template adds a few more)."""
    ids = tokenizer.encode(TEXT.read_text())[offset : offset + n]
    return tokenizer.decode(ids)
