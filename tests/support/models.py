"""Test models: tiny random-weight Llama / Qwen2 directories (HF format) and transformers references."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hafiza.models.tokenizer import Tokenizer

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def make_tiny_model_dir(path: Path, arch: str, tokenizer: Tokenizer, seed: int = 0) -> Path:
    """Write a random-weight model (config.json, model.safetensors, tokenizer files) to `path`.

    The lm_head is scaled up so greedy choices have clear margins (random logits are otherwise near-ties).
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    vocab = tokenizer.vocab_size
    if arch == "qwen2":
        cfg = Qwen2Config(vocab_size=vocab, **TINY)
        model = Qwen2ForCausalLM(cfg)
    else:
        cfg = LlamaConfig(vocab_size=vocab, **TINY)
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
        model.lm_head.weight.mul_(8.0)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tokenizer.chat_template, "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
    }))
    return path


def hf_reference(model_path: Path):
    """The transformers model for a directory, in fp32 with SDPA attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
