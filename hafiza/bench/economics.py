"""`hafiza bench capacity --model-economics`: when a speculative-coded KV hit beats a zstd hit and a recompute.

Per prefix token, with R raw KV bytes per token, b a codec's stored bits per value (16 = raw bf16), W the tier's
read bandwidth (bytes/s), D the codec's decode speed (raw bytes/s), P the prefill speed (tokens/s) and p the
speculative codec's predictor rerun as a fraction of a prefill (0 for codecs without one):

    hit(codec)  = R·b/(16·W) + R/D + p/P          recompute = 1/P
    a hit beats recompute  ⇔  R·b/(16·W) + R/D < (1 − p)/P
    speculative (s) beats another codec (o) per hit  ⇔  R·(b_o − b_s)/(16·W) > R/D_s − R/D_o + p/P

so a speculative hit beats both exactly when W_min < W < W_cross and P < P_max, with

    W_min   = (R·b_s/16) / ((1 − p)/P − R/D_s)          (the slowest tier on which it still beats recompute)
    W_cross = (R·(b_o − b_s)/16) / (R/D_s − R/D_o + p/P)  (the fastest tier on which it still beats codec o)
    P_max   = (1 − p) / (R·b_s/(16·W) + R/D_s)           (the fastest prefill it still beats)

Over a workload whose token hit rate is h, mean TTFT relative to no tier is 1 − h·(1 − hit·P). The inputs for this
machine are read from a capacity run's `x-hafiza-tiers` reasons (the cost model prints the bytes, bandwidth,
decode time, predictor speed and prefill speed behind every decision); the published ones are quoted with sources.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

INF = math.inf


@dataclass(frozen=True)
class CodecCost:
    """What one stored form of the KV costs to load: bits per value, decode speed, and whether it reruns the
    predictor."""

    name: str
    bits: float
    decode_bps: float  # raw bytes decoded per second (math.inf: free)
    predicted: bool = False


@dataclass(frozen=True)
class Setting:
    """A machine and model: raw KV bytes per token, prefill speed and the predictor's cost as a fraction of it."""

    label: str
    raw_bytes_per_token: float
    prefill_tps: float
    predictor_cost: float  # p: predictor seconds / prefill seconds over the same tokens


def _decode_s(raw: float, codec: CodecCost) -> float:
    return 0.0 if math.isinf(codec.decode_bps) else raw / codec.decode_bps


def _predict_share(s: Setting, codec: CodecCost) -> float:
    return s.predictor_cost if codec.predicted else 0.0


def recompute_s(s: Setting) -> float:
    """Seconds per token to prefill it."""
    return 1.0 / s.prefill_tps


def hit_s(s: Setting, codec: CodecCost, tier_bps: float) -> float:
    """Seconds per token to load it from a tier of `tier_bps` in `codec`: transfer + decode (+ predictor)."""
    r = s.raw_bytes_per_token
    return r * codec.bits / 16 / tier_bps + _decode_s(r, codec) + _predict_share(s, codec) / s.prefill_tps


def min_bandwidth(s: Setting, codec: CodecCost) -> float:
    """The slowest tier (bytes/s) on which a hit in `codec` still beats recompute (inf: none)."""
    r = s.raw_bytes_per_token
    room = (1 - _predict_share(s, codec)) / s.prefill_tps - _decode_s(r, codec)
    return r * codec.bits / 16 / room if room > 0 else INF


def max_prefill(s: Setting, codec: CodecCost, tier_bps: float) -> float:
    """The fastest prefill (tokens/s) that a hit in `codec` from a tier of `tier_bps` still beats (0: none)."""
    r = s.raw_bytes_per_token
    cost = r * codec.bits / 16 / tier_bps + _decode_s(r, codec)
    left = 1 - _predict_share(s, codec)
    if left <= 0:
        return 0.0
    return left / cost if cost > 0 else INF


def min_decode(s: Setting, codec: CodecCost, tier_bps: float) -> float:
    """The decode speed (raw bytes/s) `codec` needs for a hit to beat recompute on this tier (inf: no speed does)."""
    r = s.raw_bytes_per_token
    room = (1 - _predict_share(s, codec)) / s.prefill_tps - r * codec.bits / 16 / tier_bps
    return r / room if room > 0 else INF


def max_predictor_cost(s: Setting, codec: CodecCost, tier_bps: float) -> float:
    """The predictor cost (fraction of a prefill) below which a predicted hit on this tier beats recompute."""
    r = s.raw_bytes_per_token
    return 1 - s.prefill_tps * (r * codec.bits / 16 / tier_bps + _decode_s(r, codec))


def crossover_bandwidth(s: Setting, spec: CodecCost, other: CodecCost) -> float:
    """The fastest tier (bytes/s) on which a hit in `spec` still beats a hit in `other` (inf: on every tier;
    0: on none)."""
    r = s.raw_bytes_per_token
    saved = r * (other.bits - spec.bits) / 16
    extra = (_decode_s(r, spec) - _decode_s(r, other)
             + (_predict_share(s, spec) - _predict_share(s, other)) / s.prefill_tps)
    if extra <= 0:
        return INF if saved > 0 else 0.0
    return saved / extra if saved > 0 else 0.0


def pays(s: Setting, spec: CodecCost, other: CodecCost, tier_bps: float) -> bool:
    """Whether a hit in `spec` beats both a hit in `other` and a recompute."""
    h = hit_s(s, spec, tier_bps)
    return h < recompute_s(s) and h < hit_s(s, other, tier_bps)


def ttft_ratio(hit_rate: float, hit: float, recompute: float) -> float:
    """Mean TTFT of a workload relative to no tier, when a fraction `hit_rate` of its tokens load at `hit` s/token
    and the rest are recomputed at `recompute` s/token (each loaded token replaces a recompute)."""
    return 1 - hit_rate * (1 - hit / recompute)


# -- inputs measured by a capacity run: the cost model's own reasons --------------------------------------------

_LOAD = re.compile(r"([\d.]+) MB from (\S+) at ([\d.]+) MB/s(?! \(default\))")
_DECODE = re.compile(r"\+ decode ([\d.]+) ms")
_PREDICT = re.compile(r"predictor on (\d+) tokens at ([\d.]+) tok/s")
_RECOMPUTE = re.compile(r"recompute (\d+) tokens at ([\d.]+) tok/s")


@dataclass(frozen=True)
class Reason:
    """The numbers in one cost-model reason (None where the reason lacks them)."""

    tokens: int
    prefill_tps: float
    stored_bytes: float | None = None
    tier_bps: float | None = None
    decode_s: float | None = None
    predict_tps: float | None = None


def parse_reason(why: str) -> Reason | None:
    """The figures of a `why=` reason, or None when it names no recompute speed (a miss, an unmeasured prefill)."""
    rec = _RECOMPUTE.search(why)
    if rec is None:
        return None
    load, dec, pred = _LOAD.search(why), _DECODE.search(why), _PREDICT.search(why)
    return Reason(int(rec.group(1)), float(rec.group(2)),
                  float(load.group(1)) * 1e6 if load else None, float(load.group(3)) * 1e6 if load else None,
                  float(dec.group(1)) / 1e3 if dec else None, float(pred.group(2)) if pred else None)


def _median(xs: Iterable[float | None]) -> float | None:
    vals = [x for x in xs if x is not None and x > 0]
    return statistics.median(vals) if vals else None


@dataclass(frozen=True)
class Measured:
    """A run's formula inputs (medians over its reasons; None where it never measured one) and its outcome."""

    codec: str
    popularity: str
    prefill_tps: float | None
    tier_bps: float | None
    bits: float | None
    decode_bps: float | None
    predict_tps: float | None
    hit_rate: float
    mean_ttft_s: float
    lookups: int


def measure_run(row: Mapping[str, Any], raw_bytes_per_token: float) -> Measured:
    """The inputs a capacity results row's reasons show (bits from stored bytes per token over raw)."""
    reasons = [r for s in row.get("samples", []) if (r := parse_reason(s.get("why", ""))) is not None]
    predicted_only = row["codec"] == "speculative"  # its own bytes and decode only where it loaded predicted
    coded = [r for r in reasons if r.predict_tps is not None or not predicted_only]
    bits = [16 * r.stored_bytes / (raw_bytes_per_token * r.tokens) for r in coded if r.stored_bytes]
    decode = [raw_bytes_per_token * r.tokens / r.decode_s for r in coded if r.decode_s]
    return Measured(row["codec"], row.get("popularity", ""), _median(r.prefill_tps for r in reasons),
                    _median(r.tier_bps for r in reasons), _median(bits), _median(decode),
                    _median(r.predict_tps for r in reasons), float(row["hit_rate"]), float(row["mean_ttft_s"]),
                    len(reasons))


@dataclass(frozen=True)
class Check:
    """One run's mean TTFT as the formula predicts it from the no-tier run, its hit rate and its inputs."""

    codec: str
    popularity: str
    hit_rate: float
    hit_over_recompute: float | None
    predicted_s: float | None
    measured_s: float


# the speculative codec on this machine when a run loaded nothing predicted: `hafiza bench predictor` (docs/CODEC.md)
BENCH_PREDICTOR = CodecCost("speculative", 4.13, 20.3e6, predicted=True)
BENCH_PREDICTOR_COST = 0.49


def machine_inputs(runs: Sequence[Measured], raw_bytes_per_token: float) -> tuple[Setting | None,
                                                                                  dict[str, CodecCost], float | None]:
    """This machine's setting (prefill and predictor cost pooled over every run), each codec's measured cost,
    and the Redis bandwidth (medians over the runs that measured them). A speculative codec no run loaded
    predicted gets `hafiza bench predictor`'s figures instead (BENCH_PREDICTOR, BENCH_PREDICTOR_COST)."""
    prefill = _median(m.prefill_tps for m in runs)
    predict = _median(m.predict_tps for m in runs if m.codec == "speculative")
    tier = _median(m.tier_bps for m in runs)
    codecs: dict[str, CodecCost] = {}
    for name in sorted({m.codec for m in runs}):
        mine = [m for m in runs if m.codec == name]
        bits, decode = _median(m.bits for m in mine), _median(m.decode_bps for m in mine)
        if bits is not None and decode is not None:
            codecs[name] = CodecCost(name, bits, decode, predicted=name == "speculative")
    if any(m.codec == "speculative" for m in runs) and "speculative" not in codecs:
        codecs["speculative"] = BENCH_PREDICTOR
    if prefill is None:
        return None, codecs, tier
    cost = prefill / predict if predict else BENCH_PREDICTOR_COST
    return Setting("this machine (measured)", raw_bytes_per_token, prefill, cost), codecs, tier


def check_runs(runs: Sequence[Measured], setting: Setting | None, codecs: Mapping[str, CodecCost],
               tier_bps: float | None) -> list[Check]:
    """Predicted against measured mean TTFT for every run with a no-tier run of the same popularity."""
    out = []
    floor = {m.popularity: m.mean_ttft_s for m in runs if m.codec == "none"}
    for m in runs:
        if m.codec == "none" or m.popularity not in floor:
            continue
        codec = codecs.get(m.codec)
        if m.codec == "speculative" and m.predict_tps is None:  # it loaded only fallback-coded blocks
            codec = codecs.get("fast")
        ratio = None
        if setting is not None and codec is not None and tier_bps:
            ratio = hit_s(setting, codec, tier_bps) / recompute_s(setting)
        predicted = floor[m.popularity] * ttft_ratio(m.hit_rate, ratio, 1.0) if ratio is not None else None
        out.append(Check(m.codec, m.popularity, m.hit_rate, ratio, predicted, m.mean_ttft_s))
    return out


# -- published figures --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    """One published (or, where marked, assumed) input, with where it comes from."""

    name: str
    value: float
    unit: str
    source: str
    assumption: bool = False


TRTLLM_PERF = ("https://github.com/NVIDIA/TensorRT-LLM/blob/00f37686aa854010d68bcbd0f4ab000221541ca6/docs/source/"
               "performance/perf-overview.md")
LLAMA_CONFIG = "https://huggingface.co/NbAiLab/nb-llama-3.1-8B/blob/main/config.json (copy of meta-llama/Llama-3.1-8B)"
QWEN_CONFIG = ("https://huggingface.co/onnx-community/Qwen2.5-1.5B-Instruct/blob/"
               "94677ac90364afdc2b476788d085a9680efde737/config.json (copy of Qwen/Qwen2.5-1.5B-Instruct)")
# non-embedding parameters from those configs: layers × (2·h² + 2·h·kv·d + 3·h·ffn)
LLAMA_8B_PARAMS = 32 * (2 * 4096**2 + 2 * 4096 * 8 * 128 + 3 * 4096 * 14336)
QWEN_1_5B_PARAMS = 28 * (2 * 1536**2 + 2 * 1536 * 2 * 128 + 3 * 1536 * 8960)
H200_8B_PREFILL = 3538 * 2048 / 128  # output tok/s at ISL/OSL 2048/128, times input tokens per output token

PUBLISHED: tuple[Figure, ...] = (
    Figure("H200 prefill, Llama-3.1-8B (FP8, TP1)", H200_8B_PREFILL, "tok/s",
           f"TensorRT-LLM perf overview, Llama 3.1 8B, H200 TP1 FP8, ISL/OSL 2048/128: 3,538 output tok/s, so "
           f"3,538 × 2048/128 input tok/s; a lower bound (the GPU also decoded 128 tokens per request). {TRTLLM_PERF}"),
    Figure("H200 prefill, Qwen2.5-1.5B", H200_8B_PREFILL * LLAMA_8B_PARAMS / QWEN_1_5B_PARAMS, "tok/s",
           "no published H200 figure found: the 8B figure scaled by non-embedding parameters "
           f"({LLAMA_8B_PARAMS / 1e9:.2f} B / {QWEN_1_5B_PARAMS / 1e9:.2f} B, from the configs below); optimistic, "
           "a small model uses a GPU less well", assumption=True),
    Figure("KV bytes/token, Llama-3.1-8B (bf16)", 2 * 32 * 8 * 128 * 2, "B",
           f"32 layers × K,V × 8 KV heads × 128 dims × 2 B: {LLAMA_CONFIG}"),
    Figure("KV bytes/token, Qwen2.5-1.5B (bf16)", 2 * 28 * 2 * 128 * 2, "B",
           f"28 layers × K,V × 2 KV heads × 128 dims × 2 B: {QWEN_CONFIG}"),
    Figure("predictor cost on the GPU (fraction of a prefill)", 0.5, "",
           "not measured on a GPU: an int8 copy on tensor cores with twice bf16's peak (the CPU default measured "
           "0.49, docs/CODEC.md)", assumption=True),
)
LINKS_GBPS = (10, 25, 100)  # at line rate, no protocol overhead (an assumption in Redis's favour)
# this machine's measured codecs (docs/CODEC.md, `hafiza bench predictor`; one CPU core's decode), and the same bits
# with a free decode: the bound a GPU-side decoder could approach
CPU_CODECS = (CodecCost("raw", 16.0, INF), CodecCost("zstd", 11.84, 282e6), CodecCost("fast", 10.59, 692e6),
              CodecCost("speculative", 4.13, 20.3e6, predicted=True))
FREE_DECODE = (CodecCost("zstd", 11.84, INF), CodecCost("speculative", 4.13, INF, predicted=True))


def published_settings() -> list[Setting]:
    """The two H200 settings the published figures give."""
    f = {x.name: x.value for x in PUBLISHED}
    p = f["predictor cost on the GPU (fraction of a prefill)"]
    return [Setting("H200, Llama-3.1-8B", f["KV bytes/token, Llama-3.1-8B (bf16)"],
                    f["H200 prefill, Llama-3.1-8B (FP8, TP1)"], p),
            Setting("H200, Qwen2.5-1.5B", f["KV bytes/token, Qwen2.5-1.5B (bf16)"],
                    f["H200 prefill, Qwen2.5-1.5B"], p)]


# -- report ------------------------------------------------------------------------------------------------------


def _rate(value: float, unit: str, scale: float, inf: str, zero: str = "never") -> str:
    """A rate for a break-even column: `inf` and `zero` say what the unbounded ends mean there."""
    if math.isinf(value):
        return inf
    return zero if value <= 0 else f"{value / scale:,.3g} {unit}"


def _gbit(bps: float, inf: str) -> str:
    return _rate(bps * 8, "Gb/s", 1e9, inf)


def per_hit_rows(s: Setting, codecs: Sequence[CodecCost], tier_bps: float) -> list[dict[str, Any]]:
    """One row per codec: per-token hit time, its ratio to recompute, and the break-evens."""
    zstd = next((c for c in codecs if c.name == "zstd"), None)
    rows = []
    for c in codecs:
        h = hit_s(s, c, tier_bps)
        rows.append({"codec": c.name, "hit_us": h * 1e6, "over_recompute": h / recompute_s(s),
                     "min_bandwidth": min_bandwidth(s, c), "max_prefill": max_prefill(s, c, tier_bps),
                     "min_decode": min_decode(s, c, tier_bps),
                     "cross_zstd": (crossover_bandwidth(s, c, zstd) if c.predicted and zstd else None),
                     "max_predictor_cost": max_predictor_cost(s, c, tier_bps) if c.predicted else None,
                     "pays": (pays(s, c, zstd, tier_bps) if c.predicted and zstd else h < recompute_s(s))})
    return rows


def economics(data: Mapping[str, Any]) -> dict[str, Any]:
    """The model's inputs, its check against a capacity run, and its evaluation at the published figures."""
    cfg = data["config"]
    raw = float(cfg["raw_block_bytes"]) / int(cfg["block_size"])
    runs = [measure_run(row, raw) for row in data["results"]]
    setting, codecs, tier = machine_inputs(runs, raw)
    here = per_hit_rows(setting, list(codecs.values()), tier) if setting and tier else []
    published = []
    for s in published_settings():
        for gbps in LINKS_GBPS:
            w = gbps * 1e9 / 8
            for label, cs in (("CPU decoders (measured here)", CPU_CODECS), ("free decode (bound)", FREE_DECODE)):
                published.append({"setting": s.label, "link_gbps": gbps, "decoders": label,
                                  "recompute_us": recompute_s(s) * 1e6, "rows": per_hit_rows(s, cs, w)})
    return {"raw_bytes_per_token": raw, "runs": [m.__dict__ for m in runs],
            "predicted_measured": any(m.predict_tps for m in runs),
            "setting": setting.__dict__ if setting else None, "codecs": {k: v.__dict__ for k, v in codecs.items()},
            "tier_bps": tier, "here": here, "checks": [c.__dict__ for c in check_runs(runs, setting, codecs, tier)],
            "published_figures": [f.__dict__ for f in PUBLISHED], "links_gbps": list(LINKS_GBPS),
            "published": published}


def print_economics(e: Mapping[str, Any], console: Console | None = None) -> None:
    """The inputs, this machine's break-evens, the check and the published evaluation, as tables."""
    con = console or Console(width=170)
    t = Table(title="Formula inputs measured by this run (medians of the cost model's reasons)")
    for col in ("popularity", "codec", "lookups", "prefill tok/s", "Redis MB/s", "bits/value", "decode MB/s",
                "predictor tok/s", "hit rate", "mean TTFT s"):
        t.add_column(col, justify="right")

    def num(x: float | None, fmt: str = "{:,.0f}", scale: float = 1.0) -> str:
        return "–" if x is None else fmt.format(x / scale)

    for m in e["runs"]:
        t.add_row(m["popularity"], m["codec"], str(m["lookups"]), num(m["prefill_tps"]), num(m["tier_bps"], scale=1e6),
                  num(m["bits"], "{:.2f}"), num(m["decode_bps"], "{:,.1f}", 1e6), num(m["predict_tps"]),
                  f"{m['hit_rate']:.1%}", f"{m['mean_ttft_s']:.3f}")
    con.print(t)
    s = e["setting"]
    if s is None or not e["here"]:
        con.print("[yellow]this run measured no prefill speed or no tier bandwidth: no break-even for this "
                  "machine[/yellow]")
    else:
        con.print(f"this machine: R = {e['raw_bytes_per_token']:,.0f} B/token, P = {s['prefill_tps']:,.0f} tok/s, "
                  f"p = {s['predictor_cost']:.2f}, W = {e['tier_bps'] / 1e6:,.0f} MB/s"
                  + ("" if e["predicted_measured"] else "; speculative: no predicted load in this run, so its bits, "
                     "decode speed and p are `hafiza bench predictor`'s (docs/CODEC.md)"))
        con.print(_hit_table("Per hit on this machine", e["here"], 1e6 / s["prefill_tps"]))
    c = Table(title="Check: mean TTFT predicted from the no-tier run, the hit rate and the inputs, against measured")
    for col in ("popularity", "codec", "hit rate", "hit / recompute", "predicted s", "measured s", "error"):
        c.add_column(col, justify="right")
    for k in e["checks"]:
        err = "–" if k["predicted_s"] is None else f"{(k['predicted_s'] - k['measured_s']) / k['measured_s']:+.0%}"
        c.add_row(k["popularity"], k["codec"], f"{k['hit_rate']:.1%}", num(k["hit_over_recompute"], "{:.2f}"),
                  num(k["predicted_s"], "{:.3f}"), f"{k['measured_s']:.3f}", err)
    con.print(c)
    for f in e["published_figures"]:
        tag = " [ASSUMPTION]" if f["assumption"] else ""
        con.print(f"- {f['name']}: {f['value']:,.2f} {f['unit']}{tag} — {f['source']}")
    con.print("- links: 10/25/100 Gb/s at line rate, no protocol overhead [ASSUMPTION]")
    for p in e["published"]:
        con.print(_hit_table(f"{p['setting']}, {p['link_gbps']} Gb/s to Redis, {p['decoders']}", p["rows"],
                             p["recompute_us"]))


def _hit_table(title: str, rows: Sequence[Mapping[str, Any]], recompute_us: float) -> Table:
    t = Table(title=f"{title}: recompute {recompute_us:,.2f} µs/token")
    for col in ("codec", "hit µs/token", "hit / recompute", "beats recompute above", "… below prefill",
                "decode needed", "beats zstd below", "predictor cost below", "pays"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["codec"], f"{r['hit_us']:,.2f}", f"{r['over_recompute']:,.2f}",
                  _gbit(r["min_bandwidth"], "never"), _rate(r["max_prefill"], "k tok/s", 1e3, "any"),
                  _rate(r["min_decode"], "GB/s", 1e9, "never"),
                  "" if r["cross_zstd"] is None else _gbit(r["cross_zstd"], "any"),
                  "" if r.get("max_predictor_cost") is None else f"{r['max_predictor_cost']:.2f}",
                  "yes" if r["pays"] else "no")
    return t
