"""Where decode and prefill time goes with quantized weights (docs/WEIGHTS.md, "Where the time goes").

`kernels`: the int4 kernel alone over one decode step's matmuls of the default model's shapes (distinct weights
per layer, so reads come from memory) and its effective GB/s. `attention`: decode (one token against CTX keys, 30
layers) and a causal prefill span of N tokens (one layer), optionally against an older attention.py
(`--baseline FILE`, e.g. `git show REV:hafiza/models/attention.py > /tmp/attention_old.py`), checking the outputs
are bit-identical. `prefill-matmul`: int4 kernel against dequantize-then-MKL-fp32 at M rows. Medians; prints the
load average with every figure.

    .venv/bin/python scripts/weights_speed_probe.py kernels --threads 1
    .venv/bin/python scripts/weights_speed_probe.py attention --threads 1 --ctx 170 --prefill 1024 --baseline F
    .venv/bin/python scripts/weights_speed_probe.py prefill-matmul --threads 1 --rows 512
    .venv/bin/python scripts/weights_speed_probe.py profile --threads 1 --reps 10
    .venv/bin/python scripts/weights_speed_probe.py batch --threads 1 --reps 2 --new-tokens 16 --streams 16
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable
from types import ModuleType

import numpy as np
import torch

from hafiza.cache.formats.full import FullPrecisionKV
from hafiza.cache.layout import KVLayout
from hafiza.models import attention
from hafiza.models.attention import AttentionMetadata, PrefillSpan
from hafiza.models.linear import Int4Linear, cpu_fp32_linear

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down of SmolLM2-135M
HEAD = (49152, 1152)  # the tied Q8_0 head as two int4 planes
LAYERS, HKV, GROUP, DIM, BS = 30, 3, 3, 64, 16


def median_s(f: Callable[[], object], reps: int) -> float:
    f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def random_int4(n: int, k: int, rng: np.random.Generator) -> Int4Linear:
    scale = rng.random((n, k // 32), dtype=np.float32) * 0.01
    return Int4Linear.from_ints(rng.integers(0, 16, (n, k), dtype=np.uint8), scale, scale / 2, torch.device("cpu"))


def kernels(reps: int) -> None:
    rng = np.random.default_rng(0)
    layers = [random_int4(n, k, rng) for _ in range(LAYERS) for n, k in LAYER_SHAPES]
    head = random_int4(*HEAD, rng)
    xs = {k: torch.randn(1, k) for k in (576, 1536)}
    for name, lins in (("layers", layers), ("head", [head])):
        secs = median_s(lambda lins=lins: [lin(xs[lin.in_features if lin is not head else 576]) for lin in lins],
                        reps)
        nbytes = sum(lin.nbytes for lin in lins)
        print(f"int4 M=1 {name}: {secs * 1e3:.1f} ms, {nbytes / 1e6:.1f} MB, {nbytes / secs / 1e9:.2f} GB/s, "
              f"{torch.get_num_threads()} threads, {load()}")


def old_module(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("attention_baseline", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def attention_probe(ctx: int, prefill: int, reps: int, baseline: str | None) -> None:
    mods = {"current": attention, **({"baseline": old_module(baseline)} if baseline else {})}
    g = torch.Generator().manual_seed(0)
    n = max(ctx, prefill)
    pool = FullPrecisionKV(KVLayout(LAYERS, -(-n // BS) + 1, BS, HKV, DIM, "fp32", torch.float32), torch.device("cpu"))
    q = torch.randn(n, HKV * GROUP, DIM, generator=g)
    k, v = torch.randn(n, HKV, DIM, generator=g), torch.randn(n, HKV, DIM, generator=g)
    for layer in range(LAYERS):
        pool.write(layer, torch.arange(n), k, v)
    table = list(range(-(-ctx // BS)))
    dec = AttentionMetadata(slot_mapping=torch.tensor([ctx - 1]), num_decode=1,
                            decode_block_tables=torch.tensor([table]),
                            decode_mask=(torch.arange(len(table) * BS) < ctx)[None, None, None, :])
    pre = AttentionMetadata(slot_mapping=torch.arange(prefill), prefills=[PrefillSpan(0, prefill, prefill)])
    outs: dict[str, list[torch.Tensor]] = {}
    for name, mod in mods.items():
        d = median_s(lambda mod=mod: [mod.paged_attention(i, q[ctx - 1 : ctx], k[:1], v[:1], pool, dec)
                                      for i in range(LAYERS)], reps)
        p = median_s(lambda mod=mod: mod.paged_attention(0, q[:prefill], k[:prefill], v[:prefill], pool, pre),
                     max(1, reps // 5))
        outs[name] = [mod.paged_attention(0, q[ctx - 1 : ctx], k[:1], v[:1], pool, dec),
                      mod.paged_attention(0, q[:prefill], k[:prefill], v[:prefill], pool, pre)]
        print(f"{name}: decode attention ({LAYERS} layers, {ctx} keys) {d * 1e3:.1f} ms; prefill attention "
              f"({prefill} tokens, one layer) {p * 1e3:.1f} ms; {torch.get_num_threads()} threads, {load()}")
    if baseline:
        same = all(torch.equal(a, b) for a, b in zip(outs["current"], outs["baseline"], strict=True))
        print(f"bit-identical to the baseline: {same}")


def dequantize(lin: Int4Linear) -> torch.Tensor:
    """The CPU-packed int4 weight as fp32 [N, K] (w = (q - 8) * scale + zero)."""
    n, k = lin.out_features, lin.in_features
    p = lin.packed.view(n // 32, k, 16)
    q = torch.stack([p & 15, p >> 4], 1).transpose(2, 3).reshape(n, k).float()
    sz = lin.scale_zero.float()
    s, z = sz[..., 0].t(), sz[..., 1].t()
    return ((q.view(n, k // 32, 32) - 8) * s[..., None] + z[..., None]).view(n, k)


def prefill_matmul(rows: int, reps: int) -> None:
    rng = np.random.default_rng(0)
    total = {"int4": 0.0, "dequantize": 0.0, "mkl": 0.0}
    for n, k in LAYER_SHAPES:
        lin = random_int4(n, k, rng)
        x = torch.randn(rows, k)
        w = dequantize(lin)
        a = median_s(lambda lin=lin, x=x: lin(x), reps)
        d = median_s(lambda lin=lin: dequantize(lin), reps)
        m = median_s(lambda x=x, w=w: cpu_fp32_linear(x, w), reps)
        for key, secs in (("int4", a), ("dequantize", d), ("mkl", m)):
            total[key] += secs
        print(f"{n}x{k}, {rows} rows: int4 {a * 1e3:.1f} ms; dequantize {d * 1e3:.1f} + MKL fp32 {m * 1e3:.1f} ms")
    print(f"{LAYERS} layers: int4 {total['int4'] * LAYERS:.2f} s, dequantize {total['dequantize'] * LAYERS:.2f} s + "
          f"MKL {total['mkl'] * LAYERS:.2f} s; {torch.get_num_threads()} threads, {load()}")


def profile_decode(steps: int, weights: str) -> None:
    """The default model's decode steps after a 128-token prompt: torch.profiler's top ops, then wall time per
    part (each linear kind, attention, the head) from timing wrappers."""
    from torch.profiler import profile

    from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
    from hafiza.models import llama, load_model
    from hafiza.models.loader import default_model_path

    loaded = load_model(default_model_path(), device="cpu", weights=weights)
    model = loaded.model
    engine = LLMEngine(loaded, EngineConfig(kv_memory="512MiB", enable_prefix_caching=False))
    ids = loaded.tokenizer.encode("A transformer keeps the keys and values of every token it has read. " * 20)[:128]
    spent: dict[str, float] = {}

    def timed(name: str, f: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(*args: object) -> torch.Tensor:
            t = time.perf_counter()
            out = f(*args)
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
            return out
        return run

    def decode(n: int) -> float:
        engine.add_request(ids, SamplingParams(max_tokens=n + 1, temperature=0, ignore_eos=True))
        engine.step()  # the prompt
        spent.clear()
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - t

    decode(2)
    with profile() as prof:
        decode(steps)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    for lw in model.layers:
        for kind in ("qkv", "o", "gate_up", "down"):
            setattr(lw, kind, timed(kind, getattr(lw, kind)))
    model.logits = timed("head", model.logits)
    llama.paged_attention = timed("attention", llama.paged_attention)
    secs = decode(steps)
    parts = ", ".join(f"{k} {v / steps * 1e3:.1f}" for k, v in spent.items())
    print(f"decode step {secs / steps * 1e3:.1f} ms: {parts} ms; {torch.get_num_threads()} threads, {load()}")


def batch(reps: int, new_tokens: int, streams: int) -> None:
    """`hafiza bench batch`'s workload at `streams` streams, --weights auto and fp32 interleaved, medians."""
    from hafiza.bench.engine_benches import bench_batch
    from hafiza.models import load_model
    from hafiza.models.loader import default_model_path

    models = {w: load_model(default_model_path(), device="cpu", weights=w) for w in ("auto", "fp32")}
    got: dict[str, list[float]] = {w: [] for w in models}
    for _ in range(reps):
        for w, loaded in models.items():
            got[w].append(bench_batch(loaded, [streams], new_tokens)["results"][0]["tokens_per_s"])
            print(f"{w}: {got[w][-1]:.2f} tok/s, {load()}", flush=True)
    med = {w: statistics.median(v) for w, v in got.items()}
    print(f"{streams} streams, {new_tokens} tokens each, medians of {reps}: auto {med['auto']:.2f}, fp32 "
          f"{med['fp32']:.2f} tok/s (auto/fp32 {med['auto'] / med['fp32']:.2f}); {torch.get_num_threads()} threads")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("probe", choices=["kernels", "attention", "prefill-matmul", "profile", "batch"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ctx", type=int, default=170)
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--baseline", default=None)
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--streams", type=int, default=16)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.probe == "kernels":
        kernels(a.reps)
    elif a.probe == "attention":
        attention_probe(a.ctx, a.prefill, a.reps, a.baseline)
    elif a.probe == "prefill-matmul":
        prefill_matmul(a.rows, max(1, a.reps // 3))
    elif a.probe == "profile":
        profile_decode(a.reps, a.weights)
    else:
        batch(a.reps, a.new_tokens, a.streams)


if __name__ == "__main__":
    main()
