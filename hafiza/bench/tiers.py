"""`hafiza bench tiers`: time to first token for a 2,000-token prompt whose prefix comes from each store tier
(host RAM, local disk, Redis) against recomputing it, and the bytes each codec stores per token.

Each tier gets its own engine (same config as `hafiza serve`: bf16 KV, 512-token prefill chunks) with a
StoreConnector over that tier alone. The prompt is written once, then every timed run empties the engine's
pool first, so the prefix must come from the tier (lookup, fetch, decode, write into the pool) and only the
last block is computed. Runs are interleaved across tiers and recompute; medians are reported. The disk
tier's files sit in the page cache (they were just written), as they would on a warm server. Redis is a
local redis-server started for the run (or `--redis URL`).
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from rich.console import Console
from rich.table import Table

from hafiza.bench.common import redis_process, write_json
from hafiza.cache.hashing import chain_hashes
from hafiza.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from hafiza.engine.connector import TierOutcome
from hafiza.models import LoadedModel, load_model
from hafiza.store.base import KVStore
from hafiza.store.codecs import (
    DEFAULT_STORE_CODEC,
    STORE_CODECS,
    TOKEN_CODECS,
    check_codec,
    decode_block,
    encode_block,
)
from hafiza.store.connector import StoreConnector
from hafiza.store.disk import DiskStore
from hafiza.store.memory import MemoryStore
from hafiza.store.redis_store import RedisStore
from hafiza.store.speculative import BlockPredictor, BlockwiseKV
from hafiza.store.tiered import TieredStore

TEXT = Path("bench/texts/en_declaration_gettysburg.txt")
FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def prompt_ids(loaded: LoadedModel, n: int) -> list[int]:
    """`n` tokens of real English prose (the benchmark text, repeated if it is too short)."""
    text = TEXT.read_text() if TEXT.exists() else "The memory of a transformer is its KV cache. "
    ids = loaded.tokenizer.encode(text)
    while len(ids) < n:
        ids += ids
    return ids[:n]


def new_engine(loaded: LoadedModel) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(kv_memory="160MiB"))


def first_token(engine: LLMEngine, ids: list[int]) -> tuple[float, RequestOutput]:
    """Empty the pool of this prompt's blocks, then (TTFT seconds, first output) for one greedy token."""
    engine.blocks.drop(chain_hashes(ids, engine.layout.block_size, (*engine.extra_keys, None)))
    t0 = time.perf_counter()
    engine.add_request(ids, FIRST_TOKEN)
    first: tuple[float, RequestOutput] | None = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and first is None:
                first = (time.perf_counter() - t0, out)
    assert first is not None
    return first


@contextlib.contextmanager
def local_redis(url: str | None) -> Iterator[str | None]:
    """`url`, or a throw-away redis-server on a free loopback port (None when redis-server is missing)."""
    exe = shutil.which("redis-server")
    if url is not None or exe is None:
        yield url
        return
    with redis_process(exe) as (port, _):
        yield f"redis://127.0.0.1:{port}/0"


def codec_table(engine: LLMEngine, ids: list[int], codecs: list[str]) -> list[dict[str, Any]]:
    """Bytes per token and per-block encode/decode times of each codec on the prompt's real KV blocks."""
    bs = engine.layout.block_size
    block_ids = [engine.blocks.hash_to_block[h] for h in chain_hashes(ids, bs, (*engine.extra_keys, None))]
    data = engine.kv.read_blocks(block_ids)
    blocks = [data[:, :, i].contiguous() for i in range(len(block_ids))]
    raw = sum(b.numel() * b.element_size() for b in blocks)
    tokens = len(blocks) * bs
    rows = []
    for codec in codecs:
        sizes, enc, dec = [], [], []
        predictor = decoder = None
        if codec in TOKEN_CODECS:  # one predictor encodes, another decodes: each reruns the prefix once, block by block
            predictor, decoder = (BlockPredictor(BlockwiseKV(engine.runner.model, bs), engine.extra_keys[0])
                                  for _ in range(2))
        for i, b in enumerate(blocks):
            prefix = ids[: (i + 1) * bs] if predictor is not None else None
            t0 = time.perf_counter()
            blob = encode_block(b, codec, prefix, predictor)
            t1 = time.perf_counter()
            back = decode_block(blob, b.shape, b.dtype, prefix, decoder)
            t2 = time.perf_counter()
            assert torch.equal(back.view(torch.int16), b.view(torch.int16)), f"{codec} is not lossless"
            sizes.append(len(blob))
            enc.append(t1 - t0)
            dec.append(t2 - t1)
        rows.append({"codec": codec, "bytes_per_token": sum(sizes) / tokens, "ratio": raw / sum(sizes),
                     "encode_ms_per_block": 1e3 * statistics.median(enc),
                     "decode_ms_per_block": 1e3 * statistics.median(dec), "decode_s_prefix": sum(dec)})
    return rows


def run(model: str | None, dtype: str, device: str, tokens: int, repeats: int, codec: str, codecs: list[str],
        redis_url: str | None) -> dict[str, Any]:
    loaded = load_model(model, dtype=dtype, device=device)
    ids = prompt_ids(loaded, tokens)
    recompute = new_engine(loaded)
    first_token(recompute, ids)  # warm-up, and the KV blocks for the codec table
    codec_rows = codec_table(recompute, ids, codecs)
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(local_redis(redis_url))
        disk_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="hafiza-bench-disk-"))
        tiers: dict[str, KVStore] = {"ram": MemoryStore(1 << 30, name="ram"),
                                     "disk": DiskStore(disk_dir, 1 << 30, name="disk")}
        if url is not None:
            tiers["redis"] = RedisStore(url, name="redis", prefix=f"hafiza-bench-{time.time_ns()}:",
                                        default_ttl_s=None)  # no expiry: a slow run must not outlive the 5 min TTL
        engines: dict[str, tuple[LLMEngine, StoreConnector]] = {}
        for name, tier in tiers.items():
            engine = new_engine(loaded)
            connector = StoreConnector.for_engine(engine, TieredStore([tier]), codec=codec, default_ttl_s=None)
            engine.attach_connector(connector)
            first_token(engine, ids)  # computes the prompt and writes its blocks to the tier
            connector.flush()
            engines[name] = (engine, connector)
        samples: dict[str, list[float]] = {name: [] for name in ["recompute", *engines]}
        last: dict[str, RequestOutput] = {}
        for _ in range(repeats):  # interleaved, so machine noise hits every tier alike
            samples["recompute"].append(first_token(recompute, ids)[0])
            for name, (engine, _) in engines.items():
                seconds, last[name] = first_token(engine, ids)
                samples[name].append(seconds)
        recompute_s = statistics.median(samples["recompute"])
        results = []
        for name, (engine, connector) in engines.items():
            stored = connector.store.tiers[0].stats().bytes_written
            ttft = statistics.median(samples[name])
            tiers = last[name].tiers or TierOutcome()
            results.append({"tier": name, "codec": codec, "ttft_s": ttft, "speedup": recompute_s / ttft,
                            "bytes_per_token": stored / (len(ids) // engine.layout.block_size
                                                         * engine.layout.block_size),
                            "loaded_tokens": tiers.loaded_tokens, "decision": tiers.reason,
                            "samples": samples[name]})
            if name == "redis":
                connector.store.tiers[0].clear()
            connector.close()
    return {"model": loaded.name, "dtype": dtype, "kv_dtype": recompute.stats().kv_dtype, "device": str(loaded.device),
            "prompt_tokens": len(ids), "repeats": repeats, "recompute_ttft_s": recompute_s,
            "recompute_samples": samples["recompute"], "results": results, "codecs": codec_rows}


def print_tables(data: dict[str, Any]) -> None:
    table = Table(title=f"TTFT, {data['prompt_tokens']}-token prompt, {data['model']} ({data['device']}): "
                        f"store tier vs recompute (median of {data['repeats']})")
    for col in ("source", "codec", "TTFT s", "speed-up", "loaded tokens", "stored B/token"):
        table.add_column(col, justify="right")
    table.add_row("recompute", "", f"{data['recompute_ttft_s']:.3f}", "1.0x", "0", "")
    for r in data["results"]:
        table.add_row(r["tier"], r["codec"], f"{r['ttft_s']:.3f}", f"{r['speedup']:.1f}x", str(r["loaded_tokens"]),
                      f"{r['bytes_per_token']:.0f}")
    Console().print(table)
    codecs = Table(title="Stored bytes per token by codec (real KV blocks of the same prompt)")
    for col in ("codec", "B/token", "ratio vs raw bf16", "encode ms/block", "decode ms/block", "decode s/prefix"):
        codecs.add_column(col, justify="right")
    for r in data["codecs"]:
        codecs.add_row(r["codec"], f"{r['bytes_per_token']:.0f}", f"{r['ratio']:.3f}",
                       f"{r['encode_ms_per_block']:.2f}", f"{r['decode_ms_per_block']:.2f}",
                       f"{r['decode_s_prefix']:.3f}")
    Console().print(codecs)


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("tiers")
    def tiers(
        json_path: Annotated[str | None, typer.Option("--json", help="Where to write the JSON results.")] = None,
        model: Annotated[str | None, typer.Option(help="GGUF file or model directory.")] = None,
        dtype: Annotated[str, typer.Option(help="Compute dtype: fp32 or bf16.")] = "fp32",
        device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
        tokens: Annotated[int, typer.Option(help="Prompt length in tokens.")] = 2000,
        repeats: Annotated[int, typer.Option(help="Timed runs per source (median reported).")] = 5,
        codec: Annotated[str, typer.Option(help="Codec of the stored blocks for the TTFT runs.")
                         ] = DEFAULT_STORE_CODEC,
        codecs: Annotated[str, typer.Option(help="Codecs for the bytes-per-token table (comma-separated).")
                          ] = ",".join(c for c in STORE_CODECS if c not in TOKEN_CODECS),
        redis_url: Annotated[str | None, typer.Option("--redis", help="Redis URL (default: start a local "
                                                                        "redis-server for the run).")] = None,
    ) -> None:
        """TTFT from each KV store tier vs recompute, and stored bytes per token per codec."""
        names = [check_codec(c.strip()) for c in codecs.split(",") if c.strip()]
        data = run(model, dtype, device, tokens, repeats, check_codec(codec), names, redis_url)
        print_tables(data)
        print(f"wrote {write_json(data, json_path, 'tiers.json')}")
