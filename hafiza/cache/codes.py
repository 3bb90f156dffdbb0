"""Pure quantise / dequantise kernels of the lossy formats; the pools only decide what to call them on."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_FP8_SCALE = 2.0**-20
INT8_MAX = 127
INT4_LEVELS = 15


def int8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dim: x [..., d] -> codes int8 [..., d], scale fp16 [...] (amax / 127)."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax)).to(torch.float16)
    codes = torch.round(xf / scale.float().unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def int8_dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of int8_quantize in `dtype`."""
    return (codes.float() * scale.float().unsqueeze(-1)).to(dtype)


def pow2_scale(amax: torch.Tensor, headroom: float) -> torch.Tensor:
    """Smallest power of two s with amax * headroom <= 448 * s (at least MIN_FP8_SCALE), fp32."""
    need = (amax.float() * headroom / FP8_MAX).clamp_min(MIN_FP8_SCALE)
    return torch.exp2(torch.ceil(torch.log2(need)))


def fp8_encode(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale as e4m3 (saturating at ±448; e4m3fn has no infinity and casts overflow to NaN)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def fp8_decode(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes * scale in `dtype`."""
    return (codes.float() * scale).to(dtype)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [..., d] (d even) -> bytes [..., d/2], even channel in the low nibble."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_nibbles: [..., d/2] bytes -> [..., d] uint8 codes."""
    out = torch.stack([packed & 0x0F, packed >> 4], dim=-1)
    return out.flatten(-2)


def asym_params(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit asymmetric scale and zero (= the minimum) of a range, fp16; a constant range gets scale 1."""
    span = hi - lo
    scale = torch.where(span > 0, span / INT4_LEVELS, torch.ones_like(span)).to(torch.float16)
    return scale, lo.to(torch.float16)


def asym_encode(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """round((x - zero) / scale) clamped to 0..15 as uint8; scale and zero broadcast against x."""
    q = torch.round((x.float() - zero.float()) / scale.float())
    return q.clamp_(0, INT4_LEVELS).to(torch.uint8)


def asym_decode(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """zero + q * scale in `dtype`."""
    return (zero.float() + q.float() * scale.float()).to(dtype)


def int4_keys_quantize(
    k: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KIVI keys: per channel over a block's written rows. k [N, bs, H, d], rows bool [N, bs] ->
    packed [N, bs, H, d/2], scale and zero fp16 [N, H, d]. Unwritten rows do not widen the range."""
    kf = k.float()
    m = rows[:, :, None, None]
    inf = torch.tensor(float("inf"), device=k.device)
    lo = torch.where(m, kf, inf).amin(1)
    hi = torch.where(m, kf, -inf).amax(1)
    empty = ~rows.any(1)[:, None, None]
    lo = torch.where(empty, torch.zeros_like(lo), lo)
    hi = torch.where(empty, torch.zeros_like(hi), hi)
    scale, zero = asym_params(lo, hi)
    q = asym_encode(kf, scale.unsqueeze(1), zero.unsqueeze(1))
    return pack_nibbles(q), scale, zero


def int4_keys_dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                         dtype: torch.dtype) -> torch.Tensor:
    """Inverse of int4_keys_quantize: [N, bs, H, d] in `dtype`."""
    return asym_decode(unpack_nibbles(packed), scale.unsqueeze(1), zero.unsqueeze(1), dtype)


def int4_values_quantize(v: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KIVI values: per token in channel groups. v [..., d] -> packed [..., d/2], scale, zero [..., d/g]."""
    g = v.float().unflatten(-1, (-1, group))
    scale, zero = asym_params(g.amin(-1), g.amax(-1))
    q = asym_encode(g, scale.unsqueeze(-1), zero.unsqueeze(-1)).flatten(-2)
    return pack_nibbles(q), scale, zero


def int4_values_dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                           dtype: torch.dtype) -> torch.Tensor:
    """Inverse of int4_values_quantize."""
    q = unpack_nibbles(packed).unflatten(-1, (-1, group))
    return asym_decode(q, scale.unsqueeze(-1), zero.unsqueeze(-1), dtype).flatten(-2)
