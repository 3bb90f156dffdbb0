"""The model runner's batch layout: a short verification runs its rows as decodes at their own positions, with
the bits a span gives them (tokens and logprobs equal either way), and longer ones stay spans."""

from __future__ import annotations

import pytest

from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.engine import runner as runner_module
from hafiza.engine.speculative import SpeculativeConfig
from hafiza.models import LoadedModel

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
PARAMS = SamplingParams(max_tokens=24, temperature=0, logprobs=2)


def run(model: LoadedModel, monkeypatch: pytest.MonkeyPatch, as_decodes: int
        ) -> tuple[list[tuple[list[int], list]], list[tuple[int, int, int]]]:
    """Greedy outputs of three requests and, per step, (sequences, decode rows, rows)."""
    monkeypatch.setattr(runner_module, "VERIFY_AS_DECODES", as_decodes)
    eng = LLMEngine(model, EngineConfig(kv_memory="32MiB", speculative=SPEC))
    steps: list[tuple[int, int, int]] = []
    build = eng.runner.build

    def recording(batch):  # type: ignore[no-untyped-def]
        out = build(batch)
        steps.append((len(batch.seqs), out[2].num_decode, len(out[0])))
        return out

    monkeypatch.setattr(eng.runner, "build", recording)
    tok = model.tokenizer
    prompts = [tok.encode("one two three four five, one two three four five, one two three", add_special=False),
               tok.encode("a b c d a b c d a b c d a b", add_special=False),
               tok.encode("The capital of France is", add_special=False)]
    outs = eng.generate(prompts, PARAMS)
    eng.check_integrity()
    return [(o.token_ids, o.logprobs) for o in outs], steps


def test_short_verifications_run_as_decode_rows_with_a_spans_bits(served_model: LoadedModel,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    as_spans, span_steps = run(served_model, monkeypatch, 0)
    as_rows, row_steps = run(served_model, monkeypatch, 3)
    assert as_rows == as_spans
    assert all(rows_dec <= seqs for seqs, rows_dec, _ in span_steps)  # a span never counts as decode rows
    assert any(rows_dec > seqs for seqs, rows_dec, _ in row_steps)  # some verification ran as decode rows
    assert all(decode_rows <= rows for _, decode_rows, rows in row_steps)
