"""Read a GGUF file: metadata to ModelConfig, tensors dequantized once to Hugging Face names and layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from hafiza.errors import ModelLoadError
from hafiza.models.config import ModelConfig

GGUF_ARCHES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def open_gguf(path: Path) -> GGUFReader:
    """Open and parse the header; any malformed or truncated file becomes one ModelLoadError line."""
    try:
        return GGUFReader(str(path), "r")
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors...
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def gguf_fields(reader: GGUFReader) -> dict[str, Any]:
    """All metadata key/values as plain Python values."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:  # a field the reader cannot decode is simply not offered
            continue
    return out


def config_from_gguf(fields: dict[str, Any], path: Path) -> ModelConfig:
    """Translate llama.cpp metadata keys to a ModelConfig."""
    arch_key = fields.get("general.architecture")
    if arch_key not in GGUF_ARCHES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch_key!r}: hafiza runs llama, mistral and qwen2 GGUF files"
        )

    def get(name: str, default: Any = None) -> Any:
        return fields.get(f"{arch_key}.{name}", default)

    try:
        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        kv_heads = get("attention.head_count_kv", heads)
        tokens = fields.get("tokenizer.ggml.tokens") or []
        scaling = None
        if get("rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        eos = fields.get("tokenizer.ggml.eos_token_id")
        return ModelConfig(
            arch=GGUF_ARCHES[arch_key],
            vocab_size=int(get("vocab_size", len(tokens))),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=int(get("attention.key_length", hidden // heads)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(get("context_length", 2048)),
            attention_bias=arch_key == "qwen2",
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[int(eos)] if eos is not None else [],
            name=str(fields.get("general.name", path.stem)),
        )
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: GGUF metadata incomplete or malformed ({exc})") from exc


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of q/k rows so the weights match Hugging Face's rotate-half RoPE."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    if gguf_name == "rope_freqs.weight":
        return "rope_freqs"
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def load_gguf_weights(
    reader: GGUFReader, config: ModelConfig, path: Path, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Dequantize every tensor once to `dtype`, in Hugging Face names and [out, in] layout."""
    weights: dict[str, torch.Tensor] = {}
    permuted = config.arch in ("llama", "mistral")
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        try:
            arr = dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise ModelLoadError(f"{path}: tensor {t.name} is corrupt or truncated ({exc})") from exc
        expected = tuple(int(x) for x in reversed(t.shape.tolist()))
        if arr.size != int(np.prod(expected)):
            raise ModelLoadError(f"{path}: tensor {t.name} has {arr.size} values, expected shape {expected}")
        arr = arr.reshape(expected) if len(expected) > 1 else arr.reshape(-1)
        if permuted and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            arr = _unpermute(arr, config.num_heads)
        elif permuted and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            arr = _unpermute(arr, config.num_kv_heads)
        weights[name] = torch.from_numpy(np.array(arr, dtype=np.float32)).to(dtype)
    if "lm_head.weight" not in weights:
        config.tie_word_embeddings = True
    if "rope_freqs" in weights:
        config.rope_scaling = {"rope_type": "freq_factors"}
    return weights
