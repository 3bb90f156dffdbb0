"""Synthetic GGUF models of every supported tensor type load in each --weights mode with the expected formats;
fp32 is exactly gguf's dequantization, the quantized modes stay close to it and generate."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize

from hafiza.cache.pool import layout_for, make_kv_pool
from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.errors import HafizaError
from hafiza.models import LoadedModel, load_model
from hafiza.models.attention import AttentionMetadata, PrefillSpan
from hafiza.models.gguf_file import _unpermute_rows
from hafiza.models.loader import default_model_path
from hafiza.models.weights import DenseLinear
from tests.support.gguf_models import Shape, write_model

SHAPE = Shape(hidden=256, inter=512, layers=2, heads=4, kv_heads=2)
MIXED = {"embed": T.Q8_0, "attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q6_K, "attn_output": T.Q4_K,
         "ffn_gate": T.Q5_0, "ffn_up": T.Q5_K, "ffn_down": T.Q8_0, "output": T.Q6_K}
DENSE = {"embed": T.F16, "attn_q": T.BF16, "attn_k": T.BF16, "attn_v": T.BF16, "attn_output": T.F32,
         "default": T.F16, "output": T.F32}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root, tok = tmp_path_factory.mktemp("gguf"), default_model_path()
    return {
        "mixed": write_model(root / "mixed.gguf", tok, MIXED, SHAPE, tied=False),
        "dense": write_model(root / "dense.gguf", tok, DENSE, SHAPE, tied=False, seed=1),
        "qwen2": write_model(root / "qwen2.gguf", tok, {"default": T.Q4_K, "embed": T.Q6_K}, SHAPE, arch="qwen2",
                             seed=2),
    }


def _gguf_exact(path: Path) -> dict[str, torch.Tensor]:
    """Every 2-D tensor as gguf dequantizes it, q/k rows un-permuted as hafiza expects for llama files."""
    out = {}
    for t in GGUFReader(str(path), "r").tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        if len(shape) != 2:
            continue
        arr = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if t.name.endswith("attn_q.weight"):
            arr = arr[_unpermute_rows(shape[0], SHAPE.heads)]
        elif t.name.endswith("attn_k.weight"):
            arr = arr[_unpermute_rows(shape[0], SHAPE.kv_heads)]
        out[t.name] = torch.from_numpy(arr)
    return out


def test_fp32_is_gguf_dequantize_exactly(files: dict[str, Path]) -> None:
    for kind in ("mixed", "dense"):
        exact = _gguf_exact(files[kind])
        m = load_model(files[kind], device="cpu", weights="fp32").model
        assert set(m.weights.formats()) == {"fp32"}
        assert torch.equal(m.embed.dense(), exact["token_embd.weight"])
        assert torch.equal(m.lm_head.dense(), exact["output.weight"])
        for i, lw in enumerate(m.layers):
            p = f"blk.{i}."
            assert torch.equal(lw.qkv.dense(), torch.cat([exact[p + f"attn_{x}.weight"] for x in "qkv"]))
            assert torch.equal(lw.o.dense(), exact[p + "attn_output.weight"])
            gate_up = torch.cat([exact[p + "ffn_gate.weight"], exact[p + "ffn_up.weight"]])
            assert torch.equal(lw.gate_up.dense(), gate_up)
            assert torch.equal(lw.down.dense(), exact[p + "ffn_down.weight"])


def test_auto_formats_follow_the_file(files: dict[str, Path]) -> None:
    m = load_model(files["mixed"], device="cpu").model
    lw = m.layers[0]
    assert (lw.qkv.kind, lw.o.kind, lw.gate_up.kind, lw.down.kind) == ("int4+int8", "int4", "int8", "int4x2")
    assert m.embed.kind == "gguf-Q8_0" and m.lm_head.kind == "int8"
    d = load_model(files["dense"], device="cpu").model
    assert (d.layers[0].qkv.kind, d.layers[0].o.kind, d.layers[0].down.kind, d.lm_head.kind) == \
        ("bf16", "fp32", "fp16", "fp32")
    assert isinstance(d.lm_head, DenseLinear) and d.embed.kind == "fp16"


@pytest.mark.parametrize("mode", ["auto", "q4", "q8", "bf16"])
def test_quantized_modes_stay_close_to_fp32_and_generate(files: dict[str, Path], mode: str) -> None:
    ref = load_model(files["mixed"], device="cpu", weights="fp32")
    lm = load_model(files["mixed"], device="cpu", weights=mode)
    assert lm.fingerprint != ref.fingerprint  # K/V computed with other weights never share cache entries
    ids = lm.tokenizer.encode("Quantized weights answer nearly as the exact ones do.")
    logits = []
    for m in (ref, lm):
        engine = LLMEngine(m, EngineConfig(kv_memory="8MiB", kv_dtype="fp32", enable_prefix_caching=False))
        out = engine.generate([ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
        assert len(out.token_ids) == 4
        hidden = m.model.embed(torch.tensor(ids))
        logits.append(m.model.logits(hidden))
    assert lm.weights == mode
    err = float((logits[1] - logits[0]).abs().max() / logits[0].abs().max())
    assert err < {"auto": 0.02, "q8": 0.02, "bf16": 0.01, "q4": 0.15}[mode], f"{mode}: relative error {err:.3f}"


def test_qwen2_with_biases_loads_quantized(files: dict[str, Path]) -> None:
    lm = load_model(files["qwen2"], device="cpu")
    assert lm.config.arch == "qwen2" and lm.config.tie_word_embeddings
    assert lm.model.layers[0].qkv_bias is not None and lm.model.layers[0].qkv.kind == "int4"
    assert lm.model.lm_head.kind == "int8"  # tied to a Q6_K embedding
    engine = LLMEngine(lm, EngineConfig(kv_memory="8MiB"))
    assert len(engine.generate(["hello"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
               .token_ids) == 3


def test_unknown_weights_mode_is_one_line_error(files: dict[str, Path]) -> None:
    with pytest.raises(HafizaError, match="unknown weight format 'int3'"):
        load_model(files["mixed"], device="cpu", weights="int3")


def _prompt_logits(lm: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Logits of every prompt position, one prefill through an fp32 pool."""
    n, model = len(ids), lm.model
    pool = make_kv_pool(layout_for(model.config, n // 16 + 2, 16, "fp32", torch.float32), "cpu")
    meta = AttentionMetadata(slot_mapping=torch.arange(n), prefills=[PrefillSpan(0, n, n)])
    with torch.inference_mode():
        return model.logits(model.forward(torch.tensor(ids), torch.arange(n), meta, pool))


def test_default_model_default_weights_names_paris_close_to_fp32() -> None:
    """The default model as `make serve` loads it (int4 layers, Q8_0 head as two exact int4 planes, top logits
    refined in fp32) answers the chat question greedily as the exact fp32 model does. The fp32 reference ranks
    "The" over "L" by only 0.08 there, so the head's logits must be near fp32, not bf16 (spacing 0.125)."""
    ref, lm = load_model(device="cpu", weights="fp32"), load_model(device="cpu")
    assert lm.weights == "auto" and lm.model.layers[0].qkv.kind == "int4" and lm.model.lm_head.kind == "int4x2"
    tok = lm.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    engine = LLMEngine(lm, EngineConfig(kv_memory="32MiB"))
    text = engine.generate([ids], SamplingParams(max_tokens=12, temperature=0))[0].text
    assert "Paris" in text, text
    exact, got = _prompt_logits(ref, ids), _prompt_logits(lm, ids)
    err = (got - exact).abs()  # measured: 0.33 at the answer's position, rms 0.17, 1.47 at worst (the template)
    assert float(err[-1].max()) < 0.5 and float(err.pow(2).mean().sqrt()) < 0.25 and float(err.max()) < 2.0
