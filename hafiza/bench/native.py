"""`hafiza bench native`: stored KB per block of each KV dtype and tier codec, the pool's native form (codes
plus scales, what the store writes) against its dequantised blocks (what it wrote before, `read_blocks`).

One engine per KV dtype computes the prompt; every full block of it is then coded both ways with each codec,
and every native block is decoded back and compared bit for bit. Sizes only: no timing is reported.
"""

from __future__ import annotations

import os
import statistics
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from hafiza.bench.common import write_json
from hafiza.bench.tiers import first_token, prompt_ids
from hafiza.cache.hashing import chain_hashes
from hafiza.engine import EngineConfig, LLMEngine
from hafiza.models import load_model
from hafiza.store.codecs import TOKEN_CODECS, check_codec, encode_block
from hafiza.store.connector import StoreConnector
from hafiza.store.memory import MemoryStore
from hafiza.store.native import PREDICTED_KV_DTYPES, decode_native, encode_native
from hafiza.store.tiered import TieredStore


def measure(model: str | None, dtype: str, tokens: int, kv_dtypes: list[str], codecs: list[str]) -> dict[str, Any]:
    """Per (kv_dtype, codec): mean stored bytes per block, dequantised and native."""
    loaded = load_model(model, dtype=dtype, device="cpu")
    ids = prompt_ids(loaded, tokens)
    rows = []
    for kv_dtype in kv_dtypes:
        engine = LLMEngine(loaded, EngineConfig(kv_memory="160MiB", kv_dtype=kv_dtype))
        first_token(engine, ids)
        bs = engine.layout.block_size
        block_ids = [engine.blocks.hash_to_block[h] for h in chain_hashes(ids, bs, (*engine.extra_keys, None))]
        predictor = None
        if TOKEN_CODECS & set(codecs) and kv_dtype in PREDICTED_KV_DTYPES:
            conn = StoreConnector.for_engine(engine, TieredStore([MemoryStore(1 << 20)]), codec="speculative")
            predictor = conn.predictor
            conn.close()
        pool = engine.kv
        for codec in codecs:
            if codec in TOKEN_CODECS and predictor is None:
                continue
            before, after = [], []
            for i, b in enumerate(block_ids):
                prefix = ids[: (i + 1) * bs] if codec in TOKEN_CODECS else None
                before.append(len(encode_block(pool.read_blocks([b])[:, :, 0], codec, prefix, predictor)))
                native = pool.read_native([b])
                blob = encode_native(native, codec, prefix, predictor)
                back = decode_native(blob, kv_dtype, pool.layout.num_layers, pool.native_spec(), prefix, predictor)
                assert back.equal(native), f"{kv_dtype} {codec}: native block not restored bit for bit"
                after.append(len(blob))
            values = pool.layout.num_layers * 2 * bs * pool.layout.num_kv_heads * pool.layout.head_dim
            rows.append({"kv_dtype": kv_dtype, "codec": codec, "blocks": len(block_ids),
                         "pool_bytes_per_block": pool.bytes_per_block,
                         "dequantised_kb_per_block": statistics.mean(before) / 1024,
                         "native_kb_per_block": statistics.mean(after) / 1024,
                         "native_bits_per_value": 8 * statistics.mean(after) / values,
                         "ratio": statistics.mean(before) / statistics.mean(after)})
    return {"model": loaded.name, "dtype": dtype, "prompt_tokens": len(ids), "load_avg": os.getloadavg()[0],
            "results": rows}


def print_table(data: dict[str, Any]) -> None:
    table = Table(title=f"Stored KB per block, {data['prompt_tokens']}-token prompt, {data['model']} "
                        f"({data['dtype']} compute), load {data['load_avg']:.2f}")
    for col in ("kv dtype", "codec", "pool KB/block", "dequantised KB", "native KB", "native bits/value",
                "dequantised / native"):
        table.add_column(col, justify="right")
    for r in data["results"]:
        table.add_row(r["kv_dtype"], r["codec"], f"{r['pool_bytes_per_block'] / 1024:.1f}",
                      f"{r['dequantised_kb_per_block']:.1f}", f"{r['native_kb_per_block']:.1f}",
                      f"{r['native_bits_per_value']:.2f}", f"{r['ratio']:.2f}x")
    Console().print(table)


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("native")
    def native(
        json_path: Annotated[str | None, typer.Option("--json", help="Where to write the JSON results.")] = None,
        model: Annotated[str | None, typer.Option(help="GGUF file or model directory.")] = None,
        dtype: Annotated[str, typer.Option(help="Compute dtype: fp32 or bf16.")] = "fp32",
        tokens: Annotated[int, typer.Option(help="Prompt length in tokens.")] = 256,
        kv_dtypes: Annotated[str, typer.Option(help="Comma-separated KV dtypes.")] = "bf16,fp8,int8,int4",
        codecs: Annotated[str, typer.Option(help="Comma-separated store codecs.")] = "raw,zstd,fast,speculative",
    ) -> None:
        """Stored bytes per block: native codes and scales against dequantised blocks, per KV dtype and codec."""
        names = [check_codec(c.strip()) for c in codecs.split(",") if c.strip()]
        data = measure(model, dtype, tokens, [k.strip() for k in kv_dtypes.split(",") if k.strip()], names)
        print_table(data)
        print(f"wrote {write_json(data, json_path, 'native.json')}")
