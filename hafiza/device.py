"""Device and dtype selection at run time: never hard-coded."""

from __future__ import annotations

import torch

from hafiza.errors import ConfigError, HafizaError

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """'auto' picks CUDA when present, else CPU; asking for CUDA without one is a clear error."""
    if isinstance(name, torch.device):
        return name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device cuda was asked for, but torch sees no CUDA device here", setting="device")
    if name != "cpu" and not name.startswith("cuda"):
        raise HafizaError(f"unknown device {name!r}: use auto, cpu or cuda")
    return torch.device(name)


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map 'fp32' / 'bf16' / 'fp16' (or a torch dtype) to a torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise HafizaError(f"unknown dtype {name!r}: use fp32, bf16 or fp16")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
