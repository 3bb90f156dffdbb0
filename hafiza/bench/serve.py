"""`hafiza bench serve`: concurrent multi-turn chat sessions sharing a system prompt, over real HTTP.

The benchmark starts `hafiza serve` in a subprocess, fills the cache with the shared system prompt
(`max_tokens: 0`), then runs N sessions at once; each turn streams a reply and appends it to the conversation.
Reported: TTFT p50/p99 (client-side, to the first text), aggregate output tok/s, and the prefix hit rate (from the
responses' usage and from the server's own prefix-cache counters).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

from hafiza.bench.common import machine, nearest_rank, wait_http, write_json
from hafiza.options import Weights

WORDS = ["cache", "memory", "block", "prefix", "token", "engine", "attention", "layer", "value", "key", "model",
         "server", "request", "stream", "batch", "queue", "latency", "budget", "store", "tier", "disk", "redis", "ram",
         "page", "table", "hash", "chain", "evict", "pin"]
STATS_SETTLE_S = 0.5  # the engine's stats snapshot is refreshed every 0.2 s


@dataclass
class Turn:
    """One request of one session, as the client saw it."""

    session: int
    turn: int
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int | None  # None where the server does not report it (llama.cpp)
    output_tokens: int


@dataclass
class Config:
    sessions: int = 8
    turns: int = 4
    max_tokens: int = 32
    system_words: int = 1100
    user_words: int = 24
    api: str = "anthropic"
    server_args: list[str] = field(default_factory=list)
    weights: str = "auto"  # the server's --weights


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def _anthropic_turn(client: httpx.AsyncClient, model: str, system: str, messages: list[dict],
                          max_tokens: int) -> tuple[float, str, int, int, int]:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True, "messages": messages,
            "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]}
    t0 = time.perf_counter()
    ttft, text, prompt, cached, out = 0.0, [], 0, 0, 0
    async with client.stream("POST", "/v1/messages", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            if ev["type"] == "message_start":
                u = ev["message"]["usage"]
                cached = u["cache_read_input_tokens"]
                prompt = u["input_tokens"] + u["cache_creation_input_tokens"] + cached
            elif ev["type"] == "content_block_delta":
                ttft = ttft or time.perf_counter() - t0
                text.append(ev["delta"]["text"])
            elif ev["type"] == "message_delta":
                out = ev["usage"]["output_tokens"]
    return ttft or time.perf_counter() - t0, "".join(text), prompt, cached, out


async def openai_turn(client: httpx.AsyncClient, model: str, system: str, messages: list[dict],
                      max_tokens: int) -> tuple[float, str, int, int | None, int]:
    """One streamed OpenAI chat turn: (TTFT, text, prompt tokens, cached tokens or None where the server does not
    report them, output tokens from usage or else counted as content chunks, as llama.cpp streams one per chunk)."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, *messages]}
    t0 = time.perf_counter()
    ttft, text, chunks, prompt, cached, out = 0.0, [], 0, 0, None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                if (choice.get("delta") or {}).get("content"):
                    ttft = ttft or time.perf_counter() - t0
                    text.append(choice["delta"]["content"])
                    chunks += 1
            usage = chunk.get("usage")
            if usage:
                prompt, out = usage.get("prompt_tokens", 0), usage.get("completion_tokens")
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return ttft or time.perf_counter() - t0, "".join(text), prompt, cached, out if out is not None else chunks


def system_prompt(cfg: Config) -> str:
    """The shared system prompt of every session (seeded, so every server gets the same one)."""
    return f"You are a helpful assistant for a shared knowledge base. {_words(random.Random(7), cfg.system_words)}"


async def run_session(client: httpx.AsyncClient, cfg: Config, model: str, system: str, index: int) -> list[Turn]:
    """Session `index`: `cfg.turns` seeded questions, each sent with the whole conversation so far."""
    rng = random.Random(index)
    ask = _anthropic_turn if cfg.api == "anthropic" else openai_turn
    messages: list[dict] = []
    turns = []
    for t in range(cfg.turns):
        messages.append({"role": "user", "content": f"Session {index}, question {t}: {_words(rng, cfg.user_words)}?"})
        t0 = time.perf_counter()
        ttft, text, prompt, cached, out = await ask(client, model, system, messages, cfg.max_tokens)
        turns.append(Turn(index, t, ttft, time.perf_counter() - t0, prompt, cached, out))
        messages.append({"role": "assistant", "content": text.strip() or "ok"})
    return turns


def _counter(metrics: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^hafiza:{name}(?:\{{[^}}]*\}})? (\S+)$", metrics, re.M))


async def _run(url: str, cfg: Config) -> dict[str, Any]:
    system = system_prompt(cfg)
    limits = httpx.Limits(max_connections=cfg.sessions + 4)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        t0 = time.perf_counter()
        warm = await client.post("/v1/messages", json={
            "model": model, "max_tokens": 0, "messages": [{"role": "user", "content": "warm-up"}],
            "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]})
        warm.raise_for_status()
        cold_s = time.perf_counter() - t0
        await asyncio.sleep(STATS_SETTLE_S)
        before = (await client.get("/metrics")).text
        t0 = time.perf_counter()
        results = await asyncio.gather(*(run_session(client, cfg, model, system, i) for i in range(cfg.sessions)))
        wall = time.perf_counter() - t0
        await asyncio.sleep(STATS_SETTLE_S)
        after = (await client.get("/metrics")).text
    turns = [t for session in results for t in session]
    queries = _counter(after, "prefix_cache_queries_total") - _counter(before, "prefix_cache_queries_total")
    hits = _counter(after, "prefix_cache_hits_total") - _counter(before, "prefix_cache_hits_total")
    return {
        "model": model,
        "cold_prefill_s": cold_s,
        "system_prompt_tokens": warm.json()["usage"]["cache_creation_input_tokens"]
        + warm.json()["usage"]["input_tokens"],
        **summarize(turns, wall),
        "server_hit_rate": hits / queries if queries else 0.0,
    }


def summarize(turns: list[Turn], wall: float) -> dict[str, Any]:
    """The client-side figures of one load run; the usage hit rate counts the turns whose server reported cached
    tokens (None when none did)."""
    ttfts = [t.ttft_s for t in turns]
    output = sum(t.output_tokens for t in turns)
    reported = [t for t in turns if t.cached_tokens is not None and t.prompt_tokens]
    return {
        "requests": len(turns),
        "wall_s": wall,
        "ttft_p50_s": nearest_rank(ttfts, 0.5),
        "ttft_p99_s": nearest_rank(ttfts, 0.99),
        "ttft_mean_s": statistics.fmean(ttfts),
        "output_tokens": output,
        "aggregate_tok_s": output / wall,
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "usage_hit_rate": (sum(t.cached_tokens or 0 for t in reported) / sum(t.prompt_tokens for t in reported)
                           if reported else None),
        "turns": [asdict(t) for t in turns],
    }


def server_command(cfg: Config, port: int) -> list[str]:
    """How the benchmark starts `hafiza serve`: its port, `--weights`, then the extra arguments."""
    return [sys.executable, "-m", "hafiza", "serve", "--port", str(port), "--log-level", "warning", "--weights",
            cfg.weights, *cfg.server_args]


def run_bench(cfg: Config) -> dict[str, Any]:
    """Start a server, run the sessions against it, stop it; returns the figures and the server's command."""
    from hafiza.server.launch import free_port

    port = free_port()
    cmd = server_command(cfg, port)
    proc = subprocess.Popen(cmd)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(proc, f"{url}/health", "hafiza serve")
        return {**asyncio.run(_run(url, cfg)), "command": " ".join(["hafiza", *cmd[3:]])}
    finally:
        proc.terminate()
        proc.wait(60)


def register(bench_app: typer.Typer) -> None:
    """Add `hafiza bench serve`."""

    @bench_app.command("serve")
    def serve_bench(
        sessions: Annotated[int, typer.Option(help="Concurrent chat sessions.")] = 8,
        turns: Annotated[int, typer.Option(help="Turns per session.")] = 4,
        max_tokens: Annotated[int, typer.Option(help="Reply length per turn.")] = 32,
        system_words: Annotated[int, typer.Option(help="Shared system prompt length in words (~1 token each).")
                                ] = 1100,
        api: Annotated[str, typer.Option(help="anthropic or openai.")] = "anthropic",
        model: Annotated[str | None, typer.Option(help="Model for the server (default: SmolLM2-135M).")] = None,
        weights: Weights = "auto",
        server_arg: Annotated[list[str] | None, typer.Option(help="Extra `hafiza serve` argument (repeatable).")
                              ] = None,
        json_path: Annotated[Path | None, typer.Option("--json", help="Where to write the JSON results.")] = None,
    ) -> None:
        """N concurrent multi-turn sessions sharing a system prompt: TTFT p50/p99, tok/s, prefix hit rate."""
        from rich.console import Console
        from rich.table import Table

        from hafiza.errors import HafizaError
        from hafiza.models.weights import check_weights_mode

        check_weights_mode(weights)
        if api not in ("anthropic", "openai"):
            raise HafizaError(f"--api must be anthropic or openai, got {api!r}")
        if min(sessions, turns, system_words) < 1 or max_tokens < 1:
            raise HafizaError("--sessions, --turns, --system-words and --max-tokens must be positive")
        args = [*(["--model", model] if model else []), *(server_arg or [])]
        cfg = Config(sessions, turns, max_tokens, system_words, api=api, server_args=args, weights=weights)
        res = run_bench(cfg)
        table = Table(title=f"hafiza bench serve: {sessions} sessions x {turns} turns ({api} API, --weights {weights})")
        table.add_column("")
        table.add_column("value", justify="right")
        rows = [
            ("shared system prompt", f"{res['system_prompt_tokens']} tokens"),
            ("cold prefill of it (max_tokens 0)", f"{res['cold_prefill_s']:.2f} s"),
            ("requests / reply length", f"{res['requests']} / {max_tokens} tokens"),
            ("TTFT p50", f"{res['ttft_p50_s'] * 1000:.0f} ms"),
            ("TTFT p99", f"{res['ttft_p99_s'] * 1000:.0f} ms"),
            ("aggregate output tok/s", f"{res['aggregate_tok_s']:.1f}"),
            ("prefix hit rate (usage: read / prompt)", f"{res['usage_hit_rate']:.1%}"),
            ("prefix hit rate (server counters)", f"{res['server_hit_rate']:.1%}"),
            ("wall time", f"{res['wall_s']:.1f} s"),
        ]
        for row in rows:
            table.add_row(*row)
        Console().print(table)
        cfg_dict = asdict(cfg)
        out = write_json({"bench": "serve", "config": cfg_dict, "results": res}, json_path, "serve.json")
        print(f"machine: {machine()['cpu']}, {machine()['cores']} cores; results written to {out}")
