"""The paged forward reproduces transformers' logits (fp32) on prefill and 32 decode steps, and greedy output."""

from __future__ import annotations

import random

import pytest
import torch

from hafiza.bench.peers import transformers_model as hf_reference_from_loaded
from hafiza.cache.formats.full import FullPrecisionKV
from hafiza.cache.kv_cache_manager import KVBlocks
from hafiza.cache.layout import KVLayout
from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.engine.runner import ModelRunner
from hafiza.engine.scheduler import ScheduledBatch
from hafiza.engine.sequence import Sequence
from hafiza.models import LoadedModel, load_model
from tests.support.models import hf_reference

TOL = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def paged_logits(lm: LoadedModel, prompt: list[int], steps: int, block_size: int = 4) -> list[torch.Tensor]:
    """Prefill then `steps` greedy decodes through the runner, with blocks handed out in shuffled order."""
    c = lm.config
    n_blocks = (len(prompt) + steps) // block_size + 2
    layout = KVLayout(c.num_layers, n_blocks + 3, block_size, c.num_kv_heads, c.head_dim, "fp32", torch.float32)
    kv = FullPrecisionKV(layout, lm.device)
    runner = ModelRunner(lm.model, kv, block_size, fresh_kv_exact=True)
    table = list(range(n_blocks + 3))
    random.Random(0).shuffle(table)
    seq = Sequence("t", list(prompt), len(prompt), SamplingParams())
    blocks = KVBlocks(tuple(table[:n_blocks]), tuple(range(n_blocks)))
    out = []
    n = len(prompt)
    for _ in range(steps + 1):
        logits, _ = runner.execute(ScheduledBatch([seq], [n], [blocks]))
        out.append(logits[0])
        seq.num_computed += n
        seq.token_ids.append(int(logits[0].argmax()))
        n = 1
    return out


def hf_logits(model, prompt: list[int], steps: int) -> list[torch.Tensor]:
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(steps + 1):
            logits = model(ids, cache=cache, use_cache=True).logits[0, -1]
            out.append(logits)
            ids = logits.argmax().view(1, 1)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_random_models_match(arch: str, tiny_dirs: dict) -> None:
    lm = load_model(tiny_dirs[arch], dtype="fp32", device="cpu")
    ref = hf_reference(tiny_dirs[arch])
    prompt = lm.tokenizer.encode("A tiny model with random weights still has to agree exactly.")
    mine, theirs = paged_logits(lm, prompt, 32), hf_logits(ref, prompt, 32)
    for step, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        assert rel_err(a, b) < TOL, f"{arch} step {step}: relative error {rel_err(a, b):.2e}"


def test_default_model_logits_match(default_model: LoadedModel) -> None:
    ref = hf_reference_from_loaded(default_model)
    prompt = default_model.tokenizer.encode("The history of the paged KV cache begins with operating systems.")
    mine, theirs = paged_logits(default_model, prompt, 32, block_size=16), hf_logits(ref, prompt, 32)
    for step, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        assert rel_err(a, b) < TOL, f"step {step}: relative error {rel_err(a, b):.2e}"


def test_default_model_greedy_identical_for_64_tokens(default_model: LoadedModel) -> None:
    ref = hf_reference_from_loaded(default_model)
    tok = default_model.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": "Write a haiku about memory."}]),
        "def quicksort(items):\n",
        "In 1905, Albert Einstein published",
    ]
    engine = LLMEngine(default_model, EngineConfig(kv_memory="64MiB", kv_dtype="model"))
    results = engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    for prompt, res in zip(prompts, results, strict=True):
        ids = tok.encode(prompt)
        with torch.no_grad():
            expect = ref.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, min_new_tokens=64)
        assert res.token_ids == expect[0, len(ids) :].tolist(), f"greedy output diverged for {prompt!r}"


def test_batch_of_mixed_lengths_matches_single_runs(tiny_llama: LoadedModel) -> None:
    """Sequences decoded together (different lengths, chunked prefill) give the tokens each gives alone."""
    prompts = [list(range(100, 100 + n)) for n in (3, 17, 40, 64, 9)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = [LLMEngine(tiny_llama, EngineConfig(kv_memory="8MiB", kv_dtype="model")).generate([p], params)[0]
             for p in prompts]
    engine = LLMEngine(tiny_llama, EngineConfig(kv_memory="8MiB", kv_dtype="model", max_num_batched_tokens=32))
    together = engine.generate(prompts, params)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
