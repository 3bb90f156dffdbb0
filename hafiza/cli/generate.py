"""`hafiza generate`: stream a completion of one prompt to stdout; timing goes to stderr."""

from __future__ import annotations

import sys
import time
from typing import Annotated

import typer

from hafiza.cli import app
from hafiza.cli.speculative import (
    NumSpeculativeTokens,
    PromptLookupMax,
    PromptLookupMin,
    SpeculativeMethod,
    SpeculativeModel,
    load_draft,
    speculative_config,
)
from hafiza.options import Eviction, KvBudgetTokens, KvDtype, Weights


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="The prompt text.")],
    model: Annotated[str | None, typer.Option(help="GGUF file or model directory (default: SmolLM2-135M).")] = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate at most.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.7,
    top_k: Annotated[int, typer.Option(help="0 = off.")] = 0,
    top_p: Annotated[float, typer.Option(help="1 = off.")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Seed for sampling.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    chat: Annotated[bool, typer.Option(help="Wrap the prompt in the model's chat template.")] = False,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    dtype: Annotated[str, typer.Option(help="Compute dtype: fp32 or bf16.")] = "fp32",
    weights: Weights = "auto",
    kv_dtype: KvDtype = "auto",
    eviction: Eviction = None,
    kv_budget_tokens: KvBudgetTokens = None,
    speculative_method: SpeculativeMethod = None,
    num_speculative_tokens: NumSpeculativeTokens = None,
    prompt_lookup_max: PromptLookupMax = None,
    prompt_lookup_min: PromptLookupMin = None,
    speculative_model: SpeculativeModel = None,
) -> None:
    """Generate text from PROMPT, streaming it as it is produced."""
    from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
    from hafiza.engine.engine import kv_memory_for_tokens
    from hafiza.models import load_model

    speculative = speculative_config(speculative_method, num_speculative_tokens, prompt_lookup_max, prompt_lookup_min,
                                     eviction, speculative_model)
    t0 = time.perf_counter()
    lm = load_model(model, dtype=dtype, device=device, weights=weights)
    load_s = time.perf_counter() - t0
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    config = EngineConfig(kv_dtype=kv_dtype, eviction=eviction, kv_budget_tokens=kv_budget_tokens,
                          speculative=speculative, max_num_seqs=1,
                          draft_model=load_draft(speculative, dtype, device, weights))
    drafted = speculative.num_speculative_tokens if speculative is not None else 0
    ids = lm.tokenizer.encode(text)
    tokens = len(ids) + max_tokens + drafted  # the pool holds this one request, no more
    if kv_budget_tokens is None:
        config.kv_memory = kv_memory_for_tokens(lm, config, tokens)
    engine = LLMEngine(lm, config)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            stop=list(stop or []))
    start = time.perf_counter()
    engine.add_request(ids, params)
    first: float | None = None
    n = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and first is None:
                first = time.perf_counter()
            n += len(out.new_token_ids)
            sys.stdout.write(out.text)
            sys.stdout.flush()
    end = time.perf_counter()
    sys.stdout.write("\n")
    ttft = (first or end) - start
    rate = (n - 1) / (end - first) if first is not None and n > 1 and end > first else 0.0
    print(f"[{lm.name} on {lm.device}, load {load_s:.2f} s] TTFT {ttft * 1000:.0f} ms, {n} tokens, "
          f"{rate:.1f} tok/s decode", file=sys.stderr)
