"""Shared helpers for codec tests: every coder, exact bit comparison."""

from __future__ import annotations

import torch

from hafiza.codec import CodecContext, decode, encode
from hafiza.codec.formats import tensor_bits

CODER_CASES = [
    ("raw", None), ("zstd", None), ("exponent", None), ("predictive", "previous-token"), ("planes", None),
    ("fast", None),
]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when both tensors have the same dtype, shape and bit patterns (NaN payloads included)."""
    return a.dtype == b.dtype and a.shape == b.shape and bool((tensor_bits(a) == tensor_bits(b)).all())


def roundtrip(x: torch.Tensor, coder: str, predictor: str | None, chunk_tokens: int = 256) -> torch.Tensor:
    ctx = CodecContext(coder=coder, predictor=predictor, chunk_tokens=chunk_tokens)
    return decode(encode(x, ctx), ctx)
