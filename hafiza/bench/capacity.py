"""`hafiza bench capacity`: Redis-tier codecs at equal Redis memory, with two `hafiza serve` instances sharing one
redis-server whose `maxmemory` (allkeys-lru) holds only a fraction of the working set.

The workload is many distinct long prefixes, each followed by a short question, drawn with Zipf (or uniform)
popularity; requests alternate between the two instances. Every codec runs the same requests on fresh servers and an
emptied Redis. A cold greedy reference server (no store, a unique cache salt per request) answers every
(prefix, question) pair once; each codec's answers must equal it. Hit rate, TTFT, bytes moved and predictor seconds
come from the servers' headers and /metrics; prefixes held is sampled after every request by scanning Redis for the
block keys of each prefix (hashed exactly as the servers hash them).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import httpx
import redis
import typer
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from hafiza.bench.common import redis_process, wait_http, write_json
from hafiza.bench.economics import economics, print_economics
from hafiza.cache.hashing import chain_hashes
from hafiza.server.launch import free_port
from hafiza.store.codecs import check_codec

TEXTS = (Path("bench/texts/en_declaration_gettysburg.txt"), Path("bench/texts/de_grimm_maerchen.txt"),
         Path("bench/texts/code_hafiza_models.py.txt"))
QUESTIONS = ("Summarize this in one line.", "What is the main topic?", "Name one key word.", "Who wrote this?",
             "Give a title.", "What comes next?")
DEFAULT_CODECS = ("zstd", "fast", "speculative")
NO_TIER = "none"  # a run with no Redis tier at all: the floor every tier must beat
KEY_PREFIX = "hafiza:"
BLOCK_SIZE = 16  # passed to every server as --block-size, so the bench can size the pool and the working set


@dataclass(frozen=True)
class Request:
    """One workload request: which prefix and which question."""

    prefix: int
    question: int


@dataclass
class Sample:
    """What one served request did: TTFT, answer text and the token counts of its `x-hafiza-tiers` header."""

    request: Request
    ttft_s: float
    text: str
    pool_tokens: int
    redis_tokens: int
    computed_tokens: int
    decision: str
    why: str = ""  # the cost model's reason (the header's `why=`)


@dataclass
class CodecRun:
    """One codec's samples, its /metrics deltas (summed over both instances) and prefixes-held samples."""

    codec: str
    popularity: str = "zipf"
    samples: list[Sample] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def zipf_weights(n: int, s: float) -> list[float]:
    """Normalised Zipf weights 1/k^s for ranks 1..n (s = 0 is uniform)."""
    if n < 1:
        raise ValueError(f"need at least 1 prefix, got {n}")
    raw = [1.0 / (k ** s) for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def workload(prefixes: int, requests: int, questions: int, popularity: str, zipf_s: float,
             seed: int) -> list[Request]:
    """`requests` draws of (prefix, question): prefixes by Zipf rank (prefix 0 most popular) or uniformly."""
    if popularity not in ("zipf", "uniform"):
        raise ValueError(f"popularity must be zipf or uniform, got {popularity!r}")
    rng = random.Random(seed)
    weights = zipf_weights(prefixes, zipf_s if popularity == "zipf" else 0.0)
    picks = rng.choices(range(prefixes), weights=weights, k=requests)
    return [Request(p, rng.randrange(questions)) for p in picks]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation between order statistics."""
    if not values:
        raise ValueError("no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def prefixes_resident(keys: set[str], prefix_hashes: Sequence[Sequence[str]]) -> int:
    """How many prefixes have every one of their block hashes among `keys` (the hashes found in Redis)."""
    return sum(1 for hashes in prefix_hashes if hashes and all(h in keys for h in hashes))


def tier_tokens(tiers: dict[str, str], tier: str) -> int:
    """Tokens a header says came from `tier`, in its own codec or its fallback codec (`redis.fast=…`)."""
    return sum(int(v) for k, v in tiers.items() if k == tier or k.startswith(f"{tier}."))


def parse_tiers(header: str) -> dict[str, str]:
    """`x-hafiza-tiers` as a dict (everything but the free-text `why`)."""
    head = header.split("; why=", 1)[0]
    return dict(part.split("=", 1) for part in head.split("; ") if "=" in part)


def summarize(run: CodecRun, reference: dict[Request, str], tier_bytes: int, working_set_bytes: int) -> dict[str, Any]:
    """One results row: hit rate (store tokens / tokens the pool lacked), TTFT, bytes moved, predictor seconds,
    prefixes held and whether every answer equals the cold reference."""
    if not run.samples:
        raise ValueError(f"codec {run.codec}: no samples")
    ttfts = [s.ttft_s for s in run.samples]
    wanted = sum(s.redis_tokens + s.computed_tokens for s in run.samples)
    loaded = sum(s.redis_tokens for s in run.samples)
    n = len(run.samples)
    moved = run.metrics.get("read_bytes", 0.0) + run.metrics.get("written_bytes", 0.0)
    mismatched = [i for i, s in enumerate(run.samples) if reference.get(s.request) != s.text]
    return {
        "codec": run.codec, "popularity": run.popularity, "tier_bytes": tier_bytes,
        "working_set_bytes": working_set_bytes,
        "prefixes_held": statistics.fmean(run.held) if run.held else 0.0,
        "hit_rate": loaded / wanted if wanted else 0.0,
        "request_hit_rate": sum(1 for s in run.samples if s.redis_tokens > 0) / n,
        "mean_ttft_s": statistics.fmean(ttfts), "p99_ttft_s": percentile(ttfts, 0.99),
        "bytes_per_request": moved / n, "read_bytes_per_request": run.metrics.get("read_bytes", 0.0) / n,
        "written_bytes_per_request": run.metrics.get("written_bytes", 0.0) / n,
        "predictor_cpu_s": run.metrics.get("predictor_seconds", 0.0),
        "stored_bytes_per_block": (run.metrics.get("written_bytes", 0.0) / run.metrics["puts"]
                                   if run.metrics.get("puts") else None),
        "decisions": {k[len("decision_"):]: v for k, v in run.metrics.items() if k.startswith("decision_") and v},
        "encodes": {k[len("encodes_"):]: v for k, v in run.metrics.items() if k.startswith("encodes_") and v},
        "pool_tokens_per_request": sum(s.pool_tokens for s in run.samples) / n,
        "samples": [{"prefix": s.request.prefix, "question": s.request.question, "ttft_s": s.ttft_s,
                     "pool_tokens": s.pool_tokens, "redis_tokens": s.redis_tokens,
                     "computed_tokens": s.computed_tokens, "decision": s.decision, "why": s.why}
                    for s in run.samples],
        "requests": n, "identical": not mismatched, "mismatched_requests": mismatched,
    }


def metric_values(text: str) -> dict[str, float]:
    """The store counters this bench reads from one /metrics page (Redis tier, connector, decisions)."""
    out: dict[str, float] = {}
    names = {"hafiza:store_read_bytes_total": "read_bytes", "hafiza:store_written_bytes_total": "written_bytes",
             "hafiza:store_predictor_seconds_total": "predictor_seconds",
             "hafiza:store_puts_total": "puts", "hafiza:store_write_queue_depth": "queue_depth"}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "hafiza:store_encodes_total":
                out[f"encodes_{s.labels['codec']}"] = out.get(f"encodes_{s.labels['codec']}", 0.0) + s.value
            elif s.name == "hafiza:store_decisions_total":
                out[f"decision_{s.labels['decision']}"] = out.get(f"decision_{s.labels['decision']}", 0.0) + s.value
            elif s.name in names and s.labels.get("tier", "redis") == "redis":
                out[names[s.name]] = out.get(names[s.name], 0.0) + s.value
    return out


def corpus_text() -> str:
    """The bench prose and code, concatenated (the source of every prefix)."""
    return "\n".join(p.read_text() for p in TEXTS if p.exists()) or "The memory of a transformer is its KV cache. "


class Server:
    """One `hafiza serve` subprocess on a free loopback port, its log in `log`."""

    def __init__(self, log: Path, args: Sequence[str], kv_memory: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._out = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "hafiza", "serve", "--port", str(self.port),
                                      "--kv-memory", kv_memory, "--block-size", str(BLOCK_SIZE), *args],
                                     stdout=self._out, stderr=subprocess.STDOUT)
        self.model = ""

    def ready(self) -> Server:
        wait_http(self.proc, f"{self.url}/health", f"hafiza serve on port {self.port}")
        self.model = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"]
        return self

    def metrics(self) -> dict[str, float]:
        return metric_values(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def drain(self, timeout_s: float = 120.0) -> None:
        """Wait until the store's write queue is empty (or `timeout_s` passes)."""
        deadline = time.monotonic() + timeout_s
        while self.metrics().get("queue_depth", 0.0) > 0 and time.monotonic() < deadline:
            time.sleep(0.2)

    def tokenize(self, messages: list[dict[str, str]] | None = None, prompt: str | None = None) -> list[int]:
        body: dict[str, Any] = {"messages": messages} if messages is not None else {"prompt": prompt,
                                                                                     "add_special_tokens": False}
        r = httpx.post(f"{self.url}/tokenize", json=body, timeout=60)
        r.raise_for_status()
        return list(r.json()["tokens"])

    def detokenize(self, ids: list[int]) -> str:
        r = httpx.post(f"{self.url}/detokenize", json={"tokens": ids}, timeout=60)
        r.raise_for_status()
        return str(r.json()["prompt"])

    def ask(self, messages: list[dict[str, str]], max_tokens: int, salt: str | None = None) -> tuple[float, str, str]:
        """(TTFT seconds, answer text, x-hafiza-tiers) of one streamed greedy chat completion."""
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                                "temperature": 0, "stream": True}
        if salt is not None:
            body["cache_salt"] = salt
        t0 = time.perf_counter()
        ttft: float | None = None
        parts: list[str] = []
        with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=900) as r:
            if r.status_code != 200:
                raise RuntimeError(f"chat completion failed ({r.status_code}): {r.read().decode()[:300]}")
            header = r.headers.get("x-hafiza-tiers", "")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece and ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(piece)
        return (ttft if ttft is not None else time.perf_counter() - t0), "".join(parts), header

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._out.close()


@contextlib.contextmanager
def servers(logdir: Path, name: str, count: int, args: Sequence[str], kv_memory: str) -> Iterator[list[Server]]:
    """`count` servers started together, stopped on exit."""
    procs = [Server(logdir / f"{name}-{i}.log", args, kv_memory) for i in range(count)]
    try:
        for p in procs:
            p.ready()
        yield procs
    except BaseException:
        for p in procs:
            if p.proc.poll() is not None:
                sys.stderr.write((logdir / f"{name}-{procs.index(p)}.log").read_text()[-3000:])
        raise
    finally:
        for p in procs:
            p.stop()


@contextlib.contextmanager
def redis_server(maxmemory: int) -> Iterator[tuple[str, redis.Redis]]:
    """A throw-away redis-server on a free loopback port with `maxmemory` bytes and allkeys-lru."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (Debian package redis-server)")
    with redis_process(exe, "--maxmemory", str(maxmemory), "--maxmemory-policy", "allkeys-lru") as (port, client):
        yield f"redis://127.0.0.1:{port}/0?ttl=0", client


def redis_hashes(client: redis.Redis) -> tuple[set[str], tuple[str, str, int] | None]:
    """The block hashes of every key in Redis, and (fingerprint, kv_dtype, block_size) read from a key."""
    hashes: set[str] = set()
    extra: tuple[str, str, int] | None = None
    for raw in client.scan_iter(match=f"{KEY_PREFIX}hz1:*", count=1000):
        parts = raw.decode().split(":")
        hashes.add(parts[-1])
        if extra is None:
            extra = (parts[2], parts[3], int(parts[4]))
    return hashes, extra


@dataclass
class Config:
    """Workload and tier sizes of one bench run."""

    prefixes: int
    prefix_tokens: int
    requests: int
    max_tokens: int
    popularities: list[str]
    zipf_s: float
    tier_fraction: float
    codecs: list[str]
    seed: int
    quick: bool


def messages_of(prefixes: list[str], r: Request) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{prefixes[r.prefix]}\n\nQuestion: {QUESTIONS[r.question]}"}]


def build_prefixes(server: Server, n: int, tokens: int) -> list[str]:
    """`n` distinct texts of `tokens` tokens each: a numbered header and the corpus from a different offset."""
    ids = server.tokenize(prompt=corpus_text())
    while len(ids) < tokens * 2:
        ids += ids
    stride = max(1, (len(ids) - tokens) // max(1, n))
    out = []
    for i in range(n):
        start = (i * stride) % (len(ids) - tokens)
        out.append(f"Document {i + 1}.\n" + server.detokenize(ids[start:start + tokens]))
    return out


def run(cfg: Config, logdir: Path) -> dict[str, Any]:
    """The reference run, then every (popularity, codec) run; the JSON payload."""
    loads = {pop: workload(cfg.prefixes, cfg.requests, len(QUESTIONS), pop, cfg.zipf_s, cfg.seed)
             for pop in cfg.popularities}
    every = {r for reqs in loads.values() for r in reqs}
    console = Console(stderr=True)
    # Cold reference: no Redis; a RAM tier with the raw codec only measures the raw bytes per block.
    ref_args = ["--store-ram", "4GiB", "--store-ram-codec", "raw"]
    with servers(logdir, "reference", 1, ref_args, "256MiB") as (ref,):
        texts = build_prefixes(ref, cfg.prefixes, cfg.prefix_tokens)
        prompt_ids = [ref.tokenize(messages_of(texts, Request(i, 0))) for i in range(cfg.prefixes)]
        other_ids = [ref.tokenize(messages_of(texts, Request(i, 1))) for i in range(cfg.prefixes)]
        shared = [next((k for k, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
                  for x, y in zip(prompt_ids, other_ids, strict=True)]
        reference: dict[Request, str] = {}
        t0 = time.perf_counter()
        for j, r in enumerate(sorted(every, key=lambda r: (r.prefix, r.question))):
            _, reference[r], header = ref.ask(messages_of(texts, r), cfg.max_tokens, salt=f"cold-{j}")
            if int(parse_tiers(header).get("pool", "0") or 0) or int(parse_tiers(header).get("ram", "0") or 0):
                raise RuntimeError(f"reference request {j} was not cold: {header}")
        console.print(f"reference: {len(reference)} answers in {time.perf_counter() - t0:.0f} s")
        ref.drain()
        page = httpx.get(f"{ref.url}/metrics", timeout=10).text
    puts = written = 0.0
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            if s.labels.get("tier") == "ram" and s.name == "hafiza:store_puts_total":
                puts += s.value
            if s.labels.get("tier") == "ram" and s.name == "hafiza:store_written_bytes_total":
                written += s.value
    if not puts:
        raise RuntimeError("the reference server stored no blocks: cannot size the working set")
    block_bytes = written / puts  # raw codec: the block's bytes plus a small container header
    prompt_tokens = max(len(p) for p in prompt_ids) + 32
    prefix_blocks = [s // BLOCK_SIZE for s in shared]
    working_set = int(sum(prefix_blocks) * block_bytes)
    # a pool of about one prompt, so reuse has to come from Redis rather than the engine's own prefix cache
    kv_memory = str(int(prompt_tokens * block_bytes / BLOCK_SIZE * 1.5) + (8 << 20))
    tier_bytes = max(4 << 20, int(working_set * cfg.tier_fraction))
    runs: list[CodecRun] = []
    prefix_hashes: list[list[str]] = []
    for pop, codec in ((pop, codec) for pop in cfg.popularities for codec in cfg.codecs):
        run_, reqs = CodecRun(codec, pop), loads[pop]
        with redis_server(tier_bytes) as (url, client):
            args = [] if codec == NO_TIER else ["--store-redis", url, "--store-redis-codec", codec]
            with servers(logdir, f"{pop}-{codec}", 2, args, kv_memory) as pair:
                for k, s in enumerate(pair):  # warm-up, outside the workload's cache partition
                    s.ask([{"role": "user", "content": "Hello."}], 2, salt=f"warm-{k}")
                for s in pair:
                    s.drain()
                before = [s.metrics() for s in pair]
                t0 = time.perf_counter()
                for j, r in enumerate(reqs):
                    ttft, text, header = pair[j % 2].ask(messages_of(texts, r), cfg.max_tokens)
                    t = parse_tiers(header)
                    run_.samples.append(Sample(r, ttft, text, int(t.get("pool", 0)), tier_tokens(t, "redis"),
                                               int(t.get("computed", 0)), t.get("decision", ""),
                                               header.split("; why=", 1)[1] if "; why=" in header else ""))
                    keys, extra = redis_hashes(client)
                    if extra is not None and not prefix_hashes:
                        fp, kv_dtype, block_size = extra
                        prefix_hashes = [chain_hashes(ids[: shared[i]], block_size, (fp, kv_dtype, block_size, None))
                                         for i, ids in enumerate(prompt_ids)]
                    run_.held.append(prefixes_resident(keys, prefix_hashes))
                for s in pair:
                    s.drain()
                after = [s.metrics() for s in pair]
                info = client.info("memory")
                console.print(f"{pop} {codec}: {len(reqs)} requests in {time.perf_counter() - t0:.0f} s, redis "
                              f"used_memory {info['used_memory']} of {tier_bytes}, evicted "
                              f"{client.info('stats').get('evicted_keys', 0)} keys")
                for b, a in zip(before, after, strict=True):
                    for k in set(a) | set(b):
                        if k != "queue_depth":
                            run_.metrics[k] = run_.metrics.get(k, 0.0) + a.get(k, 0.0) - b.get(k, 0.0)
        runs.append(run_)
    if not any(run_.held and max(run_.held) for run_ in runs):
        console.print("[yellow]no prefix was ever found whole in Redis: check the key hashing[/yellow]")
    results = [summarize(r, reference, tier_bytes, working_set) for r in runs]
    return {"config": {**cfg.__dict__, "prefix_blocks_mean": statistics.fmean(prefix_blocks),
                       "block_size": BLOCK_SIZE, "raw_block_bytes": block_bytes,
                       "prompt_tokens_mean": statistics.fmean(len(p) for p in prompt_ids)},
            "working_set_bytes": working_set, "tier_bytes": tier_bytes, "results": results}


def print_table(data: dict[str, Any]) -> None:
    c = data["config"]
    table = Table(title=f"Redis-tier codecs at equal memory: {c['prefixes']} prefixes of ~{c['prefix_tokens']} tokens, "
                        f"{c['requests']} requests each, Redis {data['tier_bytes'] / 1e6:.1f} MB = "
                        f"1/{data['working_set_bytes'] / data['tier_bytes']:.1f} of the raw working set "
                        f"{data['working_set_bytes'] / 1e6:.1f} MB")
    for col in ("popularity", "codec", "KB/block", "prefixes held", "hit rate", "mean TTFT s", "p99 TTFT s",
                "MB moved/req", "predictor s", "decisions", "encodes", "identical"):
        table.add_column(col, justify="right")
    for r in data["results"]:
        per_block = r["stored_bytes_per_block"]
        table.add_row(r.get("popularity", c.get("popularity", "")), r["codec"],
                      "" if per_block is None else f"{per_block / 1e3:.0f}", f"{r['prefixes_held']:.2f}",
                      f"{r['hit_rate']:.1%}", f"{r['mean_ttft_s']:.3f}",
                      f"{r['p99_ttft_s']:.3f}", f"{r['bytes_per_request'] / 1e6:.2f}", f"{r['predictor_cpu_s']:.1f}",
                      " ".join(f"{k}={v:.0f}" for k, v in sorted(r["decisions"].items())),
                      " ".join(f"{k}={v:.0f}" for k, v in sorted(r.get("encodes", {}).items())),
                      "yes" if r["identical"] else f"no ({len(r['mismatched_requests'])})")
    Console(width=170).print(table)


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("capacity")
    def capacity(
        json_path: Annotated[str | None, typer.Option("--json", help="Where to write the JSON results.")] = None,
        quick: Annotated[bool, typer.Option("--quick", help="Small sizes (minutes on a small CPU).")] = False,
        codecs: Annotated[str, typer.Option(help="Redis-tier codecs to compare (comma-separated; `none`: no tier).")
                          ] = ",".join(DEFAULT_CODECS),
        prefixes: Annotated[int | None, typer.Option(help="Distinct prefixes (default 48; quick 12).")] = None,
        prefix_tokens: Annotated[int | None, typer.Option(help="Tokens per prefix (default 2000; quick 256).")
                                 ] = None,
        requests: Annotated[int | None, typer.Option(help="Requests per codec (default 200; quick 24).")] = None,
        max_tokens: Annotated[int, typer.Option(help="Answer length in tokens.")] = 8,
        popularity: Annotated[str, typer.Option(help="zipf, uniform, or both in one run (`zipf,uniform`).")
                              ] = "zipf",
        zipf_s: Annotated[float, typer.Option(help="Zipf exponent.")] = 1.0,
        tier_fraction: Annotated[float, typer.Option(help="Redis maxmemory as a fraction of the raw working set.")
                                 ] = 0.2,
        seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
        model_economics: Annotated[bool, typer.Option(
            "--model-economics", help="Also derive when a speculative hit beats a zstd hit and a recompute, check "
            "it against the run and evaluate it for published GPU and network figures.")] = False,
        from_json: Annotated[str | None, typer.Option(
            "--from-json", help="With --model-economics: read an earlier run's JSON instead of running.")] = None,
    ) -> None:
        """Redis-tier codecs at equal Redis memory: hit rate, TTFT, bytes moved, predictor CPU, prefixes held."""
        names = [x.strip() if x.strip() == NO_TIER else check_codec(x.strip()) for x in codecs.split(",") if x.strip()]
        pops = [p.strip() for p in popularity.split(",") if p.strip()]
        if not pops or any(p not in ("zipf", "uniform") for p in pops):
            raise typer.BadParameter(f"--popularity must be zipf, uniform or both, got {popularity!r}")
        if not 0 < tier_fraction <= 1:
            raise typer.BadParameter(f"--tier-fraction must be in (0, 1], got {tier_fraction}")
        if from_json is not None:
            if not model_economics:
                raise typer.BadParameter("--from-json is read only with --model-economics")
            data = json.loads(Path(from_json).read_text())
            data["economics"] = economics(data)
            print_economics(data["economics"])
            print(f"wrote {write_json(data, json_path, 'capacity_economics.json')}")
            return
        cfg = Config(prefixes or (12 if quick else 48), prefix_tokens or (256 if quick else 2000),
                     requests or (24 if quick else 200), max_tokens, pops, zipf_s, tier_fraction, names, seed,
                     quick)
        with tempfile.TemporaryDirectory(prefix="hafiza-bench-capacity-") as logdir:
            data = run(cfg, Path(logdir))
        print_table(data)
        if model_economics:
            data["economics"] = economics(data)
            print_economics(data["economics"])
        print(f"wrote {write_json(data, json_path, 'capacity.json')}")
