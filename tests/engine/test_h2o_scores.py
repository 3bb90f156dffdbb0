"""The H2O scores the engine serves equal attention mass computed directly from the model's own queries and keys."""

from __future__ import annotations

import math

import torch

from hafiza.cache.pool import KVPool, layout_for, make_kv_pool
from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.models import LoadedModel
from hafiza.models.attention import AttentionMetadata, PrefillSpan

BS, CHUNK, PROMPT, GEN = 16, 16, 40, 3
TOL = 1e-4  # relative: fp32 sums of the same probabilities in another order


def _served_scores(lm: LoadedModel, kv_dtype: str) -> tuple[list[int], torch.Tensor]:
    """Tokens the engine computed and the score of each of their blocks, from an h2o engine that never evicts
    (budget above the sequence) but observes every step: prefill chunks of CHUNK tokens, then decodes."""
    engine = LLMEngine(lm, EngineConfig(kv_memory="4MiB", kv_dtype=kv_dtype, block_size=BS,
                                        max_num_batched_tokens=CHUNK, eviction="h2o", kv_budget_tokens=256))
    engine.add_request(list(range(100, 100 + PROMPT)), SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True))
    table: list[int] = []
    tokens: list[int] = []
    while engine.has_unfinished():
        if engine.scheduler.running:
            seq = engine.scheduler.running[0]
            table, tokens = list(engine.cache.blocks(seq.request_id).block_ids), list(seq.token_ids)
        engine.step()
    assert engine.scores is not None and engine.stats().evicted_tokens == 0
    computed = tokens[: PROMPT + GEN - 1]  # the last sampled token is never fed back
    return computed, engine.scores.score(table[: -(-len(computed) // BS)])


def _direct_scores(lm: LoadedModel, ids: list[int], kv_dtype: str) -> torch.Tensor:
    """One forward over `ids` reading K/V back from a `kv_dtype` pool; per layer softmax(q kᵀ/√d) under the causal
    mask, summed over heads and queries per key block, divided by the number of queries in the engine's steps that
    held the block, averaged over layers."""
    model, c = lm.model, lm.config
    n = len(ids)
    pool = make_kv_pool(layout_for(c, -(-n // BS), BS, kv_dtype, torch.float32), "cpu")
    qs: dict[int, torch.Tensor] = {}

    def keep_q(layer: int, q: torch.Tensor, kv: KVPool) -> None:
        qs[layer] = q.detach().clone()

    pos = torch.arange(n)
    table = torch.arange(-(-n // BS))[None]
    meta = AttentionMetadata(slot_mapping=pos, prefills=[PrefillSpan(0, n, n, block_table=table[0])], observer=keep_q)
    model.forward(torch.tensor(ids), pos, meta, pool)
    causal = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
    mass = torch.zeros(n, dtype=torch.float64)
    for layer in range(c.num_layers):
        keys = pool.gather(layer, table)[0][0, :n].double()  # [n, Hkv, d]
        q = qs[layer].double()  # [n, H, d]
        k = keys.repeat_interleave(c.num_heads // c.num_kv_heads, dim=1)
        logits = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(c.head_dim)
        probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        mass += probs.sum(dim=(0, 1))
    step_end = [min(-(-(p + 1) // CHUNK) * CHUNK, PROMPT) if p < PROMPT else p + 1 for p in range(n)]
    blocks = -(-n // BS)
    seen = torch.tensor([sum(e > b * BS for e in step_end) for b in range(blocks)], dtype=torch.float64)
    per_block = torch.zeros(blocks * BS, dtype=torch.float64)
    per_block[:n] = mass
    return (per_block.view(blocks, BS).sum(1) / (seen * c.num_layers)).float()


def test_h2o_scores_equal_attention_mass_computed_directly(tiny_llama: LoadedModel) -> None:
    # fp32 under fp32 compute: the engine's first chunk attends to fresh K/V and must be observed all the same
    for kv_dtype in ("fp32", "bf16"):
        ids, served = _served_scores(tiny_llama, kv_dtype)
        direct = _direct_scores(tiny_llama, ids, kv_dtype)
        tol = TOL
        assert len(served) == 3 and torch.allclose(served, direct, rtol=tol, atol=0), (kv_dtype, served, direct)
        # the comparison tells blocks apart: the same scores in another block order fail it
        assert not torch.allclose(served, direct.flip(0), rtol=tol, atol=0)
        assert not torch.allclose(served, direct[[1, 0, 2]], rtol=tol, atol=0)


def test_observing_attention_leaves_outputs_unchanged(tiny_llama: LoadedModel) -> None:
    params = SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True, prompt_logprobs=0)
    out = []
    for eviction in (None, "h2o"):
        engine = LLMEngine(tiny_llama, EngineConfig(kv_memory="4MiB", block_size=BS, max_num_batched_tokens=CHUNK,
                                                    eviction=eviction, kv_budget_tokens=256 if eviction else None))
        out.append(engine.generate([list(range(100, 100 + PROMPT))], params)[0])
    assert out[0].token_ids == out[1].token_ids and out[0].prompt_logprobs == out[1].prompt_logprobs
