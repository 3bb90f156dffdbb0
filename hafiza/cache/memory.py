"""Sizing the KV pool: a KV memory setting (bytes, '2GiB', 'auto' or a fraction of free device memory) to bytes."""

from __future__ import annotations

import re

import torch

from hafiza.errors import ConfigError
from hafiza.sizes import parse_size


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, bytes_per_head: float) -> float:
    """Bytes one token's K and V take over all layers, given the bytes one head of K (or of V) takes:
    `head_dim * bits / 8` at full precision, plus any per-token share of scales for a quantised kv_dtype."""
    return float(2 * num_layers * num_kv_heads * bytes_per_head)


def free_device_memory(device: torch.device) -> int:
    """Free bytes on the device: CUDA's own count, or MemAvailable from /proc/meminfo on the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30


def kv_memory_bytes(spec: str | int | float, device: torch.device) -> int:
    """Resolve a KV memory setting: 'auto' (90 % of free CUDA memory, or min(1 GiB, 25 % of free RAM) on the CPU),
    a fraction in (0, 1] of free device memory, or a size."""
    if isinstance(spec, float) or (isinstance(spec, str) and re.fullmatch(r"0?\.\d+|1(\.0*)?", spec.strip())):
        frac = float(spec)
        if not 0 < frac <= 1:
            raise ConfigError(f"KV memory fraction must be in (0, 1], got {frac}", setting="kv_memory")
        return int(free_device_memory(device) * frac)
    if spec == "auto":
        free = free_device_memory(device)
        return int(free * 0.9) if device.type == "cuda" else min(2**30, free // 4)
    try:
        return parse_size(spec)
    except ConfigError as exc:
        raise ConfigError(str(exc), setting="kv_memory") from None
