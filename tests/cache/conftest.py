"""Fixtures: a tiny random-weight Llama and small pool layouts, so the pool tests run in seconds."""

from __future__ import annotations

import pytest
import torch

from hafiza.cache.layout import KVLayout
from hafiza.models.config import ModelConfig
from hafiza.models.llama import LlamaModel


def tiny_model(seed: int = 0) -> LlamaModel:
    """2 layers, 4 query heads over 2 KV heads of dim 16, vocab 97; fp32 on the CPU."""
    c = ModelConfig(arch="llama", vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096)
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    w = {"model.embed_tokens.weight": r(97, 64, scale=1.0), "model.norm.weight": torch.ones(64),
         "lm_head.weight": r(97, 64)}
    for i in range(2):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": r(64, 64), p + "self_attn.k_proj.weight": r(32, 64),
              p + "self_attn.v_proj.weight": r(32, 64), p + "self_attn.o_proj.weight": r(64, 64),
              p + "mlp.gate_proj.weight": r(128, 64), p + "mlp.up_proj.weight": r(128, 64),
              p + "mlp.down_proj.weight": r(64, 128), p + "input_layernorm.weight": torch.ones(64),
              p + "post_attention_layernorm.weight": torch.ones(64)}
    return LlamaModel(c, w, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="session")
def model() -> LlamaModel:
    return tiny_model()


@pytest.fixture
def layout() -> KVLayout:
    """One layer (the last layer's write runs the inf/NaN check), 8 blocks of 16, 2 heads of dim 64, fp32."""
    return KVLayout(num_layers=1, num_blocks=8, block_size=16, num_kv_heads=2, head_dim=64, kv_dtype="fp32",
                    compute_dtype=torch.float32)
