"""Sizing the KV pool: parse --kv-memory (bytes, '2GiB', or a fraction of free device memory)."""

from __future__ import annotations

import re

import torch

from hafiza.errors import HafizaError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """'512MiB', '2G', '1000000' -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise HafizaError(f"cannot read {text!r} as a size: use bytes or a unit like 512MiB, 2GB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


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
    """Resolve --kv-memory: 'auto' (90 % of free CUDA memory, or min(1 GiB, 25 % of free RAM) on the CPU),
    a fraction in (0, 1] of free device memory, or a size."""
    if isinstance(spec, float) or (isinstance(spec, str) and re.fullmatch(r"0?\.\d+|1(\.0*)?", spec.strip())):
        frac = float(spec)
        if not 0 < frac <= 1:
            raise HafizaError(f"--kv-memory fraction must be in (0, 1], got {frac}")
        return int(free_device_memory(device) * frac)
    if spec == "auto":
        free = free_device_memory(device)
        return int(free * 0.9) if device.type == "cuda" else min(2**30, free // 4)
    return parse_bytes(spec)
