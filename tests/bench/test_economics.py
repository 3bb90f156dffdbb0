"""The speculative tier's break-even model on injected inputs: per-hit times, the break-even bandwidths, prefill and
decode speeds, reading the cost model's reasons, and the check against a run."""

from __future__ import annotations

import math

import pytest

from hafiza.bench.economics import (
    BENCH_PREDICTOR,
    BENCH_PREDICTOR_COST,
    FREE_DECODE,
    PUBLISHED,
    CodecCost,
    Setting,
    check_runs,
    crossover_bandwidth,
    economics,
    hit_s,
    machine_inputs,
    max_predictor_cost,
    max_prefill,
    measure_run,
    min_bandwidth,
    min_decode,
    parse_reason,
    pays,
    recompute_s,
    ttft_ratio,
)

# round numbers: 16,000 raw bytes per token, a 1,000 tok/s prefill, a predictor costing 0.25 of it
S = Setting("test", 16_000.0, 1000.0, 0.25)
ZSTD = CodecCost("zstd", 12.0, 160e6)
SPEC = CodecCost("speculative", 4.0, 40e6, predicted=True)


def test_per_token_times_are_transfer_decode_and_predictor() -> None:
    w = 100e6
    assert recompute_s(S) == pytest.approx(1e-3)
    assert hit_s(S, ZSTD, w) == pytest.approx(16_000 * 12 / 16 / w + 16_000 / 160e6)  # 120 µs + 100 µs
    assert hit_s(S, SPEC, w) == pytest.approx(40e-6 + 400e-6 + 0.25e-3)  # 40 + 400 + 250 µs
    assert hit_s(S, CodecCost("raw", 16.0, math.inf), w) == pytest.approx(160e-6)


def test_break_even_bandwidths_sit_exactly_where_the_hit_times_cross() -> None:
    w_min = min_bandwidth(S, SPEC)  # (1 − 0.25)/1000 − 400 µs = 350 µs of room for 4,000 bytes
    assert w_min == pytest.approx(4_000 / 350e-6)
    assert hit_s(S, SPEC, w_min) == pytest.approx(recompute_s(S))
    w_cross = crossover_bandwidth(S, SPEC, ZSTD)  # 8,000 bytes saved against 300 µs + 250 µs more work
    assert w_cross == pytest.approx(8_000 / 550e-6)
    assert hit_s(S, SPEC, w_cross) == pytest.approx(hit_s(S, ZSTD, w_cross))
    assert w_min < w_cross
    between = (w_min * w_cross) ** 0.5
    assert pays(S, SPEC, ZSTD, between)
    assert not pays(S, SPEC, ZSTD, w_min * 0.9)  # too slow a tier: recompute wins
    assert not pays(S, SPEC, ZSTD, w_cross * 1.1)  # too fast a tier: zstd's extra bytes cost less than the predictor


def test_break_even_prefill_and_decode_speeds() -> None:
    w = 20e6
    p_max = max_prefill(S, SPEC, w)  # (1 − 0.25) / (200 µs + 400 µs)
    assert p_max == pytest.approx(0.75 / 600e-6)
    at = Setting("at", S.raw_bytes_per_token, p_max, S.predictor_cost)
    assert hit_s(at, SPEC, w) == pytest.approx(recompute_s(at))
    d_min = min_decode(S, SPEC, w)  # 750 µs − 200 µs of room for decoding 16,000 bytes
    assert d_min == pytest.approx(16_000 / 550e-6)
    assert hit_s(S, CodecCost("s", 4.0, d_min, predicted=True), w) == pytest.approx(recompute_s(S))
    p_max = max_predictor_cost(S, SPEC, w)  # 1 − 1000 × 600 µs
    assert p_max == pytest.approx(0.4)
    at_p = Setting("p", S.raw_bytes_per_token, S.prefill_tps, p_max)
    assert hit_s(at_p, SPEC, w) == pytest.approx(recompute_s(at_p))


def test_unreachable_break_evens_say_so() -> None:
    slow = CodecCost("slow", 4.0, 1e6, predicted=True)  # decoding alone takes 16 ms > 1 ms of prefill
    assert math.isinf(min_bandwidth(S, slow))
    assert math.isinf(min_decode(S, slow, 1e6))  # 4 ms of transfer alone: no decode speed is enough
    assert crossover_bandwidth(S, ZSTD, ZSTD) == 0.0
    free = CodecCost("free", 4.0, math.inf)  # fewer bytes and no extra work: faster on every tier
    assert math.isinf(crossover_bandwidth(S, free, ZSTD))
    assert max_prefill(Setting("p", 16_000.0, 1000.0, 1.0), SPEC, 1e9) == 0.0  # the predictor costs a prefill


def test_workload_ratio() -> None:
    assert ttft_ratio(0.0, 5.0, 1.0) == 1.0
    assert ttft_ratio(0.5, 0.2, 1.0) == pytest.approx(0.6)
    assert ttft_ratio(0.5, 2.0, 1.0) == pytest.approx(1.5)  # loading slower than recomputing makes it worse


def test_reasons_are_read_as_the_cost_model_writes_them() -> None:
    why = ("load: predict+decode: 0.20 MB from redis at 340 MB/s + decode 3.1 ms + predictor on 64 tokens at 900 "
           "tok/s ~ 71.1 ms ~ 74.8 ms < recompute 48 tokens at 120 tok/s ~ 400.0 ms")
    r = parse_reason(why)
    assert r is not None
    assert (r.tokens, r.prefill_tps, r.stored_bytes, r.tier_bps, r.decode_s, r.predict_tps) == (
        48, 120.0, pytest.approx(0.2e6), pytest.approx(340e6), pytest.approx(3.1e-3), 900.0)
    default = parse_reason("recompute: recompute 32 tokens at 50 tok/s ~ 640 ms <= 1.00 MB from redis at 50 MB/s "
                           "(default) ~ 20 ms")
    assert default is not None and default.tier_bps is None and default.stored_bytes is None
    assert parse_reason("miss: none of the next 3 blocks is in a store tier") is None


def _row(codec: str, pop: str, hit: float, ttft: float, whys: list[str]) -> dict:
    return {"codec": codec, "popularity": pop, "hit_rate": hit, "mean_ttft_s": ttft,
            "samples": [{"why": w} for w in whys]}


def test_measured_inputs_and_the_check_against_the_no_tier_run() -> None:
    raw = 1000.0  # bytes per token
    spec_why = ("load: predict+decode: 0.016 MB from redis at 100 MB/s + decode 32.0 ms + predictor on 64 tokens at "
                "400 tok/s ~ 160 ms ~ 352 ms < recompute 64 tokens at 100 tok/s ~ 640.0 ms")
    fallback_why = "load: 0.060 MB from redis at 100 MB/s + decode 1.0 ms ~ 1.6 ms < recompute 64 tokens at 100 tok/s"
    zstd_why = "load: 0.048 MB from redis at 100 MB/s + decode 0.4 ms ~ 0.9 ms < recompute 64 tokens at 100 tok/s"
    rows = [_row("none", "zipf", 0.0, 4.0, []), _row("zstd", "zipf", 0.1, 3.7, [zstd_why]),
            _row("speculative", "zipf", 0.5, 2.9, [spec_why, fallback_why])]
    runs = [measure_run(r, raw) for r in rows]
    spec = runs[2]
    assert spec.bits == pytest.approx(16 * 16_000 / (raw * 64))  # 4 bits: the predicted reason only
    assert spec.decode_bps == pytest.approx(raw * 64 / 32e-3) and spec.predict_tps == 400.0
    assert runs[1].bits == pytest.approx(12.0) and runs[0].prefill_tps is None
    setting, codecs, tier = machine_inputs(runs, raw)
    assert setting is not None and tier == pytest.approx(100e6)
    assert setting.prefill_tps == 100.0 and setting.predictor_cost == pytest.approx(0.25)
    checks = {c.codec: c for c in check_runs(runs, setting, codecs, tier)}
    ratio = hit_s(setting, codecs["speculative"], tier) / recompute_s(setting)
    assert checks["speculative"].hit_over_recompute == pytest.approx(ratio)
    assert checks["speculative"].predicted_s == pytest.approx(4.0 * (1 - 0.5 * (1 - ratio)))
    assert set(checks) == {"zstd", "speculative"}
    only_fallback = [runs[0], measure_run(_row("fast", "zipf", 0.1, 3.8, [fallback_why]), raw),
                     measure_run(_row("speculative", "zipf", 0.1, 3.9, [fallback_why]), raw)]
    setting2, codecs2, _ = machine_inputs(only_fallback, raw)
    assert setting2 is not None and setting2.predictor_cost == BENCH_PREDICTOR_COST
    assert codecs2["speculative"] == BENCH_PREDICTOR and codecs2["fast"].bits == pytest.approx(15.0)
    fallback_check = next(c for c in check_runs(only_fallback, setting2, codecs2, tier) if c.codec == "speculative")
    assert fallback_check.hit_over_recompute == pytest.approx(hit_s(setting2, codecs2["fast"], tier) * 100)


def test_report_covers_the_published_settings_and_labels_assumptions() -> None:
    data = {"config": {"raw_block_bytes": 16_000.0, "block_size": 16},
            "results": [_row("none", "uniform", 0.0, 1.0, [])]}
    e = economics(data)
    assert e["setting"] is None and e["here"] == [] and e["checks"] == []
    assert {p["link_gbps"] for p in e["published"]} == {10, 25, 100}
    assert {p["setting"] for p in e["published"]} == {"H200, Llama-3.1-8B", "H200, Qwen2.5-1.5B"}
    assert all(f.source for f in PUBLISHED) and any(f.assumption for f in PUBLISHED)
    assert any(not f.assumption and "github.com/NVIDIA/TensorRT-LLM" in f.source for f in PUBLISHED)
    free = next(p for p in e["published"] if p["decoders"].startswith("free") and p["link_gbps"] == 100
                and "8B" in p["setting"])
    assert [r["codec"] for r in free["rows"]] == [c.name for c in FREE_DECODE]

