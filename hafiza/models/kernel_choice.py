"""Which kernels multiply a GGUF's quantized matmuls on this machine's CPU, chosen once per process and printed.

Measured (docs/WEIGHTS.md): with AVX2 only, torch's int4 kernel reads ~3.4 GB/s at one row and ggml's
integer-dot kernels are 2-4x faster, but ggml quantizes activations to 8 bits: perplexity +0.26-0.67 % against
+0.04 % for torch's kernel, and the default model's greedy answer to "What is the capital of France?" no longer
names Paris (a near tie of its first token flips). So `auto` keeps torch's kernel and ggml is asked for by name.
The choice is a rule, not a timing taken at start-up, so the same machine always computes the same bits.
"""

from __future__ import annotations

import functools

import torch

from hafiza import settings
from hafiza.errors import ConfigError

KERNELS = ("auto", "ggml", "torch")


@functools.cache
def cpu_kernel() -> str:
    """`ggml` or `torch` for this process (settings.CPU_KERNEL; ConfigError if ggml is asked for and unusable)."""
    from hafiza.models.ggml_linear import GGMLUnavailable, load_library

    asked = settings.CPU_KERNEL.read()
    if asked not in KERNELS:
        raise ConfigError(f"{settings.CPU_KERNEL.name}={asked!r}: use {', '.join(KERNELS)}", setting="cpu_kernel")
    if asked != "ggml":
        return "torch"
    try:
        load_library()
    except GGMLUnavailable as exc:
        raise ConfigError(f"{settings.CPU_KERNEL.name}=ggml, but {exc}", setting="cpu_kernel") from None
    return "ggml"


def describe() -> str:
    """One line for start-up output: the kernel, and why."""
    kernel = cpu_kernel()
    isa = torch.backends.cpu.get_cpu_capability()
    how = "ggml integer-dot on the file's blocks" if kernel == "ggml" else "torch packed int4/int8"
    setting = f"{settings.CPU_KERNEL.name}={settings.CPU_KERNEL.read()}"
    return f"CPU matmul kernels: {how} (torch CPU capability {isa}, {setting})"
