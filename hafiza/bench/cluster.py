"""`hafiza bench cluster`: vllm-router over 2 `hafiza serve` instances (one thread each) and one redis-server, on
loopback, under the router's round_robin, cache_aware and kv_aware policies in one run, against one instance
serving the same workload alone.

The workload is agent-like: K long shared system prompts, each with U users holding multi-turn conversations
(each turn resends the conversation so far), every conversation running at once. Each setup starts cold (new
workers, new redis-server), so no policy inherits another's cache. Per request the client records TTFT (to the
first streamed text), usage's cached tokens and the `x-hafiza-tiers` split (pool / redis); the workers' /metrics
say how many requests each answered. `identical` compares every greedy answer with the single instance's.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import statistics
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

from hafiza.bench.common import machine, nearest_rank, write_json
from hafiza.bench.markdown import Region, replace_region, table
from hafiza.cluster import Cluster, Layout

POLICIES = ("round_robin", "cache_aware", "kv_aware")
SINGLE = "single"
REGION = Region("cluster", "Cluster behind vllm-router")
WORDS = ["invoice", "ticket", "refund", "shipment", "account", "policy", "schedule", "report", "ledger", "order",
         "customer", "warehouse", "contract", "audit", "budget", "forecast", "supplier", "claim", "route", "quota"]


@dataclass
class Config:
    """The workload and the cluster it runs on."""

    prompts: int = 3
    users: int = 3
    turns: int = 3
    system_words: int = 400
    user_words: int = 12
    max_tokens: int = 16
    workers: int = 2
    kv_memory: str = "256MiB"
    model: str | None = None
    policies: tuple[str, ...] = POLICIES
    worker_args: list[str] = field(default_factory=list)

    def layout_args(self) -> tuple[str, ...]:
        return ("--kv-memory", self.kv_memory, *(("--model", self.model) if self.model else ()), *self.worker_args)


@dataclass
class Turn:
    """One request as the client saw it."""

    prompt: int
    user: int
    turn: int
    ttft_s: float
    text: str
    prompt_tokens: int
    cached_tokens: int
    pool_tokens: int
    redis_tokens: int
    output_tokens: int


def system_prompt(index: int, words: int) -> str:
    """Shared system prompt `index` (seeded: every setup sends the same ones)."""
    rng = random.Random(1000 + index)
    return (f"You are agent {index} of the operations team. Follow the playbook below exactly. "
            + " ".join(rng.choice(WORDS) for _ in range(words)))


def tiers_split(header: str) -> tuple[int, int]:
    """(pool tokens, redis tokens) from an `x-hafiza-tiers` value."""
    fields = dict(p.split("=", 1) for p in header.split("; ") if "=" in p)
    return int(fields.get("pool", 0)), int(fields.get("redis", 0))


async def chat_turn(client: httpx.AsyncClient, system: str, messages: list[dict[str, str]], max_tokens: int
                    ) -> tuple[float, str, int, int, int, int, int]:
    """One streamed greedy chat request: (TTFT, text, prompt, cached, pool, redis, output tokens)."""
    body = {"model": "hafiza", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "messages": [{"role": "system", "content": system}, *messages]}
    t0 = time.perf_counter()
    ttft, text, usage = 0.0, [], {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"chat answered {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}")
        pool, redis_tokens = tiers_split(r.headers.get("x-hafiza-tiers", ""))
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                if (choice.get("delta") or {}).get("content"):
                    ttft = ttft or time.perf_counter() - t0
                    text.append(choice["delta"]["content"])
            usage = chunk.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return (ttft or time.perf_counter() - t0, "".join(text), usage.get("prompt_tokens", 0), cached, pool,
            redis_tokens, usage.get("completion_tokens", 0))


async def conversation(client: httpx.AsyncClient, cfg: Config, prompt: int, user: int) -> list[Turn]:
    """User `user` of system prompt `prompt`: `cfg.turns` seeded questions, each with the conversation so far."""
    rng = random.Random(prompt * 1000 + user)
    system = system_prompt(prompt, cfg.system_words)
    messages: list[dict[str, str]] = []
    turns = []
    for t in range(cfg.turns):
        ask = " ".join(rng.choice(WORDS) for _ in range(cfg.user_words))
        messages.append({"role": "user", "content": f"User {user}, step {t}: check the {ask}."})
        got = await chat_turn(client, system, messages, cfg.max_tokens)
        turns.append(Turn(prompt, user, t, *got))
        messages.append({"role": "assistant", "content": got[1].strip() or "ok"})
    return turns


def requests_answered(url: str) -> int:
    """The worker's answered requests, from its /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return round(sum(float(v) for v in re.findall(r"^hafiza:request_success_total(?:\{[^}]*\})? (\S+)$", text,
                                                  re.M)))


async def workload(url: str, cfg: Config) -> tuple[list[Turn], float]:
    """Every conversation at once through `url`; the turns and the wall time."""
    limits = httpx.Limits(max_connections=cfg.prompts * cfg.users + 4)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(conversation(client, cfg, p, u)
                                      for u in range(cfg.users) for p in range(cfg.prompts)))
        return [t for run in runs for t in run], time.perf_counter() - t0


def warm_up(layout: Layout) -> None:
    """One short request straight to each worker, so no measured request pays a worker's first-call costs; it is
    shorter than a block, so it caches and announces nothing."""
    for w in layout.workers:
        body = json.dumps({"model": "hafiza", "prompt": "Hi", "max_tokens": 2, "temperature": 0}).encode()
        req = urllib.request.Request(f"{w.url}/v1/completions", body, {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()


def run_setup(cfg: Config, workers: int, policy: str, log_dir: Path) -> tuple[list[Turn], float, list[int]]:
    """Start a cold cluster, run the workload through its router, stop it: turns, wall time, requests per worker."""
    layout = Layout.on_free_ports(workers, policy, cfg.layout_args())
    run_dir = log_dir / (f"{policy}-{workers}")
    run_dir.mkdir()
    cluster = Cluster(layout, run_dir).start()
    try:
        warm_up(layout)
        before = [requests_answered(w.url) for w in layout.workers]
        turns, wall = asyncio.run(workload(layout.url, cfg))
        after = [requests_answered(w.url) for w in layout.workers]
    finally:
        cluster.stop()
    return turns, wall, [a - b for a, b in zip(after, before, strict=True)]


def summarize(policy: str, turns: list[Turn], wall: float, per_worker: list[int], reference: list[Turn] | None
              ) -> dict[str, Any]:
    """One `results` entry: hit rates over prompt tokens, TTFT, throughput, spread, and equality with `reference`."""
    prompt = sum(t.prompt_tokens for t in turns) or 1
    ttfts = [t.ttft_s for t in turns]
    key = {(t.prompt, t.user, t.turn): t.text for t in (reference or turns)}
    return {
        "policy": policy,
        "requests": len(turns),
        "prompt_tokens": prompt,
        "hit_rate": sum(t.cached_tokens for t in turns) / prompt,
        "pool_hit_rate": sum(t.pool_tokens for t in turns) / prompt,
        "redis_hit_rate": sum(t.redis_tokens for t in turns) / prompt,
        "mean_ttft_s": statistics.fmean(ttfts),
        "p99_ttft_s": nearest_rank(ttfts, 0.99),
        "tok_s": sum(t.output_tokens for t in turns) / wall,
        "wall_s": wall,
        "requests_per_worker": per_worker,
        "identical": all(key.get((t.prompt, t.user, t.turn)) == t.text for t in turns),
    }


def targets(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's targets: kv_aware's hit rate against round_robin's (>= 1.5x) and one instance's (within 10 %),
    its mean TTFT against round_robin's (lower); only for the policies that ran."""
    by = {r["policy"]: r for r in results}
    kv, rr, one = by.get("kv_aware"), by.get("round_robin"), by.get(SINGLE)
    out: dict[str, Any] = {}
    if kv and rr:
        out["kv_over_rr_hit"] = kv["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else None
        out["kv_over_rr_hit_met"] = kv["hit_rate"] > 0 and kv["hit_rate"] >= 1.5 * rr["hit_rate"]
        out["kv_over_rr_ttft"] = kv["mean_ttft_s"] / rr["mean_ttft_s"]
        out["kv_ttft_met"] = kv["mean_ttft_s"] < rr["mean_ttft_s"]
    if kv and one:
        out["kv_over_single_hit"] = kv["hit_rate"] / one["hit_rate"] if one["hit_rate"] else None
        out["kv_single_hit_met"] = kv["hit_rate"] >= 0.9 * one["hit_rate"]
    return out


def run_bench(cfg: Config, log_dir: Path) -> dict[str, Any]:
    """The single-instance reference, then every policy over `cfg.workers` instances; `results` and `targets`."""
    single, wall, per_worker = run_setup(cfg, 1, "round_robin", log_dir)
    results = [summarize(SINGLE, single, wall, per_worker, None)]
    for policy in cfg.policies:
        turns, wall, per_worker = run_setup(cfg, cfg.workers, policy, log_dir)
        results.append(summarize(policy, turns, wall, per_worker, single))
    return {"results": results, "targets": targets(results)}


def markdown(res: dict[str, Any]) -> str:
    """The results as a markdown table plus the targets line."""
    rows = [(r["policy"], r["requests"], f"{r['hit_rate']:.1%}", f"{r['pool_hit_rate']:.1%}",
             f"{r['redis_hit_rate']:.1%}", f"{r['mean_ttft_s'] * 1000:.0f}", f"{r['p99_ttft_s'] * 1000:.0f}",
             f"{r['tok_s']:.1f}", " / ".join(map(str, r["requests_per_worker"])), r["identical"])
            for r in res["results"]]
    head = ("policy", "requests", "hit rate", "pool", "redis", "mean TTFT ms", "p99 TTFT ms", "tok/s",
            "requests per worker", "identical")
    t = res["targets"]
    line = []
    if "kv_over_rr_hit" in t:
        ratio = "inf" if t["kv_over_rr_hit"] is None else f"{t['kv_over_rr_hit']:.2f}x"
        line.append(f"kv_aware hit rate / round_robin's: {ratio} (target >= 1.5x: "
                    f"{'met' if t['kv_over_rr_hit_met'] else 'missed'})")
        line.append(f"kv_aware mean TTFT / round_robin's: {t['kv_over_rr_ttft']:.2f} (target < 1: "
                    f"{'met' if t['kv_ttft_met'] else 'missed'})")
    if "kv_over_single_hit" in t and t["kv_over_single_hit"] is not None:
        line.append(f"kv_aware hit rate / one instance's: {t['kv_over_single_hit']:.2f} (target >= 0.90: "
                    f"{'met' if t['kv_single_hit_met'] else 'missed'})")
    return table(head, rows) + "\n\n" + "\n".join(f"- {x}" for x in line)


def register(bench_app: typer.Typer) -> None:
    """Add `hafiza bench cluster`."""

    @bench_app.command("cluster")
    def cluster_bench(
        prompts: Annotated[int, typer.Option(help="Shared system prompts (K).")] = 3,
        users: Annotated[int, typer.Option(help="Users per system prompt.")] = 3,
        turns: Annotated[int, typer.Option(help="Turns per user (each resends the conversation).")] = 3,
        system_words: Annotated[int, typer.Option(help="Words per system prompt (~1.3 tokens each).")] = 400,
        max_tokens: Annotated[int, typer.Option(help="Reply length per turn.")] = 16,
        workers: Annotated[int, typer.Option(help="Instances behind the router (one thread each).")] = 2,
        policy: Annotated[list[str] | None, typer.Option(help="Router policy to run (repeatable; default all "
                                                               "three).")] = None,
        kv_memory: Annotated[str, typer.Option(help="Each instance's KV pool size.")] = "256MiB",
        model: Annotated[str | None, typer.Option(help="Model for the instances (default: SmolLM2-135M).")] = None,
        json_path: Annotated[Path | None, typer.Option("--json", help="Where to write the JSON results.")] = None,
        doc: Annotated[Path | None, typer.Option(help="Markdown file whose cluster region gets the table.")] = None,
    ) -> None:
        """vllm-router over N instances and one redis-server under each policy, against one instance: hit rates,
        TTFT, tok/s, requests per worker, identical answers."""
        from hafiza.errors import HafizaError

        chosen = tuple(policy or POLICIES)
        if bad := [p for p in chosen if p not in POLICIES]:
            raise HafizaError(f"--policy must be round_robin, cache_aware or kv_aware, got {bad[0]!r}")
        if min(prompts, users, turns, system_words, max_tokens) < 1 or workers < 2:
            raise HafizaError("--prompts, --users, --turns, --system-words and --max-tokens must be positive and "
                              "--workers at least 2")
        cfg = Config(prompts, users, turns, system_words, max_tokens=max_tokens, workers=workers,
                     kv_memory=kv_memory, model=model, policies=chosen)
        log_dir = Path(tempfile.mkdtemp(prefix="hafiza-bench-cluster-"))
        res = run_bench(cfg, log_dir)
        text = markdown(res)
        print(text)
        if doc is not None:
            doc.write_text(replace_region(doc.read_text() if doc.exists() else "", REGION, text))
        payload = {"bench": "cluster", "config": asdict(cfg), "worker_threads": 1, **res}
        out = write_json(payload, json_path, "cluster.json")
        info = machine()
        print(f"machine: {info['cpu']}, {info['cores']} cores; logs in {log_dir}; results written to {out}")
