"""Shape of a paged KV pool: per layer, K and V in blocks of [block_size, kv_heads, head_dim], and the two dtypes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hafiza.cache.errors import KVDtypeError

FULL_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
KV_DTYPES = ("bf16", "fp16", "fp32", "fp8", "int8", "int4")


def check_kv_dtype(kv_dtype: str) -> None:
    """Refuse a KV storage dtype that no pool format implements."""
    if kv_dtype not in KV_DTYPES:
        raise KVDtypeError(f"unknown KV cache dtype {kv_dtype!r}: use one of {', '.join(KV_DTYPES)}",
                           setting="kv_dtype")


@dataclass(frozen=True)
class KVLayout:
    """Shape facts of a paged pool.

    `kv_dtype` is how the pool stores K/V (one of KV_DTYPES); `compute_dtype` is the dtype the model computes in,
    which `gather` hands back. Sizes in bytes depend on the storage format: ask the pool (cache/pool.py).
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    compute_dtype: torch.dtype

    def __post_init__(self) -> None:
        check_kv_dtype(self.kv_dtype)
