"""`hafiza bench predictor`: what the speculative codec's cheaper model costs and saves, against the target's own
prefill of the same tokens.

For each target (weights and compute dtype as served) the bench runs the target's own forward over a prompt in one
chunked pass (the prefill it would recompute; its K/V, read back in bf16 as the engine's pool holds them, are the
data), then every predictor spec over the same tokens. Per spec: seconds as a fraction of the target's prefill
(the mean of the target's passes before and after, in the same process), and the speculative codec's bits/value on
the target's K/V blocks (the store's layout and codec, each block decoded back and checked bit-exact), with
encode/decode MB/s of the coder alone. zstd and fast on the same blocks are the baselines.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from rich.console import Console
from rich.table import Table

from hafiza.bench.common import write_json
from hafiza.codec.predictors.cheap import CheapSpec, PrefixRun, build_cheap_model
from hafiza.models import load_model
from hafiza.models.llama import LlamaModel
from hafiza.store.codecs import decode_block, encode_block
from hafiza.store.speculative import BlockPredictor, BlockwiseKV

TEXT = Path("bench/texts/en_declaration_gettysburg.txt")
BS = 16
KV_DTYPE = torch.bfloat16

# (target weights, target compute dtype) -> predictor specs measured against it
TARGETS: dict[tuple[str, str], list[CheapSpec]] = {
    ("auto", "fp32"): [CheapSpec("fp32-bf16in", "fp32"), CheapSpec("int8", "fp32"), CheapSpec("int4", "fp32"),
                       CheapSpec("fp32-bf16in", "fp32", exact_layers=6), CheapSpec("same", "fp32", layers=20)],
    ("bf16", "bf16"): [CheapSpec("int8", "bf16"), CheapSpec("int4", "bf16"), CheapSpec("fp32-bf16in", "fp32")],
}


def _load(tokens: int) -> str:
    text = TEXT.read_text() if TEXT.exists() else "The memory of a transformer is its KV cache. "
    return text * (1 + tokens * 8 // max(1, len(text)))


def _pass(model: LlamaModel, layers: int, ids: list[int], chunk: int) -> tuple[float, PrefixRun]:
    run = PrefixRun(model, layers, KV_DTYPE)
    t0 = time.perf_counter()
    run.extend(ids, chunk)
    return time.perf_counter() - t0, run


def _blocks(run: PrefixRun, n: int) -> list[torch.Tensor]:
    k, v = run.kv(0, n * BS)
    kv = torch.stack([k, v], dim=1)
    return [kv[:, :, b * BS : (b + 1) * BS].contiguous() for b in range(n)]


def _coded(blocks: list[torch.Tensor], ids: list[int], codec: str, predictor: BlockPredictor | None
           ) -> dict[str, float]:
    """Bits/value and coder-only encode/decode MB/s of `codec` over `blocks`, every block checked bit-exact (the
    first block once before timing: the fast coder's kernel loads on first use)."""
    first = ids[:BS] if predictor is not None else None
    decode_block(encode_block(blocks[0], codec, first, predictor), blocks[0].shape, blocks[0].dtype, first, predictor)
    size = enc = dec = 0.0
    for i, b in enumerate(blocks):
        prefix = ids[: (i + 1) * BS] if predictor is not None else None
        t0 = time.perf_counter()
        blob = encode_block(b, codec, prefix, predictor)
        t1 = time.perf_counter()
        back = decode_block(blob, b.shape, b.dtype, prefix, predictor)
        dec += time.perf_counter() - t1
        enc += t1 - t0
        if not torch.equal(back.view(torch.int16), b.view(torch.int16)):
            raise RuntimeError(f"{codec} did not round-trip block {i}")
        size += len(blob)
    raw = sum(b.numel() * b.element_size() for b in blocks)
    values = sum(b.numel() for b in blocks)
    return {"bits_per_value": 8 * size / values, "encode_MBps": raw / enc / 1e6, "decode_MBps": raw / dec / 1e6,
            "stored_bytes_per_block": size / len(blocks)}


def measure(weights: str, dtype: str, specs: list[CheapSpec], tokens: int, chunk: int, console: Console,
            model_path: Path | None = None) -> dict[str, Any]:
    """One target: its prefill seconds, then every spec's cost fraction and bits/value on its K/V."""
    loaded = load_model(model_path, dtype=dtype, device="cpu", weights=weights)
    target = loaded.model
    ids = loaded.tokenizer.encode(_load(tokens))[: tokens // BS * BS]
    n = len(ids) // BS
    layers = len(target.layers)
    own = build_cheap_model(target, CheapSpec("same", dtype))
    _pass(own, layers, ids[: 2 * BS], chunk)  # warm-up
    first, run = _pass(own, layers, ids, chunk)
    blocks = _blocks(run, n)
    rows: list[dict[str, Any]] = []
    label = f"{loaded.weights} weights ({'+'.join(sorted(target.weights.formats()))}), {dtype} compute"
    for codec in ("zstd", "fast"):
        rows.append({"target": label, "predictor": codec, **_coded(blocks, ids, codec, None)})
        console.print(f"{label}: {codec} {rows[-1]['bits_per_value']:.2f} bits/value")
    timed: list[tuple[CheapSpec, float, dict[str, float]]] = []
    for spec in specs:
        try:
            kv = BlockwiseKV(target, BS, spec, kv_dtype=KV_DTYPE, chunk=chunk)
        except ValueError as exc:
            console.print(f"{label}: {spec.label()} skipped ({exc})")
            continue
        kv.blocks(ids[: 2 * BS], 0, 2)  # warm-up
        kv.reset()
        t0 = time.perf_counter()
        kv.blocks(ids, 0, n)
        seconds = time.perf_counter() - t0
        coded = _coded(blocks, ids, "speculative", BlockPredictor(kv, f"bench:{loaded.fingerprint}"))
        timed.append((spec, seconds, coded))
        console.print(f"{label}: {spec.label()} {seconds:.2f} s, {coded['bits_per_value']:.2f} bits/value")
    last, _ = _pass(own, layers, ids, chunk)
    prefill = statistics.fmean([first, last])
    for spec, seconds, coded in timed:
        rows.append({"target": label, "predictor": spec.label(), "predictor_s": seconds, "prefill_s": prefill,
                     "cost_fraction": seconds / prefill, **coded})
    return {"target": label, "weights": weights, "dtype": dtype, "tokens": len(ids), "prefill_s_first": first,
            "prefill_s_last": last, "prefill_tok_s": len(ids) / prefill, "rows": rows}


def tier_read_rates(blocks: int = 124, block_bytes: int = 368_640, repeats: int = 5) -> dict[str, float]:
    """Read MB/s of each store tier (`get_many` of `blocks` values of `block_bytes` plus one copy of each, as a load
    makes; the median of `repeats`): host RAM, local disk (page-cached, just written), a local redis-server."""
    import shutil
    import tempfile

    from hafiza.bench.common import redis_process
    from hafiza.store.base import KVStore
    from hafiza.store.disk import DiskStore
    from hafiza.store.memory import MemoryStore
    from hafiza.store.redis_store import RedisStore

    values = {f"b{i}": os.urandom(block_bytes) for i in range(blocks)}
    total = blocks * block_bytes

    def rate(store: KVStore) -> float:
        for key, value in values.items():
            store.put(key, value)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            got = [None if g is None else bytearray(g) for g in store.get_many(list(values))]  # a load copies
            times.append(time.perf_counter() - t0)
            if any(g is None for g in got):
                raise RuntimeError(f"{store.name} lost a value")
        return total / statistics.median(times) / 1e6

    out = {"ram": rate(MemoryStore(2 * total, name="ram"))}
    with tempfile.TemporaryDirectory() as root:
        out["disk"] = rate(DiskStore(root, 2 * total, name="disk"))
    exe = shutil.which("redis-server")
    if exe is not None:
        with redis_process(exe) as (port, _):
            out["redis"] = rate(RedisStore(f"redis://127.0.0.1:{port}/0", default_ttl_s=None, name="redis"))
    return out


def print_table(data: dict[str, Any]) -> None:
    table = Table(title=f"Speculative predictors against the target's own prefill ({data['tokens']} tokens, "
                        f"load average {data['load_average']})")
    for col in ("target", "predictor", "predictor s", "prefill s", "cost / prefill", "bits/value", "decode MB/s"):
        table.add_column(col, justify="right")
    for t in data["targets"]:
        for r in t["rows"]:
            table.add_row(r["target"], r["predictor"], f"{r.get('predictor_s', 0):.2f}" if "predictor_s" in r else "",
                          f"{r['prefill_s']:.2f}" if "prefill_s" in r else "",
                          f"{r['cost_fraction']:.2f}" if "cost_fraction" in r else "",
                          f"{r['bits_per_value']:.2f}", f"{r['decode_MBps']:.0f}")
    Console(width=160).print(table)
    print("tier read MB/s: " + ", ".join(f"{k} {v:.0f}" for k, v in data["tier_read_MBps"].items()))


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("predictor")
    def predictor(
        json_path: Annotated[str | None, typer.Option("--json", help="Where to write the JSON results.")] = None,
        tokens: Annotated[int, typer.Option(help="Prompt tokens (whole 16-token blocks).")] = 1024,
        chunk: Annotated[int, typer.Option(help="Tokens per forward of every pass.")] = 256,
        targets: Annotated[str, typer.Option(help="Targets as weights:dtype, comma-separated.")
                           ] = ",".join(f"{w}:{d}" for w, d in TARGETS),
    ) -> None:
        """The speculative codec's predictors: cost as a fraction of the target's prefill, bits/value on its K/V."""
        if tokens < 2 * BS or chunk < 1:
            raise typer.BadParameter(f"--tokens must be >= {2 * BS} and --chunk >= 1, got {tokens} and {chunk}")
        chosen = []
        for item in (x.strip() for x in targets.split(",") if x.strip()):
            key = tuple(item.split(":", 1))
            if key not in TARGETS:
                raise typer.BadParameter(f"unknown target {item!r}: choose from "
                                         f"{', '.join(f'{w}:{d}' for w, d in TARGETS)}")
            chosen.append(key)
        console = Console(stderr=True)
        load_before = f"{os.getloadavg()[0]:.2f}"
        tiers = tier_read_rates()
        console.print("tier read MB/s: " + ", ".join(f"{k} {v:.0f}" for k, v in tiers.items()))
        measured = [measure(w, d, TARGETS[(w, d)], tokens, chunk, console) for w, d in chosen]
        load_after = f"{os.getloadavg()[0]:.2f}"
        data = {"tokens": measured[0]["tokens"] if measured else 0, "chunk": chunk,
                "load_average": f"{load_before} -> {load_after}", "tier_read_MBps": tiers, "targets": measured}
        print_table(data)
        print(f"wrote {write_json(data, json_path, 'predictor.json')}")
