"""Penalties, logit bias and min-p: vLLM / OpenAI semantics against a direct reference, and their effect in the
engine; bad values are refused naming the field and the number."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.engine.grammar import GrammarSpec
from hafiza.engine.sampling import apply_penalties, sample
from hafiza.errors import RequestError
from hafiza.models import LoadedModel
from tests.support.examples import examples

V = 24


def reference(logits: list[float], p: SamplingParams, tokens: list[int], num_prompt: int) -> list[float]:
    """The penalties written out token by token."""
    out = []
    output = tokens[num_prompt:]
    for t, x in enumerate(logits):
        if t in tokens:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        count = output.count(t)
        x -= p.frequency_penalty * count + (p.presence_penalty if count else 0.0)
        out.append(x + p.logit_bias.get(t, 0.0))
    return out


@settings(max_examples=examples(2.0), deadline=None)
@given(
    logits=st.lists(st.floats(-20, 20), min_size=V, max_size=V),
    tokens=st.lists(st.integers(0, V - 1), min_size=1, max_size=30),
    split=st.integers(0, 30),
    rep=st.floats(0.1, 5.0), freq=st.floats(-2, 2), pres=st.floats(-2, 2),
    bias=st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100), max_size=4),
)
def test_penalties_match_the_reference(logits: list[float], tokens: list[int], split: int, rep: float, freq: float,
                                       pres: float, bias: dict[int, float]) -> None:
    num_prompt = min(split, len(tokens))
    p = SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres, logit_bias=bias)
    p.validate()
    row = torch.tensor([logits], dtype=torch.float32)
    got = apply_penalties(row, [p], [tokens], [num_prompt])[0]
    want = torch.tensor(reference(logits, p, tokens, num_prompt), dtype=torch.float32)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert torch.equal(row, torch.tensor([logits], dtype=torch.float32)), "the input logits must not change"


def test_rows_without_penalties_are_untouched() -> None:
    logits = torch.randn(2, V)
    params = [SamplingParams(), SamplingParams(logit_bias={3: 5.0})]
    out = apply_penalties(logits, params, [[1, 2], [1, 2]], [1, 1])
    assert torch.equal(out[0], logits[0]) and out[1, 3] == logits[1, 3] + 5.0


def test_min_p_one_keeps_only_the_most_likely() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 100, generator=g)
    params = [SamplingParams(temperature=1.5, min_p=1.0)] * 8
    assert sample(logits, params, [torch.Generator().manual_seed(i) for i in range(8)]) == logits.argmax(-1).tolist()


def test_min_p_drops_unlikely_tokens() -> None:
    logits = torch.tensor([[5.0, 4.9, 0.0, -1.0]])
    seen = {sample(logits, [SamplingParams(min_p=0.5)], [torch.Generator().manual_seed(s)])[0] for s in range(200)}
    assert seen == {0, 1}


@pytest.fixture(scope="module")
def engine(tiny_llama: LoadedModel) -> LLMEngine:
    return LLMEngine(tiny_llama, EngineConfig(kv_memory="8MiB", kv_dtype="model"))


PROMPT = list(range(300, 340))


def test_logit_bias_changes_greedy_output(engine: LLMEngine) -> None:
    base = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    [plain] = engine.generate([PROMPT], base)
    first = plain.token_ids[0]
    [banned] = engine.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                        logit_bias={first: -100.0}))
    assert first not in banned.token_ids
    [forced] = engine.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                        logit_bias={777: 100.0}))
    assert forced.token_ids == [777] * 6


@pytest.mark.slow
def test_penalties_break_a_greedy_loop(default_model: LoadedModel) -> None:
    engine = LLMEngine(default_model, EngineConfig(kv_memory="32MiB"))
    base = dict(max_tokens=16, temperature=0, ignore_eos=True)
    [plain] = engine.generate(["1, 1, 1, 1, 1, 1, 1, 1,"], SamplingParams(**base))
    assert plain.text == " 1, 1, 1, 1, 1, "
    for extra in ({"repetition_penalty": 1.5}, {"frequency_penalty": 1.0}):
        [pen] = engine.generate(["1, 1, 1, 1, 1, 1, 1, 1,"], SamplingParams(**base, **extra))
        assert pen.text != plain.text and len(set(pen.token_ids)) > len(set(plain.token_ids)), extra


def test_grammar_mask_wins_over_logit_bias(engine: LLMEngine) -> None:
    yes = engine.tokenizer.encode("yes", add_special=False)
    params = SamplingParams(max_tokens=10, temperature=0, logit_bias={yes[0]: -100.0},
                            grammar=GrammarSpec("ebnf", 'root ::= "yes"'))
    [r] = engine.generate([PROMPT], params)
    assert r.text == "yes"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"presence_penalty": 2.5}, "presence_penalty must be between -2 and 2, got 2.5"),
    ({"frequency_penalty": -3.0}, "frequency_penalty must be between -2 and 2, got -3.0"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \(0, 100\], got 0.0"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty must be in"),
    ({"min_p": 1.5}, "min_p must be between 0 and 1, got 1.5"),
    ({"logit_bias": {5: 101.0}}, "logit_bias for token 5 must be between -100 and 100, got 101.0"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids >= 0, got -1"),
    ({"logit_bias": {49152: 1.0}}, r"logit_bias token id 49152 is outside the vocabulary \[0, 49152\)"),
    ({"logprobs": 21}, "logprobs must be between 0 and 20, got 21"),
    ({"prompt_logprobs": -1}, "prompt_logprobs must be between 0 and 20, got -1"),
    ({"n": 0}, "n must be between 1 and 128, got 0"),
    ({"n": 200, "max_tokens": 8000}, "n must be between 1 and 128, got 200"),
    ({"n": 100, "max_tokens": 300}, "n=100 choices of a 40-token prompt with max_tokens 300 need"),
])
def test_bad_values_name_the_field_and_number(engine: LLMEngine, kwargs: dict, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        engine.check_request(PROMPT, SamplingParams(**kwargs))
