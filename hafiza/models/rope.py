"""Rotary position embeddings as Hugging Face computes them (default, linear, llama3 and GGUF freq factors)."""

from __future__ import annotations

import math

import torch

from hafiza.models.config import ModelConfig


def inv_frequencies(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies in fp32, with the model's rope scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif kind == "freq_factors" and freq_factors is not None:
        inv_freq = inv_freq / freq_factors.float().cpu()
    return inv_freq


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Caches cos/sin per position (grown on demand) and applies rotate-half RoPE to [T, heads, dim]."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 freq_factors: torch.Tensor | None = None) -> None:
        self.inv_freq = inv_frequencies(config, freq_factors)
        self.dtype, self.device = dtype, device
        self.cos = torch.empty(0, config.head_dim, dtype=dtype, device=device)
        self.sin = torch.empty(0, config.head_dim, dtype=dtype, device=device)
        self._grow(max(256, min(config.max_position_embeddings, 4096)))

    def _grow(self, n: int) -> None:
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(self.dtype).to(self.device)
        self.sin = emb.sin().to(self.dtype).to(self.device)

    def cos_sin(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows for `positions`, shaped [T, 1, dim] to broadcast over heads."""
        if max_position >= self.cos.shape[0]:
            self._grow(max(max_position + 1, 2 * self.cos.shape[0]))
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
