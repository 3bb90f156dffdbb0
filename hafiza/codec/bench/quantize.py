"""Lossy KV formats to code losslessly in the benchmark: fp8 e4m3 (plain cast) and int8 (per channel)."""

from __future__ import annotations

import torch


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Cast to float8 e4m3 (saturating at +-448), as an fp8 KV cache with unit scale stores it."""
    return x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def to_int8(x: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 with one scale per (layer, head, dim) channel over the tokens: x [L, T, H, D]."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127.0
    return torch.round(xf / scale).clamp(-127, 127).to(torch.int8)
