"""Real KV of the default model: every coder round-trips it, the speculative predictor is reproduced at
decode, and a decoder that cannot reproduce it (other tokens, parameters or outputs) fails loudly."""

from __future__ import annotations

import pytest
import torch

from hafiza.codec import (
    CodecContext,
    ContextError,
    PredictionMismatchError,
    decode,
    encode,
)
from hafiza.codec.predictors.speculative import SpeculativePredictor
from hafiza.models import LoadedModel
from hafiza.models.capture import compute_kv
from tests.codec.helpers import CODER_CASES, same_bits

TEXT = (
    "The cache keeps every token's keys and values so that generation never recomputes the past. "
    "def lookup(table, key):\n    return table.get(key, None)\n"
    "Bellek, modelin geçmişi yeniden hesaplamadan hatırlamasını sağlar. "
) * 3


@pytest.fixture(scope="module")
def kv(default_model: LoadedModel) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    ids = default_model.tokenizer.encode(TEXT)[:160]
    k, v = compute_kv(default_model.model, ids, kv_dtype=torch.bfloat16)
    return ids, k, v


@pytest.mark.parametrize(("coder", "predictor"), CODER_CASES)
def test_real_kv_roundtrips(kv: tuple, coder: str, predictor: str | None) -> None:
    _, k, v = kv
    for x in (k, v):
        ctx = CodecContext(coder=coder, predictor=predictor, chunk_tokens=64)
        assert same_bits(decode(encode(x, ctx), ctx), x)


@pytest.mark.parametrize("coder", ["planes", "fast"])
def test_hot_tier_coders_store_real_kv_in_fewer_bytes_than_zstd(kv: tuple, coder: str) -> None:
    """A hot-tier coder must pay for itself in size: below the byte-shuffle zstd coder on real bf16 KV,
    also in the store's block layout ([16 tokens, layers x K/V x channels], one chunk)."""
    _, k, v = kv
    for x in (k, v, torch.stack([k, v], 1)[:, :, :16].permute(2, 0, 1, 3, 4).reshape(16, -1)):
        coded = encode(x, CodecContext(coder=coder))
        assert len(coded) < len(encode(x, CodecContext(coder="zstd")))
        assert same_bits(decode(coded), x)


def test_fast_stores_real_kv_in_fewer_bytes_than_planes(kv: tuple) -> None:
    """The fast coder codes sign and exponent as one symbol, so it must not cost more than planes' layout."""
    _, k, v = kv
    fast = sum(len(encode(x, CodecContext(coder="fast"))) for x in (k, v))
    assert fast < sum(len(encode(x, CodecContext(coder="planes"))) for x in (k, v))


@pytest.mark.parametrize(("variant", "exact"), [("bf16-mixed", 0), ("bf16", 2), ("int8", 0)])
def test_speculative_roundtrip_with_a_fresh_decoder(default_model: LoadedModel, kv: tuple, variant: str,
                                                     exact: int) -> None:
    ids, k, v = kv
    # One run predicts both K and V (a predictor memoises its last tokens), so the encoder's predictor serves both
    # roles, and so does the decoder's: a separate instance that reruns the model from the tokens alone.
    encoder = SpeculativePredictor(default_model, variant, exact)
    decoder = SpeculativePredictor(default_model, variant, exact)
    for role, x in (("k", k), ("v", v)):
        data = encode(x, CodecContext(coder="predictive", token_ids=ids, role=role, chunk_tokens=64,
                                      predictor=encoder))
        assert same_bits(decode(data, CodecContext(token_ids=ids, role=role, predictor=decoder)), x)
        assert len(data) * 8 / x.numel() < 10.0


def test_exact_layers_reproduce_the_target(default_model: LoadedModel, kv: tuple) -> None:
    ids, k, v = kv
    pk, pv = SpeculativePredictor(default_model, "bf16", exact_layers=3).predict(ids)
    assert torch.equal(pk[:3].to(torch.bfloat16).view(torch.int16), k[:3].view(torch.int16))
    assert torch.equal(pv[:3].to(torch.bfloat16).view(torch.int16), v[:3].view(torch.int16))


def test_decoder_with_other_tokens_or_parameters_is_refused(default_model: LoadedModel, kv: tuple) -> None:
    ids, k, _ = kv
    ctx = CodecContext(coder="predictive", token_ids=ids, role="k",
                       predictor=SpeculativePredictor(default_model, "bf16-mixed"))
    data = encode(k, ctx)
    with pytest.raises(ContextError):
        decode(data, CodecContext(token_ids=[*ids[:-1], ids[-1] + 1], role="k", predictor=ctx.predictor))
    with pytest.raises(ContextError):
        decode(data, CodecContext(token_ids=ids, role="v", predictor=ctx.predictor))
    with pytest.raises(ContextError):
        decode(data, CodecContext(token_ids=ids, role="k", predictor=SpeculativePredictor(default_model, "int8")))
    with pytest.raises(ContextError):
        decode(data, CodecContext(role="k", predictor=ctx.predictor))


class _Drifting(SpeculativePredictor):
    """Same parameters and fingerprint, but its run differs by one step in one value, as another machine's
    arithmetic might: the decoder must notice and refuse rather than return wrong KV."""

    def predict(self, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = super().predict(token_ids)
        k = k.clone()
        k[5, 70, 1, 3] = torch.nextafter(k[5, 70, 1, 3].to(torch.bfloat16).float() * 1.01, k.new_tensor(1e9))
        return k, v


def test_unreproducible_prediction_raises_prediction_mismatch(default_model: LoadedModel, kv: tuple) -> None:
    ids, k, _ = kv
    ctx = CodecContext(coder="predictive", token_ids=ids, role="k", chunk_tokens=64,
                       predictor=SpeculativePredictor(default_model, "bf16-mixed"))
    data = encode(k, ctx)
    with pytest.raises(PredictionMismatchError):
        decode(data, CodecContext(token_ids=ids, role="k", predictor=_Drifting(default_model, "bf16-mixed")))
