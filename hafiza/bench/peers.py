"""Peers measured in the same run: transformers on exactly the weights hafiza loaded."""

from __future__ import annotations

from typing import Any

import torch

from hafiza.models import LoadedModel


def transformers_model(loaded: LoadedModel, dtype: torch.dtype | None = None) -> Any:
    """A transformers CausalLM holding hafiza's dequantized weights (GGUF or safetensors), in `dtype`.

    Built from the same tensors rather than transformers' own GGUF path, which keeps weights packed and runs
    ~50x slower; so both engines compute with identical numbers.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = dtype or loaded.dtype
    cfg = loaded.config
    hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.to_hf().items() if k != "architectures"})
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()
    state = _state_dict(loaded)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model.to(loaded.device)


def _state_dict(loaded: LoadedModel) -> dict[str, torch.Tensor]:
    """Hugging Face-named tensors of the loaded model, re-split from hafiza's fused q/k/v and gate/up."""
    m, c = loaded.model, loaded.config
    out = {"model.embed_tokens.weight": m.embed.dense(), "model.norm.weight": m.norm}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = m.lm_head.dense()
    q, kv = m.q_size, m.kv_size
    for i, lw in enumerate(m.layers):
        p = f"model.layers.{i}."
        wq, wk, wv = lw.qkv.dense().split([q, kv, kv])
        out |= {p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk,
                p + "self_attn.v_proj.weight": wv, p + "self_attn.o_proj.weight": lw.o.dense(),
                p + "input_layernorm.weight": lw.input_norm, p + "post_attention_layernorm.weight": lw.post_norm,
                p + "mlp.down_proj.weight": lw.down.dense()}
        gate, up = lw.gate_up.dense().chunk(2)
        out |= {p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up}
        if lw.qkv_bias is not None:
            bq, bk, bv = lw.qkv_bias.split([q, kv, kv])
            out |= {p + "self_attn.q_proj.bias": bq, p + "self_attn.k_proj.bias": bk, p + "self_attn.v_proj.bias": bv}
    return {k: v.detach().clone() for k, v in out.items()}
