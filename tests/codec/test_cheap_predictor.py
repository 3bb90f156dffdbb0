"""The speculative codec's cheaper model: one chunked pass gives every block the same prediction whatever the
pass's length or chunk size (so a loader of n blocks reproduces an encoder that saw more), for every weight
format; its exact layers equal the target's own K/V; a truncated model predicts zeros for the layers it skips."""

from __future__ import annotations

import pytest
import torch

from hafiza.codec.predictors.cheap import WEIGHT_FORMATS, CheapSpec, PrefixRun, build_cheap_model, cheap_kv
from hafiza.models import LoadedModel
from hafiza.models.capture import compute_kv

BS = 16
BLOCKS = 40


def prompt(model: LoadedModel, n: int) -> list[int]:
    ids = model.tokenizer.encode("The memory of a transformer is its KV cache, block after block. " * 80)
    assert len(ids) >= n
    return ids[:n]


@pytest.mark.parametrize(("weights", "dtype"), [(w, "fp32") for w in WEIGHT_FORMATS] + [("int4", "bf16"),
                                                                                          ("int8", "bf16")])
def test_block_prediction_is_the_same_for_any_pass_length_and_chunk(tiny_llama: LoadedModel, weights: str,
                                                                   dtype: str) -> None:
    model = build_cheap_model(tiny_llama.model, CheapSpec(weights, dtype))
    layers = len(tiny_llama.model.layers)
    ids = prompt(tiny_llama, BLOCKS * BS)
    long_k, long_v = cheap_kv(model, layers, ids, torch.bfloat16, chunk=256)
    for i, chunk in ((0, 256), (7, 16), (19, 48), (39, 100)):
        k, v = cheap_kv(model, layers, ids[: (i + 1) * BS], torch.bfloat16, chunk=chunk)
        block = slice(i * BS, (i + 1) * BS)
        assert torch.equal(k[:, block], long_k[:, block]) and torch.equal(v[:, block], long_v[:, block]), (i, chunk)
    # a run extended in pieces (a saved prompt, block after block) gives the one-pass values too
    run = PrefixRun(model, layers, torch.bfloat16)
    for a in range(0, 10 * BS, BS):
        run.extend(ids[a : a + BS])
    k, v = run.kv(0, 10 * BS)
    assert torch.equal(k, long_k[:, : 10 * BS]) and torch.equal(v, long_v[:, : 10 * BS])


def test_exact_layers_equal_the_targets_kv_and_truncated_layers_are_zeros(tiny_llama: LoadedModel) -> None:
    target = tiny_llama.model
    ids = prompt(tiny_llama, 5 * BS)
    ref_k, ref_v = compute_kv(target, ids, torch.bfloat16, chunk=BS)
    exact = build_cheap_model(target, CheapSpec("int4", "fp32", exact_layers=1))
    k, v = cheap_kv(exact, 2, ids, torch.bfloat16)
    assert torch.equal(k[0], ref_k[0]) and torch.equal(v[0], ref_v[0])
    assert not torch.equal(k[1], ref_k[1])  # the int4 layer only predicts
    top = build_cheap_model(target, CheapSpec("same", "fp32", layers=1))
    k, v = cheap_kv(top, 2, ids, torch.bfloat16)
    assert torch.equal(k[0], ref_k[0]) and not k[1].any() and not v[1].any()


def test_bad_specs_are_refused(tiny_llama: LoadedModel) -> None:
    with pytest.raises(ValueError, match="weight format"):
        build_cheap_model(tiny_llama.model, CheapSpec("int3"))
    with pytest.raises(ValueError, match="compute dtype"):
        build_cheap_model(tiny_llama.model, CheapSpec("int8", "fp16"))
    with pytest.raises(ValueError, match="exact layers need"):
        build_cheap_model(tiny_llama.model, CheapSpec("int8", "bf16", exact_layers=1))


def test_store_predictor_runs_a_hinted_prompt_in_one_pass_and_shares_runs(tiny_llama: LoadedModel) -> None:
    from hafiza.store.speculative import BlockwiseKV

    ids = prompt(tiny_llama, 12 * BS)
    runs: list[int] = []
    kv = BlockwiseKV(tiny_llama.model, BS, CheapSpec("int8", "fp32"), on_run=lambda n, s: runs.append(n))
    for i in range(12):
        kv.hint(ids[: (i + 1) * BS])
    saved = [kv.blocks(ids[: (i + 1) * BS], i, 1)[0] for i in range(12)]
    assert runs == [12 * BS]  # the first block's encode ran the whole hinted prompt; the rest were cached
    fresh = BlockwiseKV(tiny_llama.model, BS, CheapSpec("int8", "fp32"))
    loaded = fresh.blocks(ids, 0, 12)
    assert all(torch.equal(a, b) for a, b in zip(saved, loaded, strict=True))
    assert fresh.blocks(ids[: 3 * BS], 2, 1)[0].equal(saved[2]) and fresh.thread_seconds() > 0
