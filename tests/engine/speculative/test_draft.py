"""Draft-model speculation changes no output bit: with the default model as its own draft every token is accepted,
with a random-weight draft of the same tokenizer most are rejected, and either way tokens and logprobs equal plain
greedy decoding's, batched and chunk-prefilled, with the block manager intact and no rejected token cached. A draft
of another vocabulary is refused by name."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest

from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.engine.results import GenerationResult
from hafiza.engine.speculative import SpeculativeConfig
from hafiza.engine.speculative.draft import DraftModelProposer
from hafiza.errors import ConfigError
from hafiza.models import LoadedModel

pytestmark = pytest.mark.slow  # generations with the real model

SPEC = SpeculativeConfig(method="draft", num_speculative_tokens=4, speculative_model="draft")
GREEDY = SamplingParams(max_tokens=16, temperature=0, logprobs=2)


def engine(model: LoadedModel, draft: LoadedModel | None, **opts: object) -> LLMEngine:
    config = {"kv_memory": "64MiB", "max_num_seqs": 8, "speculative": SPEC if draft is not None else None,
              "draft_model": draft, **opts}
    return LLMEngine(model, EngineConfig(**config))  # type: ignore[arg-type]


def key(results: list[GenerationResult]) -> list[tuple]:
    return [(r.token_ids, r.logprobs, r.finish_reason, r.text) for r in results]


@pytest.fixture(scope="module")
def prompts(default_model: LoadedModel) -> list[list[int]]:
    tok = default_model.tokenizer

    def chat(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special=False)

    return [chat("What is the capital of France?"), chat("List three colors of the rainbow."),
            tok.encode("one two three four five, one two three", add_special=False)]


@pytest.fixture(scope="module")
def plain(default_model: LoadedModel, prompts: list[list[int]]) -> list[tuple]:
    return key(engine(default_model, None).generate(prompts, GREEDY))


@pytest.mark.parametrize("opts", [{}, {"max_num_batched_tokens": 21}], ids=["batched", "chunked"])
def test_self_draft_accepts_everything(default_model: LoadedModel, prompts: list[list[int]], plain: list[tuple],
                                       opts: dict[str, int]) -> None:
    eng = engine(default_model, default_model, **opts)
    assert key(eng.generate(prompts, GREEDY)) == plain
    eng.check_integrity()
    spec = eng.stats().spec
    assert spec is not None and spec.num_draft_tokens > 0
    assert spec.acceptance_rate == 1.0
    assert eng.drafter is not None and not eng.drafter.states  # finished requests dropped their draft caches


def test_random_draft_is_rejected_but_exact(default_model: LoadedModel, tiny_llama: LoadedModel,
                                            prompts: list[list[int]], plain: list[tuple]) -> None:
    """4-token blocks so rejected drafts fill whole blocks; a later prompt equal to a sequence's tokens plus a
    rejected draft finds only the accepted prefix's blocks and is answered as on a cold engine."""
    eng = engine(default_model, tiny_llama, block_size=4)
    drafter = eng.drafter
    assert drafter is not None
    drafts: list[tuple[list[int], list[int]]] = []
    original = drafter.propose

    def spy(tokens: list[int], limit: int, request_id: str = "", hashes: Sequence[str] = ()) -> list[int]:
        out = original(tokens, limit, request_id, hashes)
        drafts.append((list(tokens), out))
        return out

    drafter.propose = spy  # type: ignore[method-assign]
    assert key(eng.generate(prompts, GREEDY)) == plain
    eng.check_integrity()
    spec = eng.stats().spec
    assert spec is not None and spec.num_draft_tokens > 0
    assert spec.acceptance_rate < 0.5
    outputs = {tuple(p): r.token_ids for p, r in zip(prompts, eng.generate(prompts, GREEDY), strict=True)}
    probes: list[tuple[list[int], int]] = []  # (tokens + rejected draft, tokens known when it was drafted)
    for tokens, draft in drafts:
        for prompt, out in outputs.items():
            full = list(prompt) + out
            if draft and len(full) > len(tokens) and full[: len(tokens)] == tokens and full[len(tokens)] != draft[0]:
                probes.append((tokens + draft, len(tokens)))
                break
        if len(probes) == 2:
            break
    assert probes
    params = replace(GREEDY, max_tokens=4)
    cold = key(engine(default_model, None, block_size=4).generate([p for p, _ in probes], params))
    for (probe, known), want in zip(probes, cold, strict=True):
        result = eng.generate([probe], params)[0]
        assert key([result]) == [want]
        assert result.num_cached_tokens <= known // 4 * 4
    eng.check_integrity()


def test_draft_of_another_vocabulary_is_refused(default_model: LoadedModel, tiny_llama: LoadedModel) -> None:
    other = replace(tiny_llama, config=replace(tiny_llama.config, vocab_size=tiny_llama.config.vocab_size + 1))
    with pytest.raises(ConfigError, match=r"vocabulary.*\d+ logits.*\d+ logits") as info:
        engine(default_model, other)
    assert info.value.setting == "speculative_model"


def test_draft_method_needs_the_loaded_model(default_model: LoadedModel) -> None:
    with pytest.raises(ConfigError) as info:
        LLMEngine(default_model, EngineConfig(kv_memory="16MiB", speculative=SPEC))
    assert info.value.setting == "speculative_model"


def test_full_draft_pool_drafts_nothing(tiny_llama: LoadedModel) -> None:
    """A request that does not fit the draft's pool gets no draft instead of failing; its blocks go back."""
    drafter = DraftModelProposer(tiny_llama, tokens=32, block_size=16)
    assert drafter.blocks.num_blocks == 2
    assert drafter.propose(list(range(40)), 4, "a") == []
    assert not drafter.states and drafter.blocks.num_allocatable() == 2
    first = drafter.propose(list(range(10)), 4, "b")
    assert len(first) == 4
    assert drafter.propose([*range(10), first[0]], 3, "b") == first[1:]  # incremental: same greedy run
    drafter.check_integrity()
    drafter.release("b")
    assert drafter.blocks.num_allocatable() == 2
    drafter.check_integrity()


def test_short_pool_releases_the_least_recent_request(tiny_llama: LoadedModel) -> None:
    drafter = DraftModelProposer(tiny_llama, tokens=32, block_size=16)
    assert len(drafter.propose(list(range(12)), 4, "old")) == 4
    assert len(drafter.propose(list(range(50, 62)), 4, "new")) == 4
    assert set(drafter.states) == {"old", "new"}
    assert len(drafter.propose(list(range(100, 120)), 4, "big")) == 4  # two blocks: both others give theirs up
    assert set(drafter.states) == {"big"}
    drafter.check_integrity()


def test_a_shared_prefix_starts_from_the_drafts_cache(tiny_llama: LoadedModel) -> None:
    """Two requests on one 40-token prefix: the second finds the first's two full blocks (registered under the
    hashes given) and drafts what a cold drafter drafts."""
    from hafiza.cache.hashing import chain_hashes

    prefix = [(7 * i) % 300 for i in range(40)]
    a, b = [*prefix, 1, 2, 3], [*prefix, 4, 5]
    warm = DraftModelProposer(tiny_llama, block_size=16)
    warm.propose(a, 4, "a", chain_hashes(a, 16))
    warm.release("a")
    hits = warm.blocks.prefix_cache_hits
    got = warm.propose(b, 4, "b", chain_hashes(b, 16))
    assert warm.blocks.prefix_cache_hits - hits == 32
    assert warm.states["b"].cached == 2
    warm.check_integrity()
    cold = DraftModelProposer(tiny_llama, block_size=16)
    assert got == cold.propose(b, 4, "b")
