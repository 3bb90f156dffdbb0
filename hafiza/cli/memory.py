"""`hafiza memory`: exact KV bytes per token and for a context (as the pool's format stores them), GQA vs MHA."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from hafiza.cli import app


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{n:,.0f} B"
        n /= 1024
    return f"{n:.1f}"


@app.command()
def memory(
    context: Annotated[int, typer.Option(help="Context length in tokens.")],
    model: Annotated[str | None, typer.Option(help="GGUF file or model directory (default: SmolLM2-135M).")] = None,
    batch: Annotated[int, typer.Option(help="Concurrent sequences.")] = 1,
    dtype: Annotated[str, typer.Option(help="KV dtype: fp32, bf16, fp16, fp8, int8, int4 (payload and scales, "
                                            "in 16-token blocks, as the pool stores them).")] = "bf16",
    layers: Annotated[int | None, typer.Option(help="Layers (for a model not on disk).")] = None,
    kv_heads: Annotated[int | None, typer.Option(help="KV heads (for a model not on disk).")] = None,
    heads: Annotated[int | None, typer.Option(help="Query heads, for the MHA comparison.")] = None,
    head_dim: Annotated[int | None, typer.Option(help="Head dimension (for a model not on disk).")] = None,
) -> None:
    """Print the exact KV-cache size of a model at a context length."""
    import torch

    from hafiza.cache.layout import KV_DTYPES, KVLayout
    from hafiza.cache.pool import bytes_per_token
    from hafiza.errors import HafizaError

    if dtype not in KV_DTYPES:
        raise HafizaError(f"unknown KV dtype {dtype!r}: use one of {', '.join(KV_DTYPES)}")
    if context < 1 or batch < 1:
        raise HafizaError("--context and --batch must be positive")
    name = "custom"
    if layers is None or kv_heads is None or head_dim is None:
        cfg = _config(model)
        name = cfg.name or name
        layers, kv_heads, head_dim = layers or cfg.num_layers, kv_heads or cfg.num_kv_heads, head_dim or cfg.head_dim
        heads = heads or cfg.num_heads
    heads = heads or kv_heads
    per_token = bytes_per_token(KVLayout(layers, 1, 16, kv_heads, head_dim, dtype, torch.float32))
    mha_token = bytes_per_token(KVLayout(layers, 1, 16, heads, head_dim, dtype, torch.float32))
    table = Table(title=f"KV cache of {name}: {layers} layers, {kv_heads} KV heads x {head_dim}, {dtype}")
    for col in ("", "per token", f"{context:,} tokens x {batch}"):
        table.add_column(col, justify="right")
    total = per_token * context * batch
    table.add_row("this model (GQA)" if heads != kv_heads else "this model", f"{per_token:,.0f} B", human(total))
    if heads != kv_heads:
        table.add_row(f"MHA ({heads} KV heads)", f"{mha_token:,.0f} B", human(mha_token * context * batch))
        table.add_row("GQA saves", f"{heads / kv_heads:.1f}x", human(mha_token * context * batch - total))
    Console().print(table)
    print(f"bytes_per_token={per_token:.0f} total_bytes={total:.0f}")


def _config(model: str | None):
    from pathlib import Path

    from hafiza.models.config import ModelConfig
    from hafiza.models.loader import default_model_path

    path = Path(model) if model else default_model_path()
    if path.is_dir():
        import json

        return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    from hafiza.errors import ModelLoadError
    from hafiza.models.gguf_file import config_from_gguf, gguf_fields, open_gguf

    if not path.exists():
        raise ModelLoadError(f"model not found: {path}")
    return config_from_gguf(gguf_fields(open_gguf(path)), path)
