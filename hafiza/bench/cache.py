"""`hafiza bench cache`: 64 new tokens with the KV cache vs recomputing the whole prefix every step, at 128 and
1024 tokens of context, for hafiza and (same run, same weights and dtype) transformers' generate."""

from __future__ import annotations

import time
from typing import Annotated, Any

import torch
import typer
from rich.console import Console
from rich.table import Table

from hafiza.bench.common import write_json
from hafiza.bench.peers import transformers_model
from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.models import LoadedModel, load_model
from hafiza.models.attention import AttentionMetadata, PrefillSpan
from hafiza.models.capture import ContiguousKV

NEW_TOKENS = 64


def context_ids(loaded: LoadedModel, n: int) -> list[int]:
    """`n` token ids of real English text (the README's opening, repeated as needed)."""
    text = (
        "A transformer keeps the keys and values of every token it has read, so that each new token attends to "
        "the whole history without recomputing it. This memory grows with the context, one block at a time. "
    )
    ids = loaded.tokenizer.encode(text * (n // 20 + 2))
    return ids[:n]


def hafiza_cached(loaded: LoadedModel, ids: list[int]) -> tuple[float, float]:
    """(total seconds, TTFT) for 64 greedy tokens through the engine with its paged KV cache."""
    engine = LLMEngine(loaded, EngineConfig(kv_memory="256MiB", kv_dtype="model", enable_prefix_caching=False,
                                            max_num_batched_tokens=2048))
    engine.add_request(ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and first is None:
                first = time.perf_counter()
    return time.perf_counter() - t0, (first or t0) - t0


def hafiza_uncached(loaded: LoadedModel, ids: list[int]) -> tuple[float, float]:
    """(total seconds, TTFT) when every step recomputes the whole prefix (no KV reuse), same forward code."""
    model = loaded.model
    tokens = list(ids)
    t0 = time.perf_counter()
    first = None
    for _ in range(NEW_TOKENS):
        n = len(tokens)
        pos = torch.arange(n, device=model.device)
        scratch = ContiguousKV(model, n)
        meta = AttentionMetadata(slot_mapping=pos, prefills=[PrefillSpan(0, n, n)])
        hidden = model.forward(torch.tensor(tokens, device=model.device), pos, meta, scratch)
        tokens.append(int(model.logits(hidden[-1:]).argmax()))
        if first is None:
            first = time.perf_counter()
    return time.perf_counter() - t0, (first or t0) - t0


def transformers_run(hf: Any, ids: list[int], use_cache: bool) -> tuple[float, float]:
    """(total seconds, TTFT) for transformers' generate (DynamicCache when use_cache)."""
    x = torch.tensor([ids], device=hf.device)
    kw = {"do_sample": False, "use_cache": use_cache, "pad_token_id": 0}
    with torch.inference_mode():
        t0 = time.perf_counter()
        hf.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf.generate(x, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, **kw)
        return time.perf_counter() - t0, ttft


def run(model: str | None, dtype: str, device: str, contexts: list[int], repeats: int) -> dict[str, Any]:
    loaded = load_model(model, dtype=dtype, device=device)
    hf = transformers_model(loaded)
    results = []
    for ctx in contexts:
        ids = context_ids(loaded, ctx)
        runs = [("hafiza", True, lambda ids=ids: hafiza_cached(loaded, ids)),
                ("hafiza", False, lambda ids=ids: hafiza_uncached(loaded, ids)),
                ("transformers", True, lambda ids=ids: transformers_run(hf, ids, True)),
                ("transformers", False, lambda ids=ids: transformers_run(hf, ids, False))]
        samples: dict[tuple[str, bool], list[tuple[float, float]]] = {(s, c): [] for s, c, _ in runs}
        hafiza_cached(loaded, ids[:16])  # warm-up
        for rep in range(repeats):
            for system, cache, fn in runs:  # interleaved, so machine noise hits every system alike
                if not cache and rep > 0 and ctx > 512:
                    continue  # the no-cache runs are long; one sample at long contexts
                samples[(system, cache)].append(fn())
        for (system, cache), vals in samples.items():
            secs = sorted(v[0] for v in vals)[len(vals) // 2]
            ttft = sorted(v[1] for v in vals)[len(vals) // 2]
            decode = (NEW_TOKENS - 1) / (secs - ttft) if secs > ttft else 0.0
            results.append({"context": ctx, "system": system, "cache": cache, "seconds": secs,
                            "tokens_per_s": NEW_TOKENS / secs, "decode_tokens_per_s": decode, "ttft_s": ttft,
                            "samples": len(vals)})
    for r in results:
        base = next(x for x in results if x["context"] == r["context"] and x["system"] == r["system"]
                    and not x["cache"])
        r["compute_reduction_pct"] = 100 * (1 - r["seconds"] / base["seconds"]) if r["cache"] else 0.0
    return {"new_tokens": NEW_TOKENS, "dtype": dtype, "device": str(loaded.device), "model": loaded.name,
            "results": results}


def print_table(data: dict[str, Any]) -> None:
    table = Table(title=f"KV cache vs recompute: {data['new_tokens']} new tokens, {data['model']}, {data['dtype']}")
    for col in ("context", "system", "KV cache", "seconds", "tok/s", "decode tok/s", "TTFT s", "compute saved"):
        table.add_column(col, justify="right")
    for r in data["results"]:
        table.add_row(str(r["context"]), r["system"], "yes" if r["cache"] else "no", f"{r['seconds']:.2f}",
                      f"{r['tokens_per_s']:.1f}", f"{r['decode_tokens_per_s']:.1f}", f"{r['ttft_s']:.3f}",
                      f"{r['compute_reduction_pct']:.0f} %" if r["cache"] else "")
    Console().print(table)


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("cache")
    def cache(
        json_path: Annotated[str | None, typer.Option("--json", help="Where to write the JSON results.")] = None,
        model: Annotated[str | None, typer.Option(help="GGUF file or model directory.")] = None,
        dtype: Annotated[str, typer.Option(help="fp32 or bf16 (both systems).")] = "fp32",
        device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
        contexts: Annotated[str, typer.Option(help="Comma-separated context lengths.")] = "128,1024",
        repeats: Annotated[int, typer.Option(help="Runs per cached configuration (median reported).")] = 3,
    ) -> None:
        """Generation with the KV cache vs without it, hafiza and transformers in the same run."""
        data = run(model, dtype, device, [int(c) for c in contexts.split(",")], repeats)
        print_table(data)
        print(f"wrote {write_json(data, json_path, 'cache.json')}")
