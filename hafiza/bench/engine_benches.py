"""`hafiza bench prefix|batch|memory`: prefix-cache TTFT, continuous-batching throughput, paged-pool waste."""

from __future__ import annotations

import random
import statistics
import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from hafiza.bench.common import write_json
from hafiza.bench.weights_worker import weights_label
from hafiza.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from hafiza.models import LoadedModel, load_model
from hafiza.options import Weights

SYSTEM_SENTENCE = (
    "You are the support assistant of a bicycle shop. Answer briefly, quote prices in euros, and never invent "
    "parts that are not in the catalogue. "
)
QUESTIONS = ["Do you repair e-bikes?", "How much is a new chain?", "Are you open on Sunday?", "Do you sell helmets?",
             "Can I rent a tandem?", "How long does a service take?", "Do you ship abroad?", "Is there a warranty?"]


def system_prompt(loaded: LoadedModel, tokens: int) -> str:
    """A system prompt of about `tokens` tokens."""
    per = len(loaded.tokenizer.encode(SYSTEM_SENTENCE))
    return SYSTEM_SENTENCE * max(1, tokens // per)


def chat_ids(loaded: LoadedModel, system: str, question: str) -> list[int]:
    tok = loaded.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "system", "content": system},
                                               {"role": "user", "content": question}]))


def ttft(engine: LLMEngine, ids: list[int], salt: str | None) -> tuple[float, int]:
    """Seconds to the first token, and the cached tokens the request reported."""
    engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0), cache_salt=salt)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                return time.perf_counter() - t0, out.num_cached_tokens
    raise RuntimeError("request vanished")


def bench_prefix(loaded: LoadedModel, system_tokens: int, repeats: int) -> dict[str, Any]:
    engine = LLMEngine(loaded, EngineConfig(kv_memory="512MiB"))
    system = system_prompt(loaded, system_tokens)
    prompt_len = len(chat_ids(loaded, system, QUESTIONS[0]))
    ttft(engine, chat_ids(loaded, system, "warm-up"), salt="warm-up")
    cold, warm, cached = [], [], []
    ttft(engine, chat_ids(loaded, system, QUESTIONS[0]), salt=None)  # prime the shared prefix
    for i in range(repeats):
        q = QUESTIONS[(i + 1) % len(QUESTIONS)]
        cold.append(ttft(engine, chat_ids(loaded, system, q), salt=f"cold-{i}")[0])  # a salt nobody has cached
        t, c = ttft(engine, chat_ids(loaded, system, q + " "), salt=None)
        warm.append(t)
        cached.append(c)
    c, w = statistics.median(cold), statistics.median(warm)
    return {"prompt_tokens": prompt_len, "cached_tokens": statistics.median(cached), "cold_ttft_s": c,
            "warm_ttft_s": w, "speedup": c / w, "repeats": repeats}


def timed_generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
                   ) -> tuple[list[RequestOutput], float]:
    """One short warm-up request, then `prompts` as one `generate` call: its outputs and wall seconds."""
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    return out, time.perf_counter() - t0


def bench_batch(loaded: LoadedModel, streams: list[int], new_tokens: int) -> dict[str, Any]:
    results = []
    for n in streams:
        engine = LLMEngine(loaded, EngineConfig(kv_memory="512MiB", max_num_seqs=max(streams)))
        prompts = [chat_ids(loaded, "You are helpful.", QUESTIONS[i % len(QUESTIONS)] + f" ({i})") for i in range(n)]
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        out, secs = timed_generate(engine, prompts, params)
        tokens = sum(len(r.token_ids) for r in out)
        results.append({"streams": n, "tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs})
    base = results[0]["tokens_per_s"]
    for r in results:
        r["speedup_vs_1"] = r["tokens_per_s"] / base
    return {"new_tokens": new_tokens, "weights": weights_label(loaded), "results": results}


def bench_memory(loaded: LoadedModel, requests: int, max_len: int, seed: int) -> dict[str, Any]:
    """Run a mixed-length workload; at every step compare the paged pool's allocated-but-empty slots with what a
    contiguous allocator reserving `max_len` slots per running request would leave empty."""
    rng = random.Random(seed)
    engine = LLMEngine(loaded, EngineConfig(kv_memory="512MiB", max_num_seqs=16))
    for _ in range(requests):
        prompt_len = min(max_len // 2, int(rng.lognormvariate(5.0, 0.8)) + 8)
        out_len = min(max_len - prompt_len, int(rng.lognormvariate(3.5, 0.7)) + 1)
        engine.add_request([rng.randrange(100, 40000) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True))
    paged_alloc = paged_waste = contig_alloc = contig_waste = 0
    while engine.has_unfinished():
        engine.step()
        s = engine.stats()
        allocated = s.blocks.in_use * s.blocks.block_size
        paged_alloc += allocated
        paged_waste += s.waste_slots
        contig_alloc += s.num_running * max_len
        contig_waste += s.num_running * max_len - s.stored_tokens
    return {"requests": requests, "max_len": max_len, "block_size": engine.layout.block_size,
            "paged_waste_pct": 100 * paged_waste / paged_alloc,
            "contiguous_waste_pct": 100 * contig_waste / contig_alloc,
            "memory_saved_pct": 100 * (1 - paged_alloc / contig_alloc)}


def _table(title: str, header: list[str], rows: list[list[str]]) -> None:
    table = Table(title=title)
    for h in header:
        table.add_column(h, justify="right")
    for r in rows:
        table.add_row(*r)
    Console().print(table)


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("prefix")
    def prefix(
        json_path: Annotated[str | None, typer.Option("--json", help="Where to write the JSON results.")] = None,
        model: Annotated[str | None, typer.Option(help="GGUF file or model directory.")] = None,
        system_tokens: Annotated[int, typer.Option(help="Length of the shared system prompt.")] = 2000,
        repeats: Annotated[int, typer.Option(help="Cold/warm pairs (medians reported).")] = 5,
        dtype: Annotated[str, typer.Option(help="fp32 or bf16.")] = "fp32",
        device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
        weights: Weights = "auto",
    ) -> None:
        """TTFT with a cold vs a warm prefix cache for a long shared system prompt."""
        data = bench_prefix(load_model(model, dtype=dtype, device=device, weights=weights), system_tokens, repeats)
        _table("Prefix cache: shared system prompt + short question",
               ["prompt tokens", "cached tokens", "cold TTFT s", "warm TTFT s", "speedup"],
               [[str(data["prompt_tokens"]), f"{data['cached_tokens']:.0f}", f"{data['cold_ttft_s']:.3f}",
                 f"{data['warm_ttft_s']:.3f}", f"{data['speedup']:.1f}x"]])
        print(f"wrote {write_json(data, json_path, 'prefix.json')}")

    @bench_app.command("batch")
    def batch(
        json_path: Annotated[str | None, typer.Option("--json", help="Where to write the JSON results.")] = None,
        model: Annotated[str | None, typer.Option(help="GGUF file or model directory.")] = None,
        streams: Annotated[str, typer.Option(help="Comma-separated stream counts.")] = "1,4,16",
        new_tokens: Annotated[int, typer.Option(help="Tokens generated per stream.")] = 64,
        dtype: Annotated[str, typer.Option(help="fp32 or bf16.")] = "fp32",
        device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
        weights: Weights = "auto",
    ) -> None:
        """Aggregate decode throughput with 1, 4 and 16 concurrent streams (continuous batching)."""
        data = bench_batch(load_model(model, dtype=dtype, device=device, weights=weights),
                           [int(s) for s in streams.split(",")],
                           new_tokens)
        _table(f"Continuous batching, weights {data['weights']}",
               ["streams", "tokens", "seconds", "tok/s", "vs 1 stream"],
               [[str(r["streams"]), str(r["tokens"]), f"{r['seconds']:.2f}", f"{r['tokens_per_s']:.1f}",
                 f"{r['speedup_vs_1']:.1f}x"] for r in data["results"]])
        print(f"wrote {write_json(data, json_path, 'batch.json')}")

    @bench_app.command("memory")
    def memory(
        json_path: Annotated[str | None, typer.Option("--json", help="Where to write the JSON results.")] = None,
        model: Annotated[str | None, typer.Option(help="GGUF file or model directory.")] = None,
        requests: Annotated[int, typer.Option(help="Requests in the mixed-length workload.")] = 48,
        max_len: Annotated[int, typer.Option(help="Max sequence length a contiguous allocator reserves.")] = 2048,
        seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
    ) -> None:
        """KV slots wasted by the paged pool vs contiguous max-length preallocation."""
        data = bench_memory(load_model(model), requests, max_len, seed)
        _table("KV memory waste on a mixed-length workload (time-averaged over steps)",
               ["requests", "block size", "paged waste", "contiguous waste", "memory saved"],
               [[str(data["requests"]), str(data["block_size"]), f"{data['paged_waste_pct']:.1f} %",
                 f"{data['contiguous_waste_pct']:.1f} %", f"{data['memory_saved_pct']:.1f} %"]])
        print(f"wrote {write_json(data, json_path, 'memory.json')}")
