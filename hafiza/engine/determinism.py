"""Whether greedy output is independent of cache state and batch composition, and if not, why.

It is in the default configuration: fp32 compute on the CPU (row-invariant matmuls and norms, batch-invariant
attention) over a pool that stores every token's K/V once, at one precision (fp32, bf16 or fp16), so a token reads
the same values cold, warm, chunked, preempted, batched or loaded from a tier (docs/ENGINE.md)."""

from __future__ import annotations

import torch

from hafiza.cache.layout import FULL_DTYPES


def nondeterminism_reasons(kv_dtype: str, eviction: str | None, device: torch.device, dtype: torch.dtype) -> list[str]:
    """Short reasons why output may depend on cache state or batch-mates; empty when it does not."""
    reasons = []
    if kv_dtype not in FULL_DTYPES:
        reasons.append(f"lossy-kv-{kv_dtype}")  # recent tokens sit unquantized until their block fills
    if eviction:
        reasons.append(f"eviction-{eviction}")  # what a sequence keeps depends on its own history
    if device.type != "cpu" or dtype != torch.float32:
        reasons.append(f"matmul-not-row-invariant-{device.type}-{str(dtype).removeprefix('torch.')}")
    return reasons


def determinism_header(reasons: list[str]) -> str:
    """The `x-hafiza-deterministic` header value: "true", or "false; reason=a,b"."""
    return "true" if not reasons else f"false; reason={','.join(reasons)}"
