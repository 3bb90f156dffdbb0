"""Speculative decoding changes no output bit (default model, bf16 pool): tokens, logprobs, finish reasons and text
equal plain decoding's for prompts that repeat text (drafts accepted) and prompts that do not, batched with others,
chunk-prefilled, cold and warm, preempted, with n > 1, penalties, seeded sampling, stop strings and max_tokens;
rollback leaves the engine's integrity intact and no block of a rejected token is ever found by a later request."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.engine.results import GenerationResult
from hafiza.engine.speculative import SpeculativeConfig
from hafiza.models import LoadedModel

pytestmark = pytest.mark.slow  # long generations with the real model

TEXTS = Path(__file__).resolve().parents[3] / "bench" / "texts"
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
CODE = "def area(r):\n    return 3.14159 * r * r\n\n\ndef volume(r, h):\n    return area(r) * h\n"
BASE = SamplingParams(max_tokens=24, temperature=0, logprobs=2)


def engine(model: LoadedModel, speculative: bool = True, **opts: object) -> LLMEngine:
    config = {"kv_memory": "64MiB", "max_num_seqs": 16, "speculative": SPEC if speculative else None, **opts}
    return LLMEngine(model, EngineConfig(**config))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def prompts(default_model: LoadedModel) -> list[list[int]]:
    """Chat prompts asking to echo code and JSON, raw text that repeats itself, and held-in text that does not."""
    tok = default_model.tokenizer

    def chat(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special=False)

    prose = tok.encode((TEXTS / "en_declaration_gettysburg.txt").read_text(), add_special=False)
    return [
        chat(f"Repeat this code exactly:\n```python\n{CODE}```"),
        chat('Echo this JSON with "b" set to 3: {"a": 1, "b": 2, "c": [1, 2, 3], "d": {"e": "f"}}'),
        tok.encode("one two three four five, one two three four five, one two three", add_special=False),
        chat("List three colors of the rainbow."),
        prose[:60],
        prose[200:237],
    ]


def mixed(n: int) -> list[SamplingParams]:
    """Greedy with logprobs, with penalties and bias, and seeded sampling, cycled over n prompts."""
    kinds = [BASE, replace(BASE, repetition_penalty=1.3), replace(BASE, frequency_penalty=0.5, logit_bias={11: 2.0}),
             replace(BASE, temperature=0.8, seed=17, top_k=40)]
    return [kinds[i % len(kinds)] for i in range(n)]


def key(results: list[GenerationResult]) -> list[tuple]:
    return [(r.token_ids, r.logprobs, r.finish_reason, r.text, r.index) for r in results]


@pytest.fixture(scope="module")
def plain(default_model: LoadedModel, prompts: list[list[int]]) -> list[tuple]:
    """Each prompt alone, plain decoding, nothing cached: the reference."""
    eng = engine(default_model, speculative=False, enable_prefix_caching=False)
    return [key(eng.generate([p], [params]))[0] for p, params in zip(prompts, mixed(len(prompts)), strict=True)]


def assert_drafts_were_checked(eng: LLMEngine) -> None:
    """Some drafts were accepted and some rejected, so both paths ran."""
    spec = eng.stats().spec
    assert spec is not None
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens, spec


def test_batched_cold(default_model: LoadedModel, prompts: list[list[int]], plain: list[tuple]) -> None:
    eng = engine(default_model)
    assert key(eng.generate(prompts, mixed(len(prompts)))) == plain
    eng.check_integrity()
    assert_drafts_were_checked(eng)


def test_chunked_prefill_cold_then_warm(default_model: LoadedModel, prompts: list[list[int]],
                                        plain: list[tuple]) -> None:
    """21 tokens per step: prompts are prefilled in chunks and drafts compete for the step's rows."""
    eng = engine(default_model, max_num_batched_tokens=21)
    for run in ("cold", "warm"):
        results = eng.generate(prompts, mixed(len(prompts)))
        assert key(results) == plain, run
        eng.check_integrity()
    assert all(r.num_cached_tokens == (len(p) - 1) // 16 * 16 for r, p in zip(results, prompts, strict=True))
    assert_drafts_were_checked(eng)


def test_preempted_and_resumed(default_model: LoadedModel, prompts: list[list[int]], plain: list[tuple]) -> None:
    probe = engine(default_model)
    most = max(-(-(len(p) + BASE.max_tokens) // 16) for p in prompts)
    eng = engine(default_model, kv_memory=probe.bytes_per_block * (most + 3))
    assert key(eng.generate(prompts, mixed(len(prompts)))) == plain
    eng.check_integrity()
    assert eng.stats().num_preemptions > 0


def test_n_choices(default_model: LoadedModel, prompts: list[list[int]]) -> None:
    """n = 3 seeded choices and n = 2 greedy ones of a repeating prompt, as plain decoding gives them."""
    params = [replace(BASE, n=3, temperature=0.7, seed=5), replace(BASE, n=2)]
    batch = [prompts[0], prompts[2]]
    reference = key(engine(default_model, speculative=False).generate(batch, params))
    eng = engine(default_model)
    assert key(eng.generate(batch, params)) == reference
    eng.check_integrity()
    assert eng.stats().spec.num_accepted_tokens > 0  # type: ignore[union-attr]


def test_stop_strings_and_max_tokens_cut_runs(default_model: LoadedModel, prompts: list[list[int]],
                                             plain: list[tuple]) -> None:
    """Stops at many places of a mostly accepted output: the text and tokens end where plain decoding's do, and
    the tokens drafted past a stop are neither returned nor counted."""
    text = plain[0][3]
    stops = [text[i : i + 3] for i in range(4, 40, 5) if text[i : i + 3].strip()]
    params = [replace(BASE, stop=[s]) for s in stops] + [replace(BASE, max_tokens=m) for m in range(2, 14, 3)]
    batch = [prompts[0]] * len(params)
    reference = engine(default_model, speculative=False).generate(batch, params)
    assert any(r.finish_reason == "stop_sequence" for r in reference)
    eng = engine(default_model)
    before = eng.output.generation_tokens
    results = eng.generate(batch, params)
    assert key(results) == key(reference)
    assert eng.output.generation_tokens - before == sum(len(r.token_ids) for r in reference)
    eng.check_integrity()
    assert eng.stats().spec.num_accepted_tokens > 0  # type: ignore[union-attr]


def test_rejected_tokens_are_never_cached(default_model: LoadedModel, prompts: list[list[int]]) -> None:
    """4-token blocks, so rejected drafts fill whole blocks. A later prompt equal to what a sequence held plus a
    draft that was (partly) rejected finds only the accepted prefix's blocks, and is answered as on a cold engine."""
    eng = engine(default_model, block_size=4)
    proposer = eng.proposer
    assert proposer is not None
    drafts: list[tuple[list[int], list[int]]] = []
    original = proposer.propose

    def record(tokens: list[int], limit: int) -> list[int]:
        draft = original(tokens, limit)
        drafts.append((list(tokens), list(draft)))
        return draft

    proposer.propose = record  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    [result] = eng.generate([prompts[0]], params)
    eng.check_integrity()
    full = prompts[0] + result.token_ids

    def agreed(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

    rejected = [ctx + d for ctx, d in drafts if d and agreed(full[len(ctx) :], d) < len(d)]
    assert rejected, "no draft was rejected"
    probes = sorted(rejected, key=lambda p: len(p) - agreed(full, p), reverse=True)[:3]
    cold = engine(default_model, speculative=False, block_size=4, enable_prefix_caching=False)
    check = SamplingParams(max_tokens=4, temperature=0, logprobs=1)
    for probe in probes:
        [later] = eng.generate([probe], check)
        assert later.num_cached_tokens <= agreed(full, probe) // 4 * 4
        assert key([later]) == key(cold.generate([probe], check))
        eng.check_integrity()


def test_opted_out_request_drafts_nothing(default_model: LoadedModel, prompts: list[list[int]],
                                          plain: list[tuple]) -> None:
    eng = engine(default_model)
    params = replace(mixed(1)[0], speculative=False)
    assert key(eng.generate([prompts[0]], [params])) == [plain[0]]
    assert eng.stats().spec.num_drafts == 0  # type: ignore[union-attr]


def test_grammar_checked_drafts(default_model: LoadedModel, prompts: list[list[int]]) -> None:
    """A JSON echo under a json_object grammar: drafts pass through the grammar's mask row by row and the output is
    plain decoding's."""
    from hafiza.engine.grammar import GrammarSpec

    params = replace(BASE, max_tokens=60, grammar=GrammarSpec("json_object"))
    reference = key(engine(default_model, speculative=False).generate([prompts[1]], [params]))
    eng = engine(default_model)
    assert key(eng.generate([prompts[1]], [params])) == reference
    eng.check_integrity()
    assert eng.stats().spec.num_accepted_tokens > 0  # type: ignore[union-attr]
