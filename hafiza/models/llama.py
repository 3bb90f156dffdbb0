"""A compact Llama-family forward (Llama 2/3, SmolLM, Mistral, Qwen2) that reads and writes a paged KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from hafiza.errors import ModelLoadError
from hafiza.models.attention import AttentionMetadata, paged_attention
from hafiza.models.config import ModelConfig
from hafiza.models.rope import RotaryEmbedding, apply_rope
from hafiza.models.weights import LayerWeights as LayerWeights  # re-exported: the codec reads layers
from hafiza.models.weights import ModelWeights, Source, build_model_weights, tensor_source
from hafiza.threads import adapt as adapt_threads

if TYPE_CHECKING:
    from hafiza.cache.pool import KVPool


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back, exactly as Hugging Face's LlamaRMSNorm."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # the fused op; bit-identical in fp32
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaModel:
    """Weights plus forward. The KV cache is passed in; the model keeps no per-request state."""

    def __init__(self, config: ModelConfig, weights: ModelWeights | dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device) -> None:
        """`weights`: built by hafiza.models.weights (any format), or plain tensors, taken as fp32 weights."""
        self.config, self.dtype, self.device = config, dtype, device
        c = config
        if c.num_heads % c.num_kv_heads:
            raise ModelLoadError(f"num_heads {c.num_heads} is not a multiple of num_kv_heads {c.num_kv_heads}")
        if not isinstance(weights, ModelWeights):
            sources: dict[str, Source] = {k: tensor_source(k, v.float()) for k, v in weights.items()}
            weights = build_model_weights(sources, c.num_layers, c.tie_word_embeddings, "fp32", dtype, device)
        self.weights = weights
        self.embed, self.norm, self.lm_head, self.layers = weights.embed, weights.norm, weights.lm_head, weights.layers
        expect_q = c.num_heads * c.head_dim
        if self.layers and self.layers[0].qkv.out_features != expect_q + 2 * c.num_kv_heads * c.head_dim:
            raise ModelLoadError("q/k/v projection shapes do not match the config's heads and head_dim")
        self.rope = RotaryEmbedding(c, dtype, device, weights.rope_freqs)
        self.q_size, self.kv_size = expect_q, c.num_kv_heads * c.head_dim

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: KVPool) -> torch.Tensor:
        """Run all layers on a flat batch of T tokens; returns final-normed hidden states [T, hidden]."""
        c = self.config
        if self.device.type == "cpu":
            adapt_threads()  # the cores other processes left free (hafiza/threads.py)
        x = self.embed(input_ids)
        cos, sin = self.rope.cos_sin(positions, int(positions.max()) if positions.numel() else 0)
        t, heads = x.shape[0], c.num_heads + c.num_kv_heads
        for i, lw in enumerate(self.layers):
            h = rms_norm(x, lw.input_norm, c.rms_norm_eps)
            qkv = lw.qkv(h) if lw.qkv_bias is None else lw.qkv(h) + lw.qkv_bias
            qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(t, heads, c.head_dim), cos, sin)
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]  # one rope for both: the same values, half the ops
            v = qkv[:, self.q_size + self.kv_size :].view(t, c.num_kv_heads, c.head_dim)
            kv.write(i, meta.slot_mapping, k, v)
            attn = paged_attention(i, q, k, v, kv, meta)
            x = x + lw.o(attn.view(t, self.q_size))
            h = rms_norm(x, lw.post_norm, c.rms_norm_eps)
            gate, up = lw.gate_up(h).chunk(2, dim=-1)
            x = x + lw.down(F.silu(gate) * up)
        return rms_norm(x, self.norm, c.rms_norm_eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits in fp32 for the selected hidden rows."""
        return self.lm_head(hidden).float()
